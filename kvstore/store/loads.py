"""Load plans: the one skeleton behind ``get_into`` and ``acquire``.

In the style of vLLM's offloading manager (``prepare_load`` / ``complete_load``):

1. :meth:`Loader.prepare_load`, under the store lock: match the prefix, count the request, mark
   the matched blocks *in use* (nothing moves or drops them until the load completes);
2. :meth:`Loader.read`, outside the lock: read each block from its fastest reachable copy into
   the buffer it is due in, a run of consecutive blocks on one tier with one ``Tier.read_many``;
   a damaged or missing copy is noted and the next copy tried; the prefix ends at a block with
   no good copy;
3. :meth:`Loader.complete_load`, under the lock: drop the bad copies, count and touch the hits,
   hand the blocks read from slower tiers to the placer for promotion, and take the blocks out
   of use (a lease keeps the ones it holds).

Shared tiers: blocks another node wrote are in no local index; :meth:`Loader.discover` probes
past the end of a match and adopts the blocks that continue the chain.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.block import BlockMeta
from kvstore.clock import Clock
from kvstore.errors import (
    BlockNotFound,
    CorruptBlockError,
    KVStoreError,
    TierIOError,
    TierUnavailableError,
    UsageError,
)
from kvstore.index import NO_PARENT
from kvstore.keys import BlockHash
from kvstore.store.ledger import Ledger, lowest_bit
from kvstore.store.namespaces import NsInfo
from kvstore.store.placer import Placer

log = logging.getLogger("kvstore.store")


@dataclass(slots=True)
class LoadPlan:
    """One load between its prepare and its completion."""

    info: NsInfo
    hashes: Sequence[bytes]
    ids: np.ndarray
    """Ids of the matched leading blocks, in use until the load completes."""
    masks: list[int]
    """Tier mask of each matched block at the match."""
    now: float
    served: list[int] = field(default_factory=list)
    """Tier that served each leading block read (or already held it in place)."""
    bad: list[tuple[int, int, bool]] = field(default_factory=list)
    """(block, tier, corrupt) of each copy that failed its read: dropped at completion."""
    bufs: list[memoryview] = field(default_factory=list)
    """Where each served block's bytes are (the source of a promotion)."""


class Loader:
    def __init__(
        self,
        tiers: Sequence,
        ledger: Ledger,
        placer: Placer,
        lock: threading.RLock,
        clock: Clock,
    ) -> None:
        self.tiers = list(tiers)
        self.ledger = ledger
        self.index = ledger.index
        self.placer = placer
        self.lock = lock
        self.clock = clock
        self.shared = [k for k, t in enumerate(self.tiers) if getattr(t, "shared", False)]

    # ---- the plan -------------------------------------------------------------------------------

    def match(self, info: NsInfo, hashes: Sequence[bytes], now: float) -> tuple[np.ndarray, np.ndarray]:
        """Under the lock: the matched prefix of ``hashes`` in ``info``'s namespace (ids and tier
        masks). A block cached under another namespace ends it: its bytes have that namespace's
        layout (a put may hang blocks under another namespace's prefix, as a hybrid model's
        window pieces hang under its full blocks, but a load never crosses)."""
        m = self.index.match(hashes, now)
        ids, masks = m.ids, m.tiers
        if ids.size:
            other = self.index.ns[ids] != info.nid
            if np.count_nonzero(other):
                n = int(np.argmax(other))
                ids, masks = ids[:n], masks[:n]
        return ids, masks

    def prepare_load(self, info: NsInfo, hashes: Sequence[bytes]) -> LoadPlan:
        with self.lock:
            now = self.clock()
            ids, masks = self.match(info, hashes, now)
            c = self.ledger.counters
            c.loads += 1
            c.load_blocks += len(hashes)
            info.load_blocks += len(hashes)
            if ids.size:
                self.ledger.hold(ids)
            return LoadPlan(info, hashes, ids, masks.tolist(), now)

    def read(self, plan: LoadPlan, bufs: Sequence[memoryview], in_place: int = 0) -> None:
        """Outside the lock: read the leading blocks into ``bufs`` (block ``i`` into ``bufs[i]``),
        each from its fastest reachable tier, appending the tier that served each to
        ``plan.served`` up to the first block with no good copy. A block held by a tier in
        ``in_place`` (a lease's arena) is served where it is, without a read.

        Consecutive blocks whose fastest reachable copy is on the same tier are read with one
        ``read_many`` (one concurrent batch of GETs on an object store, instead of a blocking
        request per block); a block that fails there falls back to its other copies alone.
        """
        masks, hashes = plan.masks, plan.hashes
        avail = self.placer.available_mask()
        i, n = 0, len(masks)
        while i < n:
            if masks[i] & in_place:
                plan.served.append(lowest_bit(masks[i] & in_place))
                plan.bufs.append(bufs[i])
                i += 1
                continue
            first = masks[i] & avail
            if not first:
                if masks[i]:
                    self._note_failure(plan, BlockHash(hashes[i]), -1, None, i)
                return
            k = lowest_bit(first)
            j = i + 1
            while j < n and not masks[j] & in_place and (m := masks[j] & avail) and lowest_bit(m) == k:
                j += 1
            keys = [BlockHash(h) for h in hashes[i:j]]
            for b, r in enumerate(self.tiers[k].read_many(keys, bufs[i:j]), start=i):
                if not isinstance(r, int):
                    if isinstance(r, UsageError):
                        raise r
                    self._note_failure(plan, keys[b - i], k, r, b)
                    t = self._read_block(plan, b, masks[b] & avail & ~(1 << k), bufs[b])
                    if t is None:
                        return
                    plan.served.append(t)
                else:
                    plan.served.append(k)
                plan.bufs.append(bufs[b])
            i = j

    def _read_block(self, plan: LoadPlan, i: int, mask: int, buf: memoryview) -> int | None:
        """Block ``i`` from the fastest tier in ``mask`` with a good copy; that tier or None."""
        key = BlockHash(plan.hashes[i])
        while mask:
            k = lowest_bit(mask)
            mask &= mask - 1
            try:
                self.tiers[k].read_into(key, buf)
                return k
            except (CorruptBlockError, BlockNotFound, TierIOError) as e:
                self._note_failure(plan, key, k, e, i)
        return None

    def _note_failure(self, plan: LoadPlan, key: BlockHash, k: int, e: KVStoreError | None, i: int) -> None:
        """A damaged or missing copy is dropped at completion; an unreachable tier (``e`` None
        or TierUnavailableError) keeps its copy, the read is only counted."""
        if e is None or isinstance(e, TierUnavailableError):
            with self.lock:
                self.ledger.counters.unavailable_reads += 1
            return
        corrupt = isinstance(e, CorruptBlockError)
        log.warning("block %s %s on tier %s: %s", key.hex(), "corrupt" if corrupt else "unreadable", self.tiers[k].name, e)
        plan.bad.append((i, k, corrupt))

    def complete_load(self, plan: LoadPlan, promote_to: int | None) -> int:
        """Under the lock (the caller holds it), for a copying load: account for it, touch the
        hits, promote the blocks read from slower tiers into ``promote_to`` (None: none) and
        take every block out of use. Returns the blocks served."""
        try:
            self.settle(plan)
            n = len(plan.served)
            self.count_hits(plan, n)
            if promote_to is not None and n:
                self.placer.promote(plan.ids[:n], plan.served, plan.bufs, promote_to)
            return n
        finally:
            self.finish(plan, 0)

    def settle(self, plan: LoadPlan) -> None:
        """Drop the copies that failed their read (a later put or promotion writes good ones)."""
        c = self.ledger.counters
        for i, k, corrupt in plan.bad:
            if corrupt:
                c.corrupt_blocks += 1
            else:
                c.tier_errors += 1
            self.ledger.events.bad_copy(plan.hashes[i], k, corrupt)
            bid = int(plan.ids[i])
            if int(self.index.tiers[bid]) & (1 << k):
                self.placer.drop_copy(bid, k)  # a hollow block leaves once out of use

    def finish(self, plan: LoadPlan, keep: int) -> None:
        """Take the blocks out of use, except the first ``keep`` (a lease holds them)."""
        if plan.ids.size > keep:
            self.ledger.unhold(plan.ids[keep:])
        if plan.bad:
            self.ledger.drop_hollow_leaves([int(plan.ids[i]) for i, _, _ in plan.bad])

    def count_hits(self, plan: LoadPlan, n: int) -> None:
        """Under the lock: the leading ``n`` blocks were served: count and touch them."""
        c = self.ledger.counters
        c.hit_blocks += n
        c.loaded_blocks += n
        plan.info.hit_blocks += n
        if not n:
            return
        hit = plan.ids[:n]
        self.ledger.touch_hits(hit, plan.now, plan.now + plan.info.ttl_s)
        for k, hits in Counter(plan.served[:n]).items():
            name = self.tiers[k].name
            c.per_tier_hits[name] += hits
            plan.info.hits_by_tier[name] += hits

    # ---- shared tiers -----------------------------------------------------------------------------

    def discover(self, info: NsInfo, hashes: Sequence[bytes]) -> None:
        """Learn blocks that other nodes wrote to a shared tier, past the end of this node's match.

        Such a block is in no local index until this node lists the tier again. A hash names a
        block and its whole prefix, so asking the tier for the next hashes is safe: the tier
        checks that each object is the block it is named after, :meth:`_adopt` that it extends
        the chain. Bounded by the tier (``discover_max_blocks``); the requests run without the
        lock.
        """
        if not self.shared or not hashes:
            return
        with self.lock:
            n = self.index.match(hashes, self.clock()).num_blocks
            if n == len(hashes) or hashes[n] in self.index:
                return  # a full hit, or a block the index knows (expired, or being written)
        keys = [BlockHash(h) for h in hashes[n:]]
        for k in self.shared:
            tier = self.tiers[k]
            if not tier.available():
                continue
            try:
                metas = tier.probe(keys)
            except KVStoreError as e:
                log.warning("probe of tier %s failed: %s", tier.name, e)
                continue
            if metas:
                with self.lock:
                    self._adopt(info, hashes, n, k, metas)
                return

    def _adopt(self, info: NsInfo, hashes: Sequence[bytes], n: int, k: int, metas: list[BlockMeta]) -> None:
        """Insert probed blocks ``n, n+1, ...`` of ``hashes`` (on tier ``k``) while each one
        continues the chain: same namespace, parent, depth and block size, not expired."""
        idx, now = self.index, self.clock()
        pid: int | None
        pid = NO_PARENT
        if n:
            pid = idx.id_of(hashes[n - 1])
            if pid is None or int(idx.depth[pid]) != n - 1:
                return  # the prefix changed while the tier was asked
        learned: list[tuple[int, BlockMeta]] = []
        for d, meta in enumerate(metas, start=n):
            parent = hashes[d - 1] if d else info.digest
            if (
                meta.ns != info.digest
                or meta.parent != parent
                or meta.depth != d
                or meta.size != info.block_bytes
                or meta.expiry <= now
                or hashes[d] in idx
            ):
                break
            (bid,) = self.ledger.insert_chain([hashes[d]], pid, d, meta.size, info.nid, 1 << k, meta.created, meta.expiry)
            learned.append((bid, meta))
            pid = bid
        for bid, meta in reversed(learned):  # leaves first in the policy, as on a restart
            self.ledger.learn(bid, k, meta.size, meta.created)
        self.ledger.counters.discovered_blocks += len(learned)
