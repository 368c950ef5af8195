"""The read path of :class:`KVStore`: holding a hit prefix, reading runs of blocks from a tier
into caller buffers outside the lock, discovering blocks other nodes wrote to a shared tier,
and what happens after a load (promotion, refresh of expiry, failure accounting).

A mixin: it relies on the attributes :class:`kvstore.store.core.KVStore` sets up in
``__init__`` and is not used on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from kvstore.block import BlockMeta
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
from kvstore.store._common import (
    _lowest_bit,
    _NsInfo,
)

log = logging.getLogger("kvstore.store")


class ReadPath:

    def _hold_prefix(self, hashes: Sequence[bytes]) -> tuple[np.ndarray, list[int], float]:
        """Match ``hashes``, count the lookup and mark the matched blocks in use (the caller
        takes them out of use). Returns their ids, tier masks and the time of the match."""
        with self._lock:
            now = self._clock()
            m = self.index.match(hashes, now)
            self.counters.lookups += 1
            self.counters.lookup_blocks += len(hashes)
            if m.ids.size:
                self.index.add_in_use(m.ids, 1)
            return m.ids, m.tiers.tolist(), now

    def _read_block(
        self, key: BlockHash, mask: int, buf: memoryview, bad: list[tuple[int, int, bool]], i: int
    ) -> int | None:
        """Read from the fastest reachable tier that has a good copy; returns that tier or None."""
        mask &= self._available_mask()
        while mask:
            k = _lowest_bit(mask)
            mask &= mask - 1
            try:
                self.tiers[k].read_into(key, buf)
                return k
            except (CorruptBlockError, BlockNotFound, TierIOError) as e:
                self._note_failure(key, k, e, bad, i)
        return None

    def _read_runs(
        self,
        hashes: Sequence[bytes],
        masks: list[int],
        bufs: list[memoryview],
        bad: list[tuple[int, int, bool]],
        served: list[int],
    ) -> None:
        """Read the leading blocks, each from its fastest reachable tier, appending the tier that
        served each to ``served`` up to the first block with no good copy.

        Consecutive blocks whose fastest reachable copy is on the same tier are read with one
        ``read_many`` (one concurrent batch of GETs on an object store, instead of a blocking
        request per block); a block that fails there falls back to its other copies alone.
        """
        avail = self._available_mask()
        i, n = 0, len(masks)
        while i < n:
            first = masks[i] & avail
            if not first:
                if masks[i]:
                    self._note_failure(BlockHash(hashes[i]), -1, None, bad, i)
                return
            k = _lowest_bit(first)
            j = i + 1
            while j < n and (m := masks[j] & avail) and _lowest_bit(m) == k:
                j += 1
            keys = [BlockHash(h) for h in hashes[i:j]]
            for b, r in enumerate(self.tiers[k].read_many(keys, bufs[i:j]), start=i):
                if isinstance(r, int):
                    served.append(k)
                    continue
                if isinstance(r, UsageError):
                    raise r
                self._note_failure(keys[b - i], k, r, bad, b)
                t = self._read_block(keys[b - i], masks[b] & avail & ~(1 << k), bufs[b], bad, b)
                if t is None:
                    return
                served.append(t)
            i = j

    def _note_failure(
        self, key: BlockHash, k: int, e: KVStoreError | None, bad: list[tuple[int, int, bool]], i: int
    ) -> None:
        """A failed read of block ``i`` from tier ``k``: a damaged or missing copy is dropped
        after the load (``bad``); an unreachable tier (``e`` None or TierUnavailableError) keeps
        its copy, the read is only counted."""
        if e is None or isinstance(e, TierUnavailableError):
            with self._lock:
                self.counters.unavailable_reads += 1
            return
        corrupt = isinstance(e, CorruptBlockError)
        what = "corrupt" if corrupt else "unreadable"
        log.warning("block %s %s on tier %s: %s", key.hex(), what, self.tiers[k].name, e)
        bad.append((i, k, corrupt))

    def _available_mask(self) -> int:
        """Tiers that can be asked now (not a remote tier behind an open circuit breaker)."""
        return sum(1 << k for k, t in enumerate(self.tiers) if t.available())

    def _discover(self, info: _NsInfo, hashes: Sequence[bytes]) -> None:
        """Learn blocks that other nodes wrote to a shared tier, past the end of this node's match.

        Such a block is in no local index until this node lists the tier again. A hash names a
        block and its whole prefix, so asking the tier for the next hashes is safe: the tier
        checks that each object is the block it is named after, :meth:`_adopt` that it extends
        the chain. Bounded by the tier (``discover_max_blocks``); the requests run without the
        lock.
        """
        if not self._shared or not hashes:
            return
        with self._lock:
            n = self.index.match(hashes, self._clock()).num_blocks
            if n == len(hashes) or hashes[n] in self.index:
                return  # a full hit, or a block the index knows (expired, or being written)
        keys = [BlockHash(h) for h in hashes[n:]]
        for k in self._shared:
            tier = self.tiers[k]
            if not tier.available():
                continue
            try:
                metas = tier.probe(keys)
            except KVStoreError as e:
                log.warning("probe of tier %s failed: %s", tier.name, e)
                continue
            if metas:
                with self._lock:
                    self._adopt(info, hashes, n, k, metas)
                return

    def _adopt(
        self, info: _NsInfo, hashes: Sequence[bytes], n: int, k: int, metas: list[BlockMeta]
    ) -> None:
        """Insert probed blocks ``n, n+1, ...`` of ``hashes`` (on tier ``k``) while each one
        continues the chain: same namespace, parent, depth and block size, not expired."""
        idx, now = self.index, self._clock()
        pid: int | None = NO_PARENT
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
                or meta.size != info.namespace.block_bytes  # type: ignore[union-attr]
                or meta.expiry <= now
                or hashes[d] in idx
            ):
                break
            bid = int(idx.insert_chain([hashes[d]], pid, d, meta.size, info.nid, 1 << k, meta.created, meta.expiry)[0])
            learned.append((bid, meta))
            pid = bid
        for bid, meta in reversed(learned):  # leaves first in the policy, as on a restart
            self._policies[k].insert(bid, meta.size, meta.created)
        self.counters.discovered_blocks += len(learned)

    def _after_load(
        self,
        ids: np.ndarray,
        hashes: Sequence[bytes],
        served: list[int],
        bad: list[tuple[int, int, bool]],
        bufs: list[memoryview],
        info: _NsInfo,
        now: float,
    ) -> None:
        c = self.counters
        for i, k, corrupt in bad:
            # The copy is dropped either way: a later put or promotion writes a good one.
            if corrupt:
                c.corrupt_blocks += 1
            else:
                c.tier_errors += 1
            self.events.bad_copy(hashes[i], k, corrupt)
            self._drop_copy(int(ids[i]), k, hashes[i])
        n = len(served)
        c.hit_blocks += n
        c.loaded_blocks += n
        if not n:
            return
        hit = ids[:n]
        self.index.touch(hit, now, now + info.ttl_s)
        self._dirty_expiry.update(hit.tolist())
        # Deepest first so that parents end up more recent than their children (leaves go first).
        for i in range(n - 1, -1, -1):
            bid = int(hit[i])
            mask = int(self.index.tiers[bid])
            while mask:
                k = _lowest_bit(mask)
                mask &= mask - 1
                self._policies[k].touch(bid, now)
        for k in served:
            c.per_tier_hits[self.tiers[k].name] += 1
        if self.config.promote_on_hit:
            for i, k in enumerate(served):
                bid = int(hit[i])
                if k > 0 and not self.index.tiers[bid] & 1:
                    meta = self._meta_for(bid, hashes[i], info)
                    if self._place(bid, 0, bufs[i], meta, protect={int(x) for x in hit}):
                        c.promotions += 1
