"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from eviction.base import EvictionPolicy


@dataclass(frozen=True, slots=True)
class LRUConfig:
    pass


class LRUPolicy(EvictionPolicy):
    """Evicts the block whose last access is oldest.

    The store touches a matched prefix from its deepest block back to the root, so a parent is
    always more recent than its children and leaves come out first, as prefix-closure wants.
    """

    name = "lru"
    Config = LRUConfig

    def __init__(self, config: LRUConfig | None = None) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, bid: int, size: int, now: float) -> None:
        self._order[bid] = None
        self._order.move_to_end(bid)

    def insert_many(self, ids: np.ndarray, sizes: np.ndarray, now: np.ndarray | float) -> None:
        # Each insert moves its id to the end: the ids end in the order of their last occurrence.
        last = list(dict.fromkeys(reversed(np.asarray(ids).tolist())))
        order = self._order
        if order:
            for bid in order.keys() & last:
                del order[bid]
        order.update(dict.fromkeys(reversed(last)))

    def touch(self, bid: int, now: float) -> None:
        if bid in self._order:
            self._order.move_to_end(bid)

    def remove(self, bid: int) -> None:
        self._order.pop(bid, None)

    def candidates(self) -> Iterator[int]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
