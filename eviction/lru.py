"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

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

    def touch(self, bid: int, now: float) -> None:
        if bid in self._order:
            self._order.move_to_end(bid)

    def remove(self, bid: int) -> None:
        self._order.pop(bid, None)

    def candidates(self) -> Iterator[int]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
