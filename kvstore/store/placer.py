"""The placer: where a block lands, how a tier makes room, and the one routine that writes a copy.

Room is *chosen, then applied*. :meth:`Placer.choose_room` walks the tier's policy order and
picks victims without changing anything: a block with a copy elsewhere just loses this copy, a
block on an upper tier moves down, and on the last tier a leaf leaves the store (the last tier's
policy orders leaves only, so the first unpinned, unused candidate is a victim: O(1) or
O(log n) per victim, whatever the shape of the chains). A leaf chosen may expose its parent,
which the same plan may then take. Only a plan that frees enough is applied; when nothing may
move or leave, nothing is evicted. The work cap bounds the policy walk; past it (every
candidate seen was in use or protected) one vectorised pass over the index finds what may
still leave, so the cap never turns "something can leave" into "full".

Applying a plan moves blocks down first (a demotion reads the block into a scratch buffer and
writes it with :meth:`write_copy`; a block whose only persistent copy moves is written durably
before its old copy goes), and evicts only once every demotion it relied on has landed: a
demotion that fails leaves its block where it was, with its copy, and the make-room fails.

Everything runs under the store lock (the caller holds it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from eviction.base import EvictionPolicy
from kvstore.block import CHECKSUM_DEFERRED, BlockMeta, payload_checksum
from kvstore.clock import Clock
from kvstore.config import StoreConfig
from kvstore.errors import (
    BlockNotFound,
    CorruptBlockError,
    TierFullError,
    TierIOError,
    TierUnavailableError,
)
from kvstore.index import NO_PARENT
from kvstore.keys import BlockHash
from kvstore.registry import make_admission
from kvstore.retention import PinBook
from kvstore.store._common import Scratch
from kvstore.store.ledger import Ledger, bits
from kvstore.store.namespaces import NamespaceTable
from kvstore.tree import ChildIndex

log = logging.getLogger("kvstore.store")

MAKE_ROOM_ROUNDS = 4
"""Choose-then-apply rounds per make-room. One round is enough unless the tier's own accounting
disagrees with the plan (a slab tier whose freed blocks are of another size class, or a
demotion whose write failed); each further round plans from what the last one left."""
WRITE_ATTEMPTS = 4
"""Writes tried per placement: a tier may refuse a write it said would fit (a size class ran
out), and gets another make-room before it tries again."""

COPY, DEMOTE, EVICT = 0, 1, 2
"""What a victim does: lose this tier's copy (another tier has one), move down, leave the store."""


@dataclass(frozen=True, slots=True)
class Victim:
    bid: int
    size: int
    action: int


class Placer:
    def __init__(
        self,
        tiers: Sequence,
        ledger: Ledger,
        namespaces: NamespaceTable,
        pins: PinBook,
        config: StoreConfig,
        clock: Clock,
    ) -> None:
        self.tiers = list(tiers)
        self.ledger = ledger
        self.index = ledger.index
        self.namespaces = namespaces
        self.pins = pins
        self.config = config
        self.clock = clock
        self.last = len(self.tiers) - 1
        self.persistent_mask = sum(1 << k for k, t in enumerate(self.tiers) if t.persistent)
        # One scratch buffer per tier level: a demotion from tier k may cascade into one from
        # k+1 while tier k's buffer still holds the block in flight. The last is for copies
        # made by the durable path and on close.
        self.scratch = [Scratch() for _ in range(len(self.tiers) + 1)]
        # Admission to the last tier (eviction/admission.py): a demotion into it may drop a
        # block that could leave anyway instead of writing it. Never a durable put's block.
        self.admission = make_admission(
            config.admission, dict(config.admission_options), self.index, lambda: ledger.counters.hit_blocks)
        self.children_of: ChildIndex | None = None
        """Subtrees of refused inner blocks (built at the first one)."""
        self.closing = False
        """Set while a graceful close persists volatile blocks: admission then refuses nothing
        (a block must not leave the store because the store stops)."""
        self.kept = np.zeros(0, dtype=bool)
        """Per block id: admission never refuses it. Set for a durable put's blocks and for every
        block recovered at open (the persistent tiers' metadata does not say which blocks a
        durable put wrote, so after a restart all of them are kept: nothing to persist, and a
        durable block is never dropped for admission across restarts); cleared when the block
        leaves. An id recycled without passing through :meth:`drop_block` stays kept (the safe
        side: it is written)."""

    # ---- the one write routine ------------------------------------------------------------------

    def write_copy(
        self,
        bid: int,
        k: int,
        src: memoryview,
        meta: BlockMeta,
        *,
        durable: bool = False,
        deferred: list[tuple[int, int, int]] | None = None,
    ) -> bool:
        """Write ``bid`` into tier ``k`` (room must be there) and record the copy. False if the
        tier refused it for room or is unreachable; a device error is counted and raised; an
        unreachable tier raises too when the write was to be durable."""
        tier = self.tiers[k]
        key = self.index.hash_of(bid)
        if meta.checksum == CHECKSUM_DEFERRED and tier.persistent:
            meta = meta.with_checksum(payload_checksum(src))
        try:
            tier.write(key, src, meta, durable=durable)
        except TierFullError:
            return False
        except TierUnavailableError as e:
            if durable:
                raise
            # Unreachable (a remote store is down): like a full tier, the block goes elsewhere.
            log.info("write of %s to tier %s skipped: %s", key.hex(), tier.name, e)
            return False
        except TierIOError as e:
            self.ledger.counters.tier_errors += 1
            log.error("write of %s to tier %s failed: %s", key.hex(), tier.name, e)
            raise
        self.ledger.add_copy(bid, k, meta.size, meta.created, deferred)
        return True

    def place(
        self,
        bid: int,
        k: int,
        src: memoryview,
        meta: BlockMeta,
        protect: set[int],
        *,
        durable: bool = False,
        deferred: list[tuple[int, int, int]] | None = None,
    ) -> bool:
        """Make room in tier ``k`` and write ``bid`` there; False if no room could be made."""
        tier = self.tiers[k]
        if bid not in protect:
            protect = protect | {bid}
        for _ in range(WRITE_ATTEMPTS):
            if not tier.fits(meta.size) and not self.make_room(k, meta.size, protect):
                return False
            if self.write_copy(bid, k, src, meta, durable=durable, deferred=deferred):
                return True
            if not tier.available():
                return False
        return False

    def place_new(
        self,
        bid: int,
        src: memoryview,
        meta: BlockMeta,
        protect: set[int],
        deferred: list[tuple[int, int, int]] | None = None,
    ) -> bool | None:
        """The first tier whose policy admits the block and that can make room. None when no
        policy admits it; False when some did but none could make room."""
        admitted = False
        for k, pol in enumerate(self.ledger.policies):
            if pol.admit(bid, meta.size, meta.created):
                admitted = True
                if self.place(bid, k, src, meta, protect, deferred=deferred):
                    return True
        return False if admitted else None

    def promote(self, ids: np.ndarray, served: list[int], bufs: list[memoryview], target: int) -> int:
        """Copy loaded blocks that ``target`` lacks into it, from the buffers the load just
        filled (no extra read). Returns how many leading blocks ``target`` holds afterwards."""
        protect = set(ids.tolist())
        lead = -1
        tier = self.tiers[target]
        for i in range(len(served)):
            bid = int(ids[i])
            if int(self.index.tiers[bid]) & (1 << target):
                continue
            meta = self.meta_for(bid)
            if self.place(bid, target, bufs[i], meta, protect):
                self.ledger.counters.promotions += 1
                continue
            if lead < 0:
                lead = i
            if not tier.fits(meta.size):
                # No room could be made: what the tier could give up is this load's own blocks
                # (protected), and the rest of the load only adds to them. Asking again for
                # each block would walk the whole tier per block, quadratic in a chain longer
                # than the tier (a coding agent's 1,000-block prefix over a smaller DRAM).
                break
        return len(served) if lead < 0 else lead

    # ---- making room ----------------------------------------------------------------------------

    def make_room(self, k: int, size: int, protect: set[int]) -> bool:
        """Room in tier ``k`` for one block of ``size`` bytes: expire first, then choose victims
        and apply the choice. A failed make-room evicts nothing."""
        tier = self.tiers[k]
        self.expire(self.clock(), self.config.expire_work_cap)
        stuck: set[int] = set()  # blocks whose demotion failed in an earlier round
        evict_leaves = self._evicts_leaves(k)
        for _ in range(MAKE_ROOM_ROUNDS):
            if tier.fits(size):
                return True
            applied = self._take(k, size, 1, protect, stuck, evict_leaves)[1]
            if applied is None:
                plan = self.choose_room(k, size, protect, evict_leaves, stuck)
                if plan is None:
                    if not evict_leaves and not tier.persistent:
                        # Nothing can move down: a volatile tier's leaves may leave (those whose
                        # demotion failed too: they could not move, but they may go).
                        evict_leaves = True
                        stuck.clear()
                        continue
                    self.ledger.counters.failed_room += 1
                    return False
                applied = self.apply_room(k, plan, protect, stuck)
            if not applied and not tier.persistent:
                evict_leaves = True
                stuck.clear()
        return tier.fits(size)

    def spare_copy(self, mask: int, k: int) -> bool:
        """Whether tier ``k``'s copy of a block on the tiers of ``mask`` may simply go: another
        copy stays, and while closing another *persistent* one (else the close would write the
        block back from DRAM, pushing another block's only persistent copy out, and so on)."""
        others = mask & ~(1 << k)
        return bool(others & self.persistent_mask if self.closing else others)

    def _evicts_leaves(self, k: int) -> bool:
        """Whether tier ``k``'s leaves may leave the store: on the last tier, and on a volatile
        tier with no reachable tier below (a remote store is down: for now it is the last).
        A persistent tier's blocks never leave from above: its copy may be the only durable one.
        """
        tier = self.tiers[k]
        return k == self.last or (not tier.persistent and not any(t.available() for t in self.tiers[k + 1 :]))

    def reserve(self, k: int, count: int, size: int, protect: set[int]) -> None:
        """Best effort, before a put places ``count`` new blocks of ``size`` in tier ``k``: make
        the room the tier's usage says they lack, one victim at a time in policy order (the
        victims the per-block placements would have taken, without a make-room per block).
        Stops at the first victim it cannot find; the placements that follow decide."""
        tier = self.tiers[k]
        u = tier.usage()
        # A slab tier's slot of this size class, else the block itself (size_class 0).
        room = (u.capacity_bytes - u.used_bytes) // max(tier.size_class(size) or size, 1)
        if count <= room:
            return
        self.expire(self.clock(), self.config.expire_work_cap)
        stuck: set[int] = set()
        evict_leaves = self._evicts_leaves(k)
        todo = count - room
        while todo > 0:
            done, applied = self._take(k, size, todo, protect, stuck, evict_leaves)
            todo -= done
            if not todo:
                return
            todo -= 1  # the step that ended the run
            if applied is None:
                plan = self.choose_room(k, size, protect, evict_leaves, stuck)
                if plan is None:
                    return
                applied = self.apply_room(k, plan, protect, stuck)
            if not applied and not tier.persistent:
                evict_leaves = True
                stuck.clear()

    def _take(
        self, k: int, size: int, n: int, protect: set[int], stuck: set[int], evict_leaves: bool
    ) -> tuple[int, bool | None]:
        """Up to ``n`` steps of the usual make-room, each without a plan: the policy's first
        offer is a victim big enough on its own, and is applied at once (what
        :meth:`choose_room` would choose and :meth:`apply_room` apply). Leaves that leave the
        store are batched: the policy forgets each at once (its next offer is another block),
        and the index and the tier drop the batch in one call each, before any other kind of
        step and at the end. Returns the steps applied and how the next one ended: True (all
        ``n`` were applied), False (its demotion failed: the block is now in ``stuck``) or None
        (the first offer is no such victim: plan with :meth:`choose_room`)."""
        pol = self.ledger.policies[k]
        idx, tier = self.index, self.tiers[k]
        in_use, sizes, masks, pins, children = idx.in_use, idx.size, idx.tiers, idx.pins, idx.children
        forget = self.ledger.forget_leaf
        batch: list[int] = []
        left: dict[int, int] = {}  # cached children of the batch's parents, less the batch's
        result: bool | None
        done, result = 0, True
        runs = evict_leaves and k == self.last and pol.runs
        try:
            while done < n:
                if runs:
                    taken, whole = self._take_run(pol, n - done, size, protect, stuck, left, batch)
                    done += taken
                    if whole and taken:
                        continue  # (the policy answers the next run; done < n is checked first)
                    # The run stopped at a block that is no plain leaf victim: one step below.
                bid = pol.first()
                if bid is None or bid in protect or bid in stuck or in_use[bid]:
                    result = None
                    break
                bsize = int(sizes[bid])
                if bsize != size and (bsize < size or tier.size_class(bsize) != tier.size_class(size)):
                    result = None
                    break
                if self.spare_copy(int(masks[bid]), k):
                    self._evict_batch(k, batch)
                    self.drop_copy(bid, k)
                elif not evict_leaves:
                    self._evict_batch(k, batch)
                    if not self.demote(bid, k, protect):
                        stuck.add(bid)
                        result = False
                        break
                elif pins[bid] or (left[bid] if bid in left else children[bid]):
                    result = None
                    break
                else:
                    forget(bid, k, left)
                    batch.append(bid)
                done += 1
        finally:
            self._evict_batch(k, batch)
        return done, result

    def _take_run(
        self, pol: EvictionPolicy, n: int, size: int, protect: set[int], stuck: set[int], left: dict[int, int], batch: list[int]
    ) -> tuple[int, bool]:
        """:meth:`_take`'s steps for a run of last-tier victims that the policy answers at
        once (:meth:`EvictionPolicy.victims`): the leading leaves that may leave (each passes
        the checks of one step) are forgotten with one ledger call and join ``batch``.
        Returns how many, and whether that was the whole run (else the next offer is for one
        step of :meth:`_take`)."""
        run = pol.victims(n)
        idx = self.index
        in_use, sizes, masks, pins, children = idx.in_use, idx.size, idx.tiers, idx.pins, idx.children
        k = self.last
        bit, tier = 1 << k, self.tiers[k]
        j = 0
        for bid in run:
            if bid in protect or bid in stuck or in_use[bid] or pins[bid] or int(masks[bid]) != bit:
                break
            bsize = int(sizes[bid])
            if bsize != size and (bsize < size or tier.size_class(bsize) != tier.size_class(size)):
                break
            if left[bid] if bid in left else children[bid]:
                break
            j += 1
        if j:
            took = run if j == len(run) else run[:j]
            self.ledger.forget_leaves(took, left)
            batch.extend(took)
        return j, j == len(run)

    def _evict_batch(self, k: int, batch: list[int]) -> None:
        """The leaves :meth:`_take` chose (the policy forgot them) leave the store; empties
        ``batch``."""
        if not batch:
            return
        kept = self.kept
        if kept.size:
            ids = np.array(batch, np.int64)
            kept[ids[ids < kept.size]] = False
        keys = self.ledger.drop_leaves(batch, k, "capacity")
        self.ledger.counters.evictions += len(batch)
        batch.clear()
        tier = self.tiers[k]
        for key, res in zip(keys, tier.delete_many(keys), strict=True):
            if isinstance(res, TierIOError):
                self.ledger.counters.tier_errors += 1
                log.error("delete of %s from tier %s failed: %s", key.hex(), tier.name, res)

    def choose_room(
        self, k: int, size: int, protect: set[int], evict_leaves: bool, stuck: set[int] | None = None
    ) -> list[Victim] | None:
        """Victims that free ``size`` bytes of tier ``k`` (same size class first), in policy
        order, or None when that much cannot move or leave. With ``evict_leaves`` a victim with
        no other copy is a leaf that leaves the store (the last tier), else it moves down.
        Changes nothing. ``stuck``: blocks protected too (their demotion failed)."""
        idx, tier = self.index, self.tiers[k]
        stuck = stuck or set()
        last = evict_leaves
        others = ((1 << len(self.tiers)) - 1) & ~(1 << k)
        want = tier.size_class(size)
        chosen: list[Victim] = []
        taken: set[int] = set()
        left: dict[int, int] = {}  # last tier: children not yet chosen, per parent of a victim
        freed = 0
        cap = self.config.evict_work_cap
        in_use, pins, children, sizes, masks, parent = idx.in_use, idx.pins, idx.children, idx.size, idx.tiers, idx.parent

        def consider(bid: int, same_class: bool) -> int:
            """The bytes ``bid`` frees if it may be a victim (0 if not); records it."""
            if bid in protect or bid in taken or bid in stuck or in_use[bid]:
                return 0
            bsize = int(sizes[bid])
            if same_class and tier.size_class(bsize) != want:
                return 0
            if int(masks[bid]) & others and self.spare_copy(int(masks[bid]), k):
                action = COPY
            elif not last:
                action = DEMOTE
            elif pins[bid] or left.get(bid, int(children[bid])):
                return 0
            else:
                action = EVICT
                p = int(parent[bid])
                if p != NO_PARENT:
                    left[p] = left.get(p, int(children[p])) - 1
            chosen.append(Victim(bid, bsize, action))
            taken.add(bid)
            return bsize

        for same_class in (True, False):
            for scanned, bid in enumerate(self.ledger.policies[k].candidates()):
                if scanned >= cap:
                    break
                got = consider(bid, same_class)
                freed += got
                # A leaf that leaves may expose its parent: the same plan may take it next.
                while last and got and freed < size and chosen[-1].action == EVICT:
                    p = int(parent[chosen[-1].bid])
                    if p == NO_PARENT or left.get(p) or not int(masks[p]) & (1 << k):
                        break
                    got = consider(p, same_class)
                    freed += got
                if freed >= size:
                    return chosen
        # The policy walk hit the work cap (or offered too little): ask the index directly.
        for bid in self._movable(k, protect | taken | stuck, last).tolist():
            freed += consider(bid, False)
            if freed >= size:
                return chosen
        return None

    def _movable(self, k: int, protect: set[int], last: bool) -> np.ndarray:
        """Blocks of tier ``k`` that may move or leave now, by one vectorised pass (the slow
        path behind the policy walk: it runs only when the walk found too little)."""
        idx = self.index
        ids = idx.live_ids()
        ids = ids[((idx.tiers[ids] >> k) & 1).astype(bool) & (idx.in_use[ids] == 0)]
        if last:
            others = ((1 << len(self.tiers)) - 1) & ~(1 << k)
            leaf = (idx.children[ids] == 0) & (idx.pins[ids] == 0)
            ids = ids[leaf | ((idx.tiers[ids] & others) != 0)]
            ids = ids[np.argsort(-idx.depth[ids], kind="stable")]  # leaves before their parents
        if protect and ids.size:
            # A mask over the block ids, not np.isin: a put's chain (thousands of ids) is
            # protected while the tier holds a few hundred blocks, and isin sorts both.
            out = np.fromiter(protect, np.int64, len(protect))
            mask = np.zeros(max(int(ids.max()), int(out.max())) + 1, bool)
            mask[out[out >= 0]] = True
            ids = ids[~mask[ids]]
        return ids

    def apply_room(self, k: int, plan: list[Victim], protect: set[int], stuck: set[int]) -> bool:
        """Carry out a plan: demotions first; copies dropped and blocks evicted only once the
        moves the plan counted on have landed. False if a demotion failed (nothing was evicted;
        the block stays where it was, with its copy)."""
        failed = False
        idx, bit = self.index, 1 << k
        for v in plan:
            if not int(idx.tiers[v.bid]) & bit:
                continue  # gone with a block admission refused (its subtree leaves with it)
            if v.action == DEMOTE and not self.demote(v.bid, k, protect):
                stuck.add(v.bid)
                failed = True
        if failed:
            return False  # the plan falls short: let the caller plan again
        for v in plan:
            if not int(idx.tiers[v.bid]) & bit:
                continue
            if v.action == COPY:
                self.drop_copy(v.bid, k)
            elif v.action == EVICT:
                self.drop_block(v.bid, "capacity")
                self.ledger.counters.evictions += 1
        return True

    def demote(self, bid: int, k: int, protect: set[int]) -> bool:
        """Move ``bid`` from tier ``k`` to the next tier down, or to the first lower tier that
        takes it. The old copy goes only after the new one is written; when the old copy is
        the block's last persistent one, the new one is written durably first. False: the block
        is still in tier ``k`` (no lower tier could take it, or its copy could not be read)."""
        idx, tier = self.index, self.tiers[k]
        key = idx.hash_of(bid)
        if k + 1 == self.last:
            below = self._refused(bid, k, protect)
            if below is not None:
                if int(idx.tiers[bid]) & ((1 << k) - 1):
                    # A copy above stays (the block is in use up there): only this one goes.
                    # Refused whole, a block still in DRAM left the store, a clean restart too.
                    self.drop_copy(bid, k)
                    return True
                self._drop_refused(bid, below)
                return True
        mask = int(idx.tiers[bid])
        durable = bool(mask & self.persistent_mask) and not (mask & self.persistent_mask & ~(1 << k))
        self.ledger.hold([bid])  # nothing below may expire or evict it while it moves
        try:
            meta = tier.meta(key) or self.meta_for(bid)
            buf = self.scratch[k].view(meta.size)
            placed = False
            try:
                tier.read_into(key, buf)
                for j in range(k + 1, len(self.tiers)):
                    deep = durable and self.tiers[j].persistent
                    try:
                        placed = self.place(bid, j, buf, meta, protect | {bid}, durable=deep)
                    except TierUnavailableError as e:  # a durable write to a tier that is down
                        log.warning("demotion of %s to %s failed: %s", key.hex(), self.tiers[j].name, e)
                        placed = False
                    if placed:
                        break
            except (CorruptBlockError, BlockNotFound, TierIOError) as e:
                log.warning("demotion of %s from %s failed: %s", key.hex(), tier.name, e)
                self.ledger.counters.tier_errors += 1
            finally:
                del buf
        finally:
            self.ledger.unhold([bid])
        if not placed:
            return False
        self.ledger.counters.demotions += 1
        self.drop_copy(bid, k)
        return True

    def keep_always(self, ids: Sequence[int] | np.ndarray) -> None:
        """Never let admission refuse these blocks (a durable put's, or those recovered at open)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not ids.size:
            return
        need = int(ids.max()) + 1
        if need > self.kept.size:
            grown = np.zeros(max(need, 2 * self.kept.size), dtype=bool)
            grown[: self.kept.size] = self.kept
            self.kept = grown
        self.kept[ids] = True

    def _refused(self, bid: int, k: int, protect: set[int]) -> list[int] | None:
        """Whether the last tier's admission refuses ``bid`` (leaving tier ``k`` for it): None
        if it is to be written, else the cached descendants that leave the store with it
        (leaves first; none for a leaf). Asked only of a block no guarantee holds: unpinned,
        unused, stored by no durable put, not recovered at open; a block with cached children
        only when the rule asks for inner blocks (``admission.inner``) and would refuse it, and
        then only when its whole subtree may go too (:meth:`_subtree_free`): a lookup could
        reach none of it once the block is gone, and the store stays prefix-closed with no
        hollow node. A pin or a durable put covers a whole prefix, so a block that may be
        refused has no pinned or durable descendant."""
        idx, adm = self.index, self.admission
        if self.closing or idx.pins[bid] or idx.in_use[bid] or (bid < self.kept.size and self.kept[bid]):
            return None
        if not self.tiers[self.last].available():
            return None  # the upper tier keeps its leaves' normal fate
        now = self.clock()
        below: list[int] = []
        if idx.children[bid]:
            if not adm.inner:
                return None
            if adm.refuses(bid, now):
                if self.children_of is None:
                    self.children_of = ChildIndex(idx)
                below = self.children_of.below(bid)[::-1]
                if not self._subtree_free(below, k, protect):
                    return None  # written; the rule is not told (as for a pinned block)
        return None if adm.admit(bid, now) else below

    def _subtree_free(self, ids: list[int], k: int, protect: set[int]) -> bool:
        """Whether these blocks may leave with a refused ancestor that leaves tier ``k``: none
        has a copy above ``k`` (a make-room there may be moving it), is in use, pinned, kept or
        protected by the operation in flight."""
        if not ids:
            return True
        idx = self.index
        a = np.array(ids, np.int64)
        if ((idx.tiers[a] & ((1 << k) - 1)) != 0).any() or idx.in_use[a].any() or idx.pins[a].any():
            return False
        kept = self.kept
        if kept.size and kept[a[a < kept.size]].any():
            return False
        return not protect or protect.isdisjoint(ids)

    def _drop_refused(self, bid: int, below: list[int]) -> None:
        """A refused block leaves the store with its cached descendants (leaves first); each
        that had no copy on the last tier is a write saved."""
        idx, c, bit = self.index, self.ledger.counters, 1 << self.last
        keys = []
        for b in [*below, bid]:
            if not int(idx.tiers[b]) & bit:
                c.skipped_writes += 1
                c.skipped_bytes += int(idx.size[b])
            keys.append(idx.hash_of(b))
            self.drop_block(b, "not admitted")
        if below:
            self.admission.cut(keys[:-1])

    # ---- dropping ---------------------------------------------------------------------------------

    def _delete(self, key: BlockHash, mask: int) -> None:
        for k in bits(mask) if mask & (mask - 1) else (mask.bit_length() - 1,) if mask else ():
            try:
                self.tiers[k].delete(key)
            except TierIOError as e:
                self.ledger.counters.tier_errors += 1
                log.error("delete of %s from tier %s failed: %s", key.hex(), self.tiers[k].name, e)

    def delete_unpublished(self, k: int, keys: list[BlockHash]) -> None:
        """Delete copies a put wrote to tier ``k`` but did not publish (the ledger never
        recorded them)."""
        for key in keys:
            self._delete(key, 1 << k)

    def drop_copy(self, bid: int, k: int) -> None:
        """Remove tier ``k``'s copy; a block left with no copy stays in the index only as a
        hollow node (a lookup stops there) until its children are gone."""
        self._delete(self.index.hash_of(bid), 1 << k)
        if self.ledger.drop_copy(bid, k):
            self.ledger.drop_hollow_leaves([bid])

    def drop_block(self, bid: int, reason: str) -> None:
        if bid < self.kept.size:
            self.kept[bid] = False
        key, mask = self.ledger.drop_block(bid, reason)
        self._delete(key, mask)

    def expire(self, now: float, cap: int) -> int:
        for record in self.pins.due(now):  # a guarantee that has run out is released first
            self.ledger.release_pin(record)
        removed = 0
        while removed < cap:
            ids = self.index.expired_leaves(now, cap - removed)
            if not ids.size:
                break
            for bid in ids.tolist():
                self.drop_block(bid, "expired")
            removed += int(ids.size)
        self.ledger.counters.expirations += removed
        return removed

    # ---- metadata ---------------------------------------------------------------------------------

    def meta_for(self, bid: int) -> BlockMeta:
        """Metadata of a cached block, from the fastest tier that keeps it, else rebuilt from
        the index (a tier that keeps none, like HBM)."""
        idx = self.index
        key = idx.hash_of(bid)
        for k in bits(int(idx.tiers[bid])):
            meta = self.tiers[k].meta(key)
            if meta is not None:
                return meta.with_expiry(float(idx.expiry[bid]))
        raise RuntimeError(f"block {key.hex()} has no tier that keeps its metadata")

    def available_mask(self) -> int:
        """Tiers that can be asked now (not a remote tier behind an open circuit breaker)."""
        return sum(1 << k for k, t in enumerate(self.tiers) if t.available())
