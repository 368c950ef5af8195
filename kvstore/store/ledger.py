"""The ledger: the one place that records which tier holds which copy of which block.

Every change of the store's bookkeeping goes through it: a copy added or dropped, a block
dropped, a chain inserted, blocks held in use or pinned, hits touched, expiry extended. Each
change updates the index, the per-tier policies and the event hooks together, so the three can
never disagree (the policy of the last tier, which orders leaves only, is told when a block
gains its first or loses its last cached child). The ledger does no tier I/O: callers delete or
write bytes, then record what happened here. It never writes index columns directly; the index's
own methods keep its expiry floor true.

Not thread-safe: the store holds its lock around every call.
"""

from __future__ import annotations

import functools
import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from eviction.base import EvictionPolicy
from kvstore.events import StoreEvents
from kvstore.index import NO_PARENT, RadixIndex
from kvstore.keys import BlockHash
from kvstore.retention import PinRecord


def lowest_bit(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


def bits(mask: int) -> list[int]:
    """The tier positions set in ``mask``, fastest first."""
    out = []
    while mask:
        out.append(lowest_bit(mask))
        mask &= mask - 1
    return out


@dataclass(slots=True)
class StoreCounters:
    lookups: int = 0
    lookup_blocks: int = 0
    """Blocks asked for by :meth:`KVStore.lookup` (loads count apart: ``load_blocks``)."""
    lookup_hit_blocks: int = 0
    """Leading blocks :meth:`KVStore.lookup` found cached."""
    loads: int = 0
    load_blocks: int = 0
    """Blocks asked for by loads (``get_into``, ``acquire``)."""
    hit_blocks: int = 0
    """Blocks loads served (the same as ``loaded_blocks``)."""
    loaded_blocks: int = 0
    put_blocks: int = 0
    dedup_blocks: int = 0
    truncated_puts: int = 0
    """Puts that stored only the leading blocks that fit (the rest had no room)."""
    abandoned_reservations: int = 0
    """Reservations (``KVStore.reserve``) dropped without a commit or an abort, aborted by the
    store afterwards."""
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    expirations: int = 0
    failed_room: int = 0
    """Make-rooms that found nothing that may move or leave (nothing was evicted)."""
    corrupt_blocks: int = 0
    tier_errors: int = 0
    tier_writes: int = 0
    skipped_writes: int = 0
    """Demotions into the last tier that admission refused (the block's copy went instead)."""
    skipped_bytes: int = 0
    """Block writes into any tier (placement, promotion, demotion, durable copies)."""
    orphans_dropped: int = 0
    """Blocks found at open whose parent no persistent tier held: no lookup could reach them."""
    dropped_on_close: int = 0
    """Cached blocks a graceful close could not write to any persistent tier (each logged with
    the reason; the descendants they take along are counted too)."""
    recovered_blocks: int = 0
    discovered_blocks: int = 0
    """Blocks other nodes wrote to a shared tier, learned by probing past a lookup miss."""
    foreign_blocks: int = 0
    """Blocks of another schema version or layout found on a persistent tier: never served."""
    unavailable_reads: int = 0
    """Reads skipped or failed because a tier was unreachable (the copy is kept)."""
    per_tier_hits: Counter[str] = field(default_factory=Counter)


class Ledger:
    def __init__(
        self,
        index: RadixIndex,
        policies: list[EvictionPolicy],
        events: StoreEvents,
        counters: StoreCounters,
    ) -> None:
        self.index = index
        self.policies = policies
        self.events = events
        self.counters = counters
        self.last = len(policies) - 1
        self._last_bit = 1 << self.last
        self.dirty_expiry: set[int] = set()
        """Blocks whose expiry moved since the persistent tiers last learned it."""
        self.leased: Counter[int] = Counter()
        """Blocks an :meth:`~kvstore.store.core.KVStore.acquire` lease holds (in use until it is
        given back), by the number of leases."""
        self.kept_out: set[int] = set()
        """Last-tier leaves held out of the policy order because they are pinned (a pin or a
        retention deadline) or leased (:meth:`lease`): a make-room never
        meets them, so its cost does not grow with the number of protected blocks. Offered
        again when the last pin and use are gone (:meth:`_let_in`)."""

    # ---- structure ------------------------------------------------------------------------------

    def insert_chain(
        self,
        hashes: Sequence[bytes],
        parent: int,
        depth0: int,
        size: int,
        nid: int,
        mask: int,
        now: float,
        expiry: float,
    ) -> list[int]:
        """New nodes for a chain under ``parent``; ``mask`` 0 makes them hollow (a put fills
        them), otherwise they are recorded on those tiers (the caller then :meth:`learn` s them)."""
        idx = self.index
        first_child = parent != NO_PARENT and not idx.children[parent]
        ids = idx.insert_chain(hashes, parent, depth0, size, nid, mask, now, expiry).tolist()
        if first_child and ids:
            self._gained_child(parent)
        return ids

    def _gained_child(self, bid: int) -> None:
        if int(self.index.tiers[bid]) & self._last_bit:
            if bid in self.kept_out:  # held already (protected): now held for its child
                self.kept_out.discard(bid)
            else:
                self.policies[self.last].hold(bid)

    def _guarded(self, bid: int) -> bool:
        return bool(self.index.pins[bid]) or bid in self.leased

    def _offer(self, bid: int) -> None:
        """Last-tier ``bid`` lost its last cached child: offer it, unless it is protected (then
        it is kept out until :meth:`_let_in`)."""
        if self._guarded(bid):
            self.kept_out.add(bid)
        else:
            self.policies[self.last].offer(bid)

    def _keep_out(self, ids: np.ndarray) -> None:
        """``ids`` are protected now: their last-tier leaves leave the policy order."""
        idx = self.index
        if not ids.size:
            return
        lb = np.uint8(self._last_bit)
        ids = ids[((idx.tiers[ids] & lb) != 0) & (idx.children[ids] == 0)]
        if not ids.size:
            return
        pol, kept = self.policies[self.last], self.kept_out
        for bid in ids.tolist():
            if bid not in kept:
                kept.add(bid)
                pol.hold(bid)

    def _let_in(self, ids: np.ndarray) -> None:
        """Some protection of ``ids`` was taken off: those no longer protected are offered."""
        kept = self.kept_out
        if not kept or not ids.size:
            return
        idx = self.index
        ids = ids[idx.pins[ids] == 0]
        pol, leased = self.policies[self.last], self.leased
        for bid in ids.tolist():
            if bid in kept and bid not in leased:
                kept.discard(bid)
                pol.offer(bid)

    def _entered_last(self, ids: np.ndarray) -> None:
        """``ids`` entered the last tier's policy (offered if leaves): keep protected ones out."""
        idx = self.index
        if ids.size and (idx.pins[ids] != 0).any():
            self._keep_out(ids[idx.pins[ids] != 0])
        if self.leased:
            self._keep_out(np.array([b for b in ids.tolist() if b in self.leased], np.int64))

    def _unlink(self, bid: int) -> None:
        """``bid`` leaves the index; a parent left childless may leave the last tier now."""
        idx = self.index
        parent = int(idx.parent[bid])
        idx.remove(bid)
        if self.dirty_expiry:
            self.dirty_expiry.discard(bid)
        if self.kept_out:
            self.kept_out.discard(bid)
        if parent != NO_PARENT and not idx.children[parent] and int(idx.tiers[parent]) & self._last_bit:
            self._offer(parent)

    # ---- copies -----------------------------------------------------------------------------------

    def add_copy(
        self, bid: int, k: int, size: int, created: float, deferred: list[tuple[int, int, int]] | None = None
    ) -> None:
        """Tier ``k`` now holds a copy of ``bid``. With ``deferred``, a copy in the last tier
        enters its policy later, from :meth:`enter_deferred` (a put's chain, leaves first)."""
        idx = self.index
        self.events.placed(idx.hash_of(bid), k, int(idx.tiers[bid]), size, int(idx.depth[bid]))
        idx.tiers[bid] |= 1 << k
        self.counters.tier_writes += 1
        if deferred is not None and k == self.last:
            deferred.append((k, bid, size))
        else:
            self.policies[k].insert(bid, size, created)
            if k == self.last and self._guarded(bid):
                self._keep_out(np.array([bid], np.int64))

    def add_copies(
        self, ids: list[int], keys: Sequence[bytes], depth0: int, k: int, size: int, created: float,
        deferred: list[tuple[int, int, int]] | None = None,
    ) -> None:
        """:meth:`add_copy` of each of ``ids`` (distinct blocks of one chain at depths
        ``depth0, depth0 + 1, ...``; ``keys`` their hashes; ``size`` bytes each) in order, in
        one call: a put publishes the chain it staged."""
        if not ids:
            return
        idx = self.index
        arr = np.array(ids, np.int64)
        prior = idx.tiers[arr]
        self.events.placed_many(keys, k, prior.tolist(), size, range(depth0, depth0 + len(ids)))
        idx.tiers[arr] = prior | np.uint8(1 << k)
        self.counters.tier_writes += len(ids)
        if deferred is not None and k == self.last:
            deferred.extend([(k, bid, size) for bid in ids])
        else:
            self.policies[k].insert_many(arr, np.full(arr.size, size, np.int64), created)
            if k == self.last:
                self._entered_last(arr)

    def enter_deferred(self, placed: list[tuple[int, int, int]], now: float) -> None:
        # Leaves first, as after a restart: a last-tier policy that orders by arrival then meets
        # a chain's leaf before its parents. One insert_many (every entry is of the last tier).
        if not placed:
            return
        idx, k = self.index, self.last
        placed = placed[::-1]
        ids = np.array([bid for _, bid, _ in placed], np.int64)
        sizes = np.array([size for _, _, size in placed], np.int64)
        here = (idx.tiers[ids] & np.uint8(1 << k)) != 0  # still there (a removed block is in no tier)
        if not np.logical_and.reduce(here):  # (the ufunc: no Python wrapper)
            ids, sizes = ids[here], sizes[here]
        self.policies[k].insert_many(ids, sizes, now)
        self._entered_last(ids)

    def learn(self, bid: int, k: int, size: int, created: float) -> None:
        """A copy the tier already held (found by a probe) enters tier ``k``'s policy."""
        self.policies[k].insert(bid, size, created)
        if k == self.last and self._guarded(bid):
            self._keep_out(np.array([bid], np.int64))

    def drop_copy(self, bid: int, k: int) -> bool:
        """Tier ``k`` no longer holds ``bid``; True if no copy is left (the node is hollow)."""
        idx = self.index
        idx.tiers[bid] &= ~np.uint8(1 << k)
        self.policies[k].remove(bid)
        if k == self.last and self.kept_out:
            self.kept_out.discard(bid)
        self.events.copy_dropped(idx.hash_of(bid), k)
        return not idx.tiers[bid]

    def drop_block(self, bid: int, reason: str) -> tuple[BlockHash, int]:
        """A leaf leaves the store; returns its key and the tiers whose copies must be deleted."""
        idx = self.index
        key = idx.hash_of(bid)
        mask = int(idx.tiers[bid])
        self.events.dropped(key, mask, reason)
        if mask & (mask - 1):
            for k in bits(mask):
                self.policies[k].remove(bid)
        elif mask:
            self.policies[mask.bit_length() - 1].remove(bid)
        self._unlink(bid)
        return key, mask

    def forget_leaf(self, bid: int, k: int, left: dict[int, int]) -> None:
        """The first half of :meth:`drop_block` for a leaf whose only copy is on tier ``k``, in
        a batched eviction (:meth:`drop_leaves` does the rest, once for the batch): tier ``k``'s
        policy forgets it now, so that its next offer is another block, and a parent left with
        no cached child is offered to the last tier's policy, as :meth:`drop_block` does.
        ``left``: cached children of the parents of the batch, less those already forgotten
        (the index learns of the batch only at its end)."""
        self.policies[k].remove(bid)
        idx = self.index
        p = int(idx.parent[bid])
        if p != NO_PARENT:
            c = left.get(p)
            c = (int(idx.children[p]) if c is None else c) - 1
            left[p] = c
            if not c and int(idx.tiers[p]) & self._last_bit:
                self._offer(p)

    def forget_leaves(self, bids: list[int], left: dict[int, int]) -> None:
        """:meth:`forget_leaf` of each of ``bids`` in order (leaves whose only copy is on the
        last tier), with one call to its policy (:meth:`EvictionPolicy.remove_leaves`)."""
        idx, lb = self.index, self._last_bit
        parent, children, tiers = idx.parent, idx.children, idx.tiers
        offers = []
        for b in bids:  # (a run is short: scalar reads cost less than an array of it)
            p = int(parent[b])
            if p == NO_PARENT:
                offers.append(-1)
                continue
            c = left.get(p)
            c = (int(children[p]) if c is None else c) - 1
            left[p] = c
            if not c and int(tiers[p]) & lb and self._guarded(p):
                self.kept_out.add(p)  # protected: kept out instead of offered
                c = 1
            offers.append(p if not c and int(tiers[p]) & lb else -1)
        self.policies[self.last].remove_leaves(bids, offers)

    def drop_leaves(self, bids: list[int], k: int, reason: str) -> list[BlockHash]:
        """The leaves :meth:`forget_leaf` took (in order, each copy on tier ``k`` only) leave
        the index in one call; returns their keys (the caller deletes the copies)."""
        keys = self.index.remove_many(bids)
        if self.kept_out:
            self.kept_out.difference_update(bids)
        self.events.dropped_many(keys, 1 << k, reason)
        if self.dirty_expiry:
            self.dirty_expiry.difference_update(bids)
        return keys

    def drop_hollow_leaves(self, bids: Sequence[int]) -> None:
        """Hollow leaves (no copy anywhere, no children, unused) leave the index, upwards."""
        if not len(bids):
            return
        idx = self.index
        ids = np.asarray(bids, np.int64)
        ids = ids[(idx.flags[ids] != 0) & (idx.tiers[ids] == 0)]  # the usual case: none is hollow
        if not ids.size:
            return
        for bid in sorted(set(ids.tolist()), key=lambda b: -int(idx.depth[b])):
            while (
                bid != NO_PARENT
                and idx.hash_of_or_none(bid) is not None
                and not idx.tiers[bid]
                and idx.evictable_leaf(bid)
            ):
                parent = int(idx.parent[bid])
                self._unlink(bid)
                bid = parent

    # ---- use, pins, hits ----------------------------------------------------------------------------

    def hold(self, ids: np.ndarray | list[int]) -> None:
        """Mark blocks in use (a read or a move in flight): nothing moves or drops them."""
        self.index.add_in_use(np.asarray(ids, np.int64), 1)

    def unhold(self, ids: np.ndarray | list[int]) -> None:
        self.index.add_in_use(np.asarray(ids, np.int64), -1)

    def lease(self, ids: np.ndarray) -> None:
        """Blocks in use (:meth:`hold`) stay in use under a lease until :meth:`end_lease`: their
        last-tier leaves leave the policy order meanwhile. (A read or a move in flight is
        brief and stays in the order: the make-room skips it.)"""
        self.leased.update(ids.tolist())
        self._keep_out(ids)

    def end_lease(self, ids: np.ndarray) -> None:
        """A lease is given back: its blocks go out of use, and into the order again."""
        leased = self.leased
        for bid in ids.tolist():
            leased[bid] -= 1
            if leased[bid] <= 0:
                del leased[bid]
        self.unhold(ids)
        self._let_in(ids)

    def pin(self, ids: np.ndarray | list[int], keep_out: bool = True) -> None:
        """One more pin on ``ids``; their last-tier leaves leave the policy order unless
        ``keep_out`` is false (a put's own pin while it stages its chain: brief, and on a
        prefix it is about to extend)."""
        arr = np.asarray(ids, np.int64)
        self.index.add_pins(arr, 1)
        if keep_out:
            self._keep_out(arr)

    def unpin(self, ids: np.ndarray | list[int]) -> None:
        arr = np.asarray(ids, np.int64)
        self.index.add_pins(arr, -1)
        self._let_in(arr)

    def release_pin(self, record: PinRecord) -> int:
        """Take one pin record's pin off the blocks it still holds; returns how many."""
        idx = self.index
        held = np.array([i for h in record.hashes if (i := idx.id_of(h)) is not None], dtype=np.int64)
        held = held[idx.pins[held] > 0]
        idx.add_pins(held, -1)
        self._let_in(held)
        return int(held.size)

    def touch_hits(self, hit: np.ndarray, now: float, expiry: float) -> None:
        """A load served the leading blocks ``hit``: refresh them, tell every tier's policy."""
        idx = self.index
        idx.touch(hit, now, expiry)
        self.dirty_expiry.update(hit.tolist())
        # Deepest first so that parents end up more recent than their children (leaves go first).
        # One touch_many per tier: each policy sees its own blocks' touches in the same order.
        policies = self.policies
        rev = hit[::-1].tolist()
        masks = idx.tiers[hit[::-1]].tolist()
        if masks and masks.count(masks[0]) == len(masks):
            # Every block in the same tiers (a hit's usual case): no mask walk per block.
            for k in bits(masks[0]):
                policies[k].touch_many(rev, now)
            return
        for k in bits(functools.reduce(operator.or_, masks, 0)):
            bit = 1 << k
            policies[k].touch_many([bid for bid, m in zip(rev, masks, strict=True) if m & bit], now)

    def extend_expiry(self, ids: np.ndarray, until: float) -> None:
        self.index.extend_expiry(ids, until)
        self.dirty_expiry.update(ids.tolist())
