"""Store plans: the put path, and durable copies.

``prepare_store`` validates the chain before the index is touched (a repeated hash, or a cached
block whose parent is not the previous hash, is the caller's mistake: UsageError), checks that
the prefix before ``start`` is cached, inserts the uncached suffix as hollow nodes in one atomic
call and pins the chain (its blocks may move down a tier to make room, but none may leave the
store before its child is in). ``fill`` places each new block; a block that finds no room ends
the chain there: the put stores the leading blocks that fit and says how many. ``complete_store``
enters the chain into the last tier's policy leaves first, unpins it and removes the hollow
suffix a short put left.

The bytes of a put move outside the store lock (vLLM's offloading manager: prepare, transfer,
complete). Under the lock, :meth:`Storer.stage` makes room in the first tier for the new suffix
(choose, then apply) and marks its blocks as being written; then, without the lock, one
``write_many`` copies their payloads into the first tier; under the lock again, :meth:`fill`
publishes each copy that landed and places the rest the old way (make room, write), a block that
finds no room ending the chain. Until then the blocks are hollow (a lookup stops there) and
pinned; another put of the same chain stops at them. A copy that landed past the end of the
chain is deleted by :meth:`complete_store`. A put whose first tier refuses some blocks (a
policy's ``admit``) writes under the lock, as do demotions that make room.

Durable puts write each block once: new blocks go straight to the first persistent tier, synced
(before the store lock is taken when the tier has room for them all, so that a slow disk holds
up this put only), and blocks of the chain cached earlier without a persistent copy are copied
there. Every write goes through :meth:`Placer.write_copy`, the routine demotion uses too.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from eviction.base import EvictionPolicy
from kvstore.block import CHECKSUM_DEFERRED, BlockMeta, payload_checksum
from kvstore.errors import KVStoreError, MissingPrefixError, TierFullError, UsageError
from kvstore.index import NO_PARENT
from kvstore.keys import BlockHash
from kvstore.store.ledger import Ledger, lowest_bit
from kvstore.store.namespaces import NsInfo
from kvstore.store.placer import WRITE_ATTEMPTS, Placer
from tiers.base import Arena

log = logging.getLogger("kvstore.store")


@dataclass(slots=True)
class StorePlan:
    info: NsInfo
    hashes: Sequence[bytes]
    start: int
    srcs: list[memoryview]
    now: float
    ids: list[int]
    """Block id of every position of the chain."""
    pinned: list[int]
    fresh: int
    """First position the index did not know (a hollow suffix from there)."""
    prewritten: set[int] = field(default_factory=set)
    """Positions whose durable copy was written before the lock."""
    placed: list[tuple[int, int, int]] = field(default_factory=list)
    """(tier, bid, size) of copies written to the last tier: they enter its policy at the end."""
    new: int = 0
    stored_to: int = 0
    """Positions before this are cached after the fill."""
    staged: list[int] = field(default_factory=list)
    """Positions whose payloads go to the first tier outside the lock (:meth:`Storer.stage`)."""
    metas: list[BlockMeta] = field(default_factory=list)
    """The metadata written with each staged position (in order)."""
    written: dict[int, KVStoreError | None] = field(default_factory=dict)
    """Staged positions not yet published: None when the copy landed, else the error."""


def validate_chain(ledger: Ledger, info: NsInfo, hashes: Sequence[bytes], start: int) -> list[int]:
    """UsageError unless ``hashes`` can be one prefix chain of ``info``'s namespace: distinct
    hashes, and each cached one under the previous hash of the chain, at its position. Returns
    the ids of the leading blocks the index knows (a node's parent is always in it, so the rest
    of the chain is new to it).

    The blocks a put writes (from ``start`` on) must be this namespace's. The cached prefix it
    extends may be another namespace's: a hybrid model's window pieces hang under the blocks of
    its full part (``kvstore.hybrid``), so prefix-closure makes a piece leave before its full
    block. Loads never cross a namespace (``Loader.match`` ends a prefix there)."""
    if len(set(hashes)) != len(hashes):
        seen: dict[bytes, int] = {}
        for i, h in enumerate(hashes):
            if h in seen:
                raise UsageError(
                    f"the chain repeats block hash {bytes(h).hex()} (positions {seen[h]} and {i}); "
                    "a block hash covers its whole prefix, so a chain's hashes are distinct"
                )
            seen[h] = i
    idx = ledger.index
    known = idx.known_prefix(hashes)
    if known:
        ids = np.array(known, np.int64)
        parents = np.empty_like(ids)
        parents[0], parents[1:] = NO_PARENT, ids[:-1]
        bad = (idx.parent[ids] != parents) | (idx.depth[ids] != np.arange(ids.size))
        bad[start:] |= idx.ns[ids[start:]] != info.nid
        if np.count_nonzero(bad):
            i = int(np.argmax(bad))
            raise UsageError(
                f"block {i} of the chain ({bytes(hashes[i]).hex()}) is cached at another place (another "
                "parent, depth or namespace); send the chain's hashes as hash_blocks computes them"
            )
    # Past the cached prefix every block is new to the index: one that is cached elsewhere (a
    # chain [c, q] whose q hangs under another parent) would be inserted twice.
    for i in range(len(known), len(hashes)):
        if hashes[i] in idx:
            raise UsageError(
                f"block {i} of the chain ({bytes(hashes[i]).hex()}) is cached at another place (under "
                "another parent); send the chain's hashes as hash_blocks computes them"
            )
    return known


def _cached(ledger: Ledger, known: list[int]) -> int:
    """How many leading blocks of ``known`` are cached (not hollow)."""
    if not known:
        return 0
    hollow = ledger.index.tiers[np.array(known, np.int64)] == 0
    return int(np.argmax(hollow)) if np.count_nonzero(hollow) else len(known)


class Storer:
    def __init__(self, ledger: Ledger, placer: Placer) -> None:
        self.ledger = ledger
        self.index = ledger.index
        self.placer = placer
        self.tiers = placer.tiers
        self.persistent = [k for k, t in enumerate(self.tiers) if t.persistent]
        self.persistent_mask = placer.persistent_mask
        self.writing: set[int] = set()
        """Blocks a put is writing outside the lock: hollow until it publishes them."""

    # ---- the plan ---------------------------------------------------------------------------------

    def prepare_store(self, info: NsInfo, hashes: Sequence[bytes], start: int, srcs: list[memoryview], now: float) -> StorePlan:
        """Under the lock: validate, insert the hollow suffix, pin the chain."""
        known = validate_chain(self.ledger, info, hashes, start)
        present = _cached(self.ledger, known)
        if present < start:
            raise MissingPrefixError(
                f"block {present} of the chain is not cached, but the put starts at {start}: "
                f"pass blocks from {present} on (start={present})"
            )
        n, fresh = len(hashes), len(known)
        ids = known
        if fresh < n:
            pid = ids[fresh - 1] if fresh else NO_PARENT
            bb = info.block_bytes
            ids = ids + self.ledger.insert_chain(hashes[fresh:], pid, fresh, bb, info.nid, 0, now, now + info.ttl_s)
        self.ledger.pin(ids, keep_out=False)
        return StorePlan(info, hashes, start, srcs, now, ids, list(ids), fresh)

    def _direct(self) -> bool:
        """Whether a put that is not durable writes straight to the first tier (its policy
        admits every block)."""
        return type(self.ledger.policies[0]).admit is EvictionPolicy.admit

    def stage(self, plan: StorePlan) -> None:
        """Under the lock, for a put that is not durable: make room in the first tier for the
        new suffix at once and mark its blocks as being written (:meth:`write_staged`)."""
        if not self._direct() or plan.fresh >= len(plan.hashes):
            return
        ids = plan.ids
        if plan.fresh < len(plan.hashes) - 1:
            self.placer.reserve(0, len(plan.hashes) - plan.fresh, plan.info.block_bytes, set(ids))
        plan.staged = list(range(plan.fresh, len(plan.hashes)))
        self.writing.update(ids[plan.fresh :])

    def write_staged(self, plan: StorePlan) -> None:
        """Outside the lock: the staged payloads into the first tier, one ``write_many``."""
        info, hashes, srcs, start, now = plan.info, plan.hashes, plan.srcs, plan.start, plan.now
        staged = plan.staged
        a, b = staged[0], staged[-1] + 1  # (consecutive positions: the new suffix)
        views = srcs[a - start : b - start]
        if self.tiers[0].persistent:
            checksums = [payload_checksum(v) for v in views]
        else:  # a volatile tier's copies defer theirs (CHECKSUM_DEFERRED)
            checksums = [CHECKSUM_DEFERRED] * len(views)
        plan.metas = metas = _chain_metas(info, hashes, a, checksums, now)
        items = list(zip(cast("list[BlockHash]", hashes[a:b]), views, metas, strict=True))
        try:
            results = self.tiers[0].write_many(items)
        except BaseException:
            plan.written = dict.fromkeys(staged)  # not known which landed: all are deleted
            raise
        plan.written = dict(zip(staged, results, strict=True))

    def fill(self, plan: StorePlan, durable: bool) -> None:
        """Under the lock: publish the staged copies that landed and place the other new
        blocks; the first block that finds no room ends the chain."""
        idx, c, placer = self.index, self.ledger.counters, self.placer
        p = self.persistent[0] if durable and self.persistent else None
        plan.stored_to = plan.start
        direct = p is None and self._direct()
        info, hashes, ids, srcs, start, now = plan.info, plan.hashes, plan.ids, plan.srcs, plan.start, plan.now
        bb, digest, expiry = info.block_bytes, info.digest, plan.now + info.ttl_s
        first, placed, written, writing = self.tiers[0], plan.placed, plan.written, self.writing
        n = len(hashes)
        # Which blocks were cached at the start: nothing below caches a block of the chain but
        # this loop, and the chain is pinned (none of its blocks leaves, a move keeps a copy).
        cached = (idx.tiers[np.array(ids[start:], np.int64)] != 0).tolist() if start < n else []
        for i in range(start, n):
            bid = ids[i]
            if cached[i - start]:
                c.dedup_blocks += 1
                plan.stored_to = i + 1
                continue
            ok: bool | None
            if i in written:
                if i == plan.fresh and not any(written.values()):
                    # Every staged copy landed (the staged blocks are the rest of the chain,
                    # all new): publish them in one call.
                    self.ledger.add_copies(ids[i:], hashes[i:], i, 0, bb, now, placed)
                    written.clear()
                    plan.new += n - i
                    plan.stored_to = n
                    c.put_blocks += n - i
                    break
                err = written.pop(i)
                if err is None:  # landed outside the lock: publish it
                    self.ledger.add_copy(bid, 0, bb, now, placed)
                    ok = True
                else:  # the first tier refused it (room taken meanwhile, or an error): as below
                    ok = placer.place_new(bid, srcs[i - start], plan.metas[i - plan.staged[0]], {bid}, placed)
            elif bid in writing:
                break  # another put is writing this block now: its chain goes on from there
            else:
                src = srcs[i - start]
                # The checksum is computed when a persistent copy is written (Placer.write_copy).
                meta = BlockMeta(digest, hashes[i - 1] if i else digest, i, bb, expiry, CHECKSUM_DEFERRED, now)
                if i in plan.prewritten:
                    self.ledger.add_copy(bid, p, bb, now, placed)  # type: ignore[arg-type]  # prewritten: p is set
                    ok = True
                elif p is not None:
                    ok = placer.place(bid, p, src, meta, {bid}, durable=True, deferred=placed)
                    if not ok:
                        raise TierFullError(
                            f"tier {self.tiers[p].name!r} has no room for a durable copy of block {i}: "
                            "everything on it is pinned or in use; add capacity or unpin prefixes"
                        )
                elif direct and first.fits(bb) and placer.write_copy(bid, 0, src, meta, deferred=placed):
                    ok = True
                else:
                    ok = placer.place_new(bid, src, meta, {bid}, placed)
            if not ok:
                if ok is False:
                    c.truncated_puts += 1  # no room: the put keeps the leading blocks that fit
                break  # (None: no tier admits it; the chain ends here and stays prefix-closed)
            plan.new += 1
            plan.stored_to = i + 1
            c.put_blocks += 1

    def complete_store(self, plan: StorePlan) -> None:
        """Under the lock: delete staged copies that were not published (past the end of a
        short chain); unpin; policies learn the chain leaves first; drop the hollow rest."""
        if plan.staged:
            leftover = [BlockHash(plan.hashes[i]) for i, err in plan.written.items() if err is None]
            self.writing.difference_update(plan.ids[plan.fresh :])
            if leftover:
                self.placer.delete_unpublished(0, leftover)
        self.ledger.unpin(plan.pinned)  # (first: the put's own pin keeps nothing out of the order)
        self.ledger.enter_deferred(plan.placed, plan.now)
        if plan.stored_to < len(plan.hashes):  # (a whole chain stored leaves no hollow block)
            self.ledger.drop_hollow_leaves(plan.pinned)

    # ---- reserve / commit (KVStore.reserve) ------------------------------------------------------

    def reservable(self) -> str | None:
        """None when :meth:`reserve` can serve this store, else why not: the first tier must
        hand out arena slots (a shared-memory DRAM tier) and admit every block."""
        first = self.tiers[0]
        if first.arena() is None:
            return f"its first tier {first.name!r} ({first.kind}) is no shared-memory DRAM arena"
        if not self._direct():
            return f"its first tier's policy ({type(self.ledger.policies[0]).__name__}) may refuse blocks"
        return None

    def reserve(self, plan: StorePlan) -> tuple[int, list[int]]:
        """Under the lock, after :meth:`prepare_store`: slots in the first tier (a DRAM arena)
        for the new blocks of the chain, which stay hollow and pinned until :meth:`commit`.
        Returns the chain position of the first slot and the slots' offsets (one per block
        from there on, in order). The blocks from ``start`` that are cached already count as
        deduplicated; one that is not but that the index knows (another put is writing it)
        ends the reservation there, with no slot; room is made as a put makes it, and a chain
        longer than the room that can be made gets slots for its leading blocks."""
        c = self.ledger.counters
        ids, n, start, fresh = plan.ids, len(plan.hashes), plan.start, plan.fresh
        lead = _cached(self.ledger, ids[start:fresh]) if start < fresh else 0
        c.dedup_blocks += lead
        plan.stored_to = start + lead
        if plan.stored_to < fresh or fresh >= n:
            return plan.stored_to, []
        tier, bb, protect = self._arena(), plan.info.block_bytes, set(ids)
        want = n - fresh
        if want > 1:
            self.placer.reserve(0, want, bb, protect)
        slots = tier.reserve_slots(bb, want)
        misses = 0
        try:
            while len(slots) < want and misses < WRITE_ATTEMPTS and self.placer.make_room(0, bb, protect):
                got = tier.reserve_slots(bb, want - len(slots))
                misses += not got
                slots += got
        except BaseException:
            tier.free_slots(slots)
            raise
        if len(slots) < want:
            c.truncated_puts += 1  # the leading blocks that fit, as a put stores them
        self.writing.update(ids[fresh : fresh + len(slots)])
        return fresh, slots

    def _arena(self) -> Arena:
        """The first tier's arena, where reservations are (:meth:`reservable` said it has one)."""
        arena = self.tiers[0].arena()
        assert arena is not None
        return arena

    @staticmethod
    def slot_entries(plan: StorePlan, first: int, slots: Sequence[int]) -> dict[BlockHash, tuple[int, BlockMeta]]:
        """What :meth:`commit` publishes for reserved blocks ``first, first+1, ...`` in
        ``slots``: ``{key: (offset, record)}`` (:meth:`Arena.publish_slots`). Reads only the
        plan, fixed at the reservation: no lock needed (a caller builds them while the copies
        into the slots are in flight, :meth:`Reservation.prepare`)."""
        # A volatile tier's copies defer their checksums (CHECKSUM_DEFERRED), as in a put.
        metas = _chain_metas(plan.info, plan.hashes, first, [CHECKSUM_DEFERRED] * len(slots), plan.now)
        keys = cast("list[BlockHash]", plan.hashes[first : first + len(slots)])
        return dict(zip(keys, zip(slots, metas, strict=True), strict=True))

    def commit(self, plan: StorePlan, first: int, slots: list[int], count: int,
               entries: dict[BlockHash, tuple[int, BlockMeta]] | None = None, *, free: bool = True) -> None:
        """Under the lock: publish the leading ``count`` reserved slots (their payloads are
        written) as the chain's blocks ``first, first+1, ...``, and give the rest back; then
        :meth:`complete_store` as after a put. ``entries``: :meth:`slot_entries` of every slot,
        built ahead (else built here). ``free=False`` keeps the rest allocated (a quarantine:
        the caller frees them once no copy can still write them)."""
        hashes, ids, now = plan.hashes, plan.ids, plan.now
        tier, bb = self._arena(), plan.info.block_bytes
        self.writing.difference_update(ids[first : first + len(slots)])
        try:
            if count:
                a, b = first, first + count
                if entries is None or len(entries) != len(slots):
                    entries = self.slot_entries(plan, a, slots[:count])
                elif count < len(slots):  # (a short commit: the leading entries, in order)
                    entries = dict(itertools.islice(entries.items(), count))
                tier.publish_slots(entries)
                slots = slots[count:]
                self.ledger.add_copies(ids[a:b], hashes[a:b], a, 0, bb, now, plan.placed)
                plan.new, plan.stored_to = count, b
                self.ledger.counters.put_blocks += count
        finally:
            if free:
                tier.free_slots(slots)
            self.complete_store(plan)

    # ---- durability -------------------------------------------------------------------------------

    def prewrite(self, info: NsInfo, hashes: Sequence[bytes], srcs: list[memoryview], start: int, todo: list[int], now: float) -> KVStoreError | None:
        """Outside the lock: write a durable put's new blocks (positions ``todo``) to the first
        persistent tier in one ``write_many``. Content addressing makes the early copy safe;
        :meth:`fill` records it under the lock. Returns the error of a failed write."""
        tier = self.tiers[self.persistent[0]]
        bb = info.block_bytes
        items = [
            (BlockHash(hashes[i]), srcs[i - start],
             BlockMeta(info.digest, hashes[i - 1] if i else info.digest, i, bb, now + info.ttl_s,
                       payload_checksum(srcs[i - start]), now))
            for i in todo
        ]
        errors = tier.write_many(items, durable=True)
        failed = [e for e in errors if e is not None and not isinstance(e, TierFullError)]
        if failed:
            log.error("durable writes to tier %s failed: %s", tier.name, failed[0])
            return failed[0]
        return None

    def prewrite_todo(self, info: NsInfo, hashes: Sequence[bytes], start: int) -> list[int]:
        """Under the lock: the positions a prewrite should write (new to every persistent tier),
        or none when the first persistent tier lacks room for them all (the locked path makes
        room) or the put will be refused."""
        if not self.persistent:
            return []
        idx = self.index
        if _cached(self.ledger, validate_chain(self.ledger, info, hashes, start)) < start:
            return []
        todo = [i for i in range(start, len(hashes))
                if (bid := idx.id_of(hashes[i])) is None or not int(idx.tiers[bid]) & self.persistent_mask]
        u = self.tiers[self.persistent[0]].usage()
        bb = info.block_bytes
        if len(todo) < 1 or u.capacity_bytes - u.used_bytes < len(todo) * bb:
            return []
        return todo

    def adopt_prewritten(self, plan: StorePlan, todo: list[int]) -> None:
        """Under the lock: which prewritten copies the tier really holds (a write may have been
        refused for room)."""
        tier = self.tiers[self.persistent[0]]
        plan.prewritten = {i for i in todo if not self.index.tiers[plan.ids[i]] and tier.contains(BlockHash(plan.hashes[i]))}

    def make_durable(self, plan: StorePlan) -> None:
        """Under the lock: copy the chain's cached blocks that have no persistent copy (cached
        by earlier puts) to the first persistent tier, synced."""
        if not self.persistent:
            raise UsageError("durable=True needs a persistent tier (nvme or object) in the config")
        self.placer.keep_always(plan.ids[: plan.stored_to])  # never skipped by admission
        self.copy_durable(plan.ids[: plan.stored_to], plan.hashes)

    def copy_durable(self, ids: Sequence[int], hashes: Sequence[bytes]) -> None:
        p = self.persistent[0]
        idx, placer = self.index, self.placer
        for i, bid in enumerate(ids):
            mask = int(idx.tiers[bid])
            if mask & self.persistent_mask or not mask:
                continue
            meta = placer.meta_for(bid)
            src = placer.scratch[-1].view(meta.size)
            try:
                self.tiers[lowest_bit(mask)].read_into(BlockHash(hashes[i]), src)
                if not placer.place(bid, p, src, meta, set(ids), durable=True):
                    raise TierFullError(
                        f"tier {self.tiers[p].name!r} has no room for a durable copy of block {i}; "
                        "add capacity or unpin prefixes"
                    )
            finally:
                del src
        self.tiers[p].flush()


def _chain_metas(info: NsInfo, hashes: Sequence[bytes], a: int, checksums: list[int], now: float) -> list[BlockMeta]:
    """The records of the chain's blocks ``a .. a+len(checksums)-1``, stored at ``now``."""
    b = a + len(checksums)
    parents = list(hashes[a - 1 : b - 1]) if a else [info.digest, *hashes[: b - 1]]
    return BlockMeta.of_chain(info.digest, parents, a, info.block_bytes, now + info.ttl_s, checksums, now)
