"""Placement, eviction, demotion and expiry for :class:`KVStore`: where a new block lands, how
a tier makes room (expired leaves first, then the policy's victims, demoted to the next tier
or dropped from the last), all under the store lock.

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
    TierFullError,
    TierIOError,
    TierUnavailableError,
)
from kvstore.index import NO_PARENT
from kvstore.keys import BlockHash
from kvstore.store._common import (
    _lowest_bit,
    _NsInfo,
)

log = logging.getLogger("kvstore.store")


class Placement:

    def _place_new(
        self,
        bid: int,
        src: memoryview,
        meta: BlockMeta,
        protect: set[int],
        placed: list[tuple[int, int, int]] | None = None,
    ) -> bool | None:
        """Placement: the first tier whose policy admits the block and that can make room.
        None when no policy admits it; False when some did but none could make room."""
        admitted = False
        for k, pol in enumerate(self._policies):
            if pol.admit(bid, meta.size, meta.created):
                admitted = True
                if self._place(bid, k, src, meta, protect, placed=placed):
                    return True
        return False if admitted else None

    def _place(
        self,
        bid: int,
        k: int,
        src: memoryview,
        meta: BlockMeta,
        protect: set[int],
        *,
        durable: bool = False,
        placed: list[tuple[int, int, int]] | None = None,
    ) -> bool:
        """Write ``bid`` into tier ``k`` (making room first); False if no room could be made.
        With ``placed``, a block written to the last tier (where it cannot leave while its
        chain is being put anyway) enters the policy later, from the caller."""
        tier = self.tiers[k]
        key = self.index.hash_of(bid)
        for _ in range(4):
            if not tier.fits(meta.size) and not self._make_room(k, meta.size, protect | {bid}):
                return False
            try:
                tier.write(key, src, meta, durable=durable)
            except TierFullError:
                continue  # a size class ran out; make more room and retry
            except TierUnavailableError as e:
                if durable:
                    raise
                # Unreachable (a remote store is down): like a full tier, the block goes
                # elsewhere or leaves; not a device error.
                log.info("write of %s to tier %s skipped: %s", key.hex(), tier.name, e)
                return False
            except TierIOError as e:
                self.counters.tier_errors += 1
                log.error("write of %s to tier %s failed: %s", key.hex(), tier.name, e)
                raise
            self.events.placed(key, k, int(self.index.tiers[bid]), meta.size, meta.depth)
            self.index.tiers[bid] |= 1 << k
            if placed is None or k != len(self.tiers) - 1:
                self._policies[k].insert(bid, meta.size, meta.created)
            else:
                placed.append((k, bid, meta.size))
            return True
        return False

    # ---- eviction, demotion, expiry -----------------------------------------------------------

    def _make_room(self, k: int, size: int, protect: set[int]) -> bool:
        """Free room in tier ``k`` for ``size`` bytes: expire first, then evict by policy."""
        tier = self.tiers[k]
        self._expire(self._clock(), self.config.expire_work_cap)
        if tier.fits(size):
            return True
        want = tier.size_class(size)
        stuck: set[int] = set()  # victims that could not move down (the tier below failed)
        for same_class in (True, False):
            for _ in range(8):
                victims = self._choose_victims(k, size, want if same_class else None, protect | stuck)
                if not victims:
                    break
                for bid, drop in victims:
                    if drop:
                        self._drop_block(bid)
                        self.counters.evictions += 1
                    elif not self._demote(bid, k, protect):
                        stuck.add(bid)
                if tier.fits(size):
                    return True
        return tier.fits(size)

    def _choose_victims(
        self, k: int, size: int, size_class: int | None, protect: set[int]
    ) -> list[tuple[int, bool]]:
        """Victims in policy order, as (bid, leaves-the-store); at most one round's worth."""
        idx, tier = self.index, self.tiers[k]
        last = k == len(self.tiers) - 1
        others = ((1 << len(self.tiers)) - 1) & ~(1 << k)
        pending: dict[int, int] = {}  # children chosen this round, per parent
        chosen: list[tuple[int, bool]] = []
        freed = 0
        for scanned, bid in enumerate(self._policies[k].candidates()):
            if scanned >= self.config.evict_work_cap:
                break
            if bid in protect or idx.in_use[bid]:
                continue
            bsize = int(idx.size[bid])
            if size_class is not None and tier.size_class(bsize) != size_class:
                continue
            has_copy = bool(int(idx.tiers[bid]) & others)
            if has_copy or not last:
                chosen.append((bid, False))
            else:
                if idx.pins[bid] or idx.children[bid] > pending.get(bid, 0):
                    continue
                chosen.append((bid, True))
                p = int(idx.parent[bid])
                if p != NO_PARENT:
                    pending[p] = pending.get(p, 0) + 1
            freed += bsize
            if freed >= size:
                break
        return chosen

    def _demote(self, bid: int, k: int, protect: set[int]) -> bool:
        """Move ``bid`` out of tier ``k``: write it back to a lower tier unless one holds it.

        If no lower tier can take it, the block leaves the store when it may (an unpinned
        leaf) and otherwise stays where it is (returns False: it is still in tier ``k``).
        """
        idx = self.index
        key = idx.hash_of(bid)
        lower = int(idx.tiers[bid]) >> (k + 1)
        if not lower and k + 1 < len(self.tiers):
            tier = self.tiers[k]
            idx.in_use[bid] += 1  # nothing below may expire or evict it while it moves
            try:
                meta = tier.meta(key) or self._meta_for(bid, key, self._ns_list[int(idx.ns[bid])])
                buf = self._scratch[k].view(meta.size)
                try:
                    tier.read_into(key, buf)
                    placed = self._place(bid, k + 1, buf, meta, protect | {bid})
                except (CorruptBlockError, BlockNotFound, TierIOError) as e:
                    log.warning("demotion of %s from %s failed: %s", key.hex(), tier.name, e)
                    placed = False
                finally:
                    del buf
            finally:
                idx.in_use[bid] -= 1
            if placed:
                self.counters.demotions += 1
            elif idx.evictable_leaf(bid):
                self._drop_block(bid)
                self.counters.evictions += 1
                return True
            else:
                return False
        self._drop_copy(bid, k, key)
        return True

    def _drop_copy(self, bid: int, k: int, key: bytes) -> None:
        """Remove tier ``k``'s copy; a block left with no copy stays in the index only as a
        hollow node (a lookup stops there) until its children are gone."""
        try:
            self.tiers[k].delete(BlockHash(key))
        except TierIOError as e:
            self.counters.tier_errors += 1
            log.error("delete of %s from tier %s failed: %s", key.hex(), self.tiers[k].name, e)
        self.index.tiers[bid] &= ~np.uint8(1 << k)
        self.events.copy_dropped(key, k)
        self._policies[k].remove(bid)
        if not self.index.tiers[bid]:
            self._drop_hollow_leaves([bid])

    def _drop_block(self, bid: int, reason: str = "capacity") -> None:
        """Remove a leaf from every tier and from the index (``reason`` goes to the event log)."""
        idx = self.index
        key = idx.hash_of(bid)
        mask = int(idx.tiers[bid])
        self.events.dropped(key, mask, reason)
        while mask:
            k = _lowest_bit(mask)
            mask &= mask - 1
            try:
                self.tiers[k].delete(key)
            except TierIOError as e:
                self.counters.tier_errors += 1
                log.error("delete of %s from tier %s failed: %s", key.hex(), self.tiers[k].name, e)
            self._policies[k].remove(bid)
        idx.remove(bid)
        self._dirty_expiry.discard(bid)

    def _drop_hollow_leaves(self, bids: Sequence[int]) -> None:
        """Hollow leaves (no copy anywhere, no children, unused) leave the index, upwards."""
        idx = self.index
        for bid in sorted(set(bids), key=lambda b: -int(idx.depth[b])):
            while (
                bid != NO_PARENT
                and idx.hash_of_or_none(bid) is not None
                and not idx.tiers[bid]
                and idx.evictable_leaf(bid)
            ):
                parent = int(idx.parent[bid])
                idx.remove(bid)
                self._dirty_expiry.discard(bid)
                bid = parent

    def _expire(self, now: float, cap: int) -> int:
        for record in self._pins.due(now):  # a guarantee that has run out is released first
            self._release_pin(record)
        removed = 0
        while removed < cap:
            ids = self.index.expired_leaves(now, cap - removed)
            if not ids.size:
                break
            for bid in ids.tolist():
                self._drop_block(bid, "expired")
            removed += int(ids.size)
        self.counters.expirations += removed
        return removed

    def _meta_for(self, bid: int, key: bytes, info: _NsInfo) -> BlockMeta:
        """Metadata of a cached block, from the fastest tier that keeps it, else rebuilt."""
        idx = self.index
        mask = int(idx.tiers[bid])
        while mask:
            k = _lowest_bit(mask)
            mask &= mask - 1
            meta = self.tiers[k].meta(BlockHash(key))
            if meta is not None:
                return meta.with_expiry(float(idx.expiry[bid]))
        raise RuntimeError(f"block {key.hex()} has no tier that keeps its metadata")
