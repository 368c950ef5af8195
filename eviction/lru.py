"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from eviction.base import BlockView, EvictionPolicy, TierContext

_COMPACT_SLACK = 1024
"""Stale heap entries tolerated beyond the live ones before the leaf heap is rebuilt."""


@dataclass(frozen=True, slots=True)
class LRUConfig:
    pass


class LRUPolicy(EvictionPolicy):
    """Evicts the block whose last access is oldest.

    The store touches a matched prefix from its deepest block back to the root, so a parent is
    always more recent than its children. On an upper tier every block may move: one ordered
    dict, O(1) per event. On the last tier only leaves may leave: every resident block keeps a
    recency stamp, and the leaves that are offered sit in a heap keyed by it (lazy deletion), so
    a parent whose last child left competes at its own last access, as a prefix-closed LRU
    wants, and the victim is found in O(log n) whatever the shape of the chains.
    """

    name = "lru"
    Config: type[Any] = LRUConfig  # a subclass brings its own (ChainPolicy)

    def __init__(self, config: LRUConfig | None = None) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()
        self._view: BlockView | None = None
        self._leaf_mode = False
        self._stamp: dict[int, int] = {}  # last tier: every resident block's recency
        self._held: set[int] = set()  # last tier: resident blocks with cached children
        self._heap: list[tuple[int, int]] = []  # last tier: (stamp, bid) of offered leaves, lazily
        self._seq = 0

    def bind(self, view: BlockView, tier: TierContext) -> None:
        self._view = view
        self._leaf_mode = tier.last

    # ---- upper tiers: one ordered dict ----------------------------------------------------------

    def insert(self, bid: int, size: int, now: float) -> None:
        if not self._leaf_mode:
            self._order[bid] = None
            self._order.move_to_end(bid)
            return
        self._seq += 1
        self._stamp[bid] = self._seq
        if self._view is not None and self._view.children[bid]:
            self._held.add(bid)
        else:
            self._held.discard(bid)
            heapq.heappush(self._heap, (self._seq, bid))

    def insert_many(self, ids: np.ndarray, sizes: np.ndarray, now: np.ndarray | float) -> None:
        if self._leaf_mode:
            # A big batch (a warm restart learns every block at once) is heapified once; a
            # small one (a put's new chain) is pushed.
            order = np.asarray(ids).tolist()
            held = self._view.children[np.asarray(ids, np.int64)].tolist() if self._view is not None else [0] * len(order)
            heap, stamp, held_set = self._heap, self._stamp, self._held
            bulk = 8 * len(order) > len(heap)
            add = heap.append if bulk else lambda e: heapq.heappush(heap, e)
            seq = self._seq
            for bid, kids in zip(order, held, strict=True):
                seq += 1
                stamp[bid] = seq
                if kids:
                    held_set.add(bid)
                else:
                    held_set.discard(bid)
                    add((seq, bid))
            self._seq = seq
            if bulk:
                heapq.heapify(heap)
            return
        # Each insert moves its id to the end: the ids end in the order of their last occurrence.
        last = list(dict.fromkeys(reversed(np.asarray(ids).tolist())))
        order = self._order
        if order:
            for bid in order.keys() & last:
                del order[bid]
        order.update(dict.fromkeys(reversed(last)))

    def touch(self, bid: int, now: float) -> None:
        if not self._leaf_mode:
            if bid in self._order:
                self._order.move_to_end(bid)
            return
        if bid in self._stamp:
            self._seq += 1
            self._stamp[bid] = self._seq
            if bid not in self._held:
                heapq.heappush(self._heap, (self._seq, bid))
                self._compact()

    def touch_many(self, bids: list[int], now: float) -> None:
        if not self._leaf_mode:
            order = self._order
            move = order.move_to_end
            for bid in bids:
                if bid in order:
                    move(bid)
            return
        self._restamp([bid for bid in bids if bid in self._stamp])

    def _restamp(self, live: list[int]) -> None:
        """The last tier's touch of resident ``live``, in order: new stamps, and the offered
        ones back in the heap (a hit prefix's inner blocks are held: few pushes)."""
        seq = self._seq
        stamps = range(seq + 1, seq + 1 + len(live))
        self._stamp.update(zip(live, stamps, strict=True))
        self._seq = seq + len(live)
        held, heap = self._held, self._heap
        for bid, s in zip(live, stamps, strict=True):
            if bid not in held:
                heapq.heappush(heap, (s, bid))
        self._compact()

    def remove(self, bid: int) -> None:
        if not self._leaf_mode:
            self._order.pop(bid, None)
            return
        if self._stamp.pop(bid, None) is not None:
            self._held.discard(bid)
            if len(self._heap) > 2 * len(self._stamp) + _COMPACT_SLACK:
                self._compact()

    # ---- the last tier: leaves only ---------------------------------------------------------------

    def hold(self, bid: int) -> None:
        if self._leaf_mode and bid in self._stamp:
            self._held.add(bid)

    def offer(self, bid: int) -> None:
        if self._leaf_mode and bid in self._held:
            self._held.discard(bid)
            heapq.heappush(self._heap, (self._stamp[bid], bid))

    def _valid(self, entry: tuple[int, int]) -> bool:
        stamp, bid = entry
        return self._stamp.get(bid) == stamp and bid not in self._held

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._stamp) + _COMPACT_SLACK:
            self._heap = [e for e in self._heap if self._valid(e)]
            heapq.heapify(self._heap)

    def first(self) -> int | None:
        if not self._leaf_mode:
            return next(iter(self._order), None)
        heap, stamp, held = self._heap, self._stamp, self._held
        while heap:
            seq, bid = heap[0]
            if stamp.get(bid) == seq and bid not in held:
                return bid
            heapq.heappop(heap)  # stale
        return None

    def candidates(self) -> Iterator[int]:
        if not self._leaf_mode:
            return iter(self._order)
        return self._leaves()

    def _leaves(self) -> Iterator[int]:
        heap = self._heap
        while heap and not self._valid(heap[0]):
            heapq.heappop(heap)  # stale: a reorganisation inside our own iterator
        if not heap:
            return
        yield heap[0][1]  # the usual case: the store takes the first victim offered
        # The rest of the heap in order without popping it: a frontier of heap positions.
        frontier = [(heap[c], c) for c in (1, 2) if c < len(heap)]
        heapq.heapify(frontier)
        seen = {heap[0][1]}
        while frontier:
            entry, i = heapq.heappop(frontier)
            for c in (2 * i + 1, 2 * i + 2):
                if c < len(heap):
                    heapq.heappush(frontier, (heap[c], c))
            if self._valid(entry) and entry[1] not in seen:
                seen.add(entry[1])
                yield entry[1]

    def __len__(self) -> int:
        return len(self._stamp) if self._leaf_mode else len(self._order)
