"""A fake index view for policy tests: the columns a policy reads, and chains to fill them."""

from __future__ import annotations

import numpy as np
import pytest

from eviction.base import EvictionPolicy, TierContext


class FakeView:
    """What a policy may read of the radix index (eviction.base.BlockView), kept by hand."""

    def __init__(self, n: int = 4096) -> None:
        self.parent = np.full(n, -1, np.int32)
        self.depth = np.zeros(n, np.int32)
        self.children = np.zeros(n, np.int32)
        self.size = np.full(n, 4096, np.uint32)
        self.hits = np.zeros(n, np.uint32)
        self._hash: dict[int, bytes] = {}

    def hash_of(self, bid: int) -> bytes:
        return self._hash[bid]

    def add(self, bid: int, parent: int = -1, key: bytes | None = None) -> int:
        """A block ``bid`` under ``parent``; its hash is ``key`` (default: derived from bid)."""
        self.parent[bid] = parent
        self.depth[bid] = 0 if parent < 0 else self.depth[parent] + 1
        self.children[bid] = 0
        if parent >= 0:
            self.children[parent] += 1
        self._hash[bid] = key if key is not None else bid.to_bytes(16, "little")
        return bid

    def drop(self, bid: int) -> None:
        """The index forgets ``bid`` (after the policy's remove), freeing the id for reuse."""
        p = int(self.parent[bid])
        if p >= 0:
            self.children[p] -= 1
        del self._hash[bid]


def evict_leaf(pol: EvictionPolicy, view: FakeView, bid: int) -> None:
    """What the store does with a last-tier victim: the policy forgets it, its parent is offered."""
    parent = int(view.parent[bid])
    pol.remove(bid)
    view.drop(bid)
    if parent >= 0 and not view.children[parent]:
        pol.offer(parent)


def evict_first(pol: EvictionPolicy, view: FakeView, n: int) -> list[int]:
    """The policy's first victim ``n`` times, each evicted as the store would: the ids taken."""
    taken = []
    for _ in range(n):
        bid = pol.first()
        assert bid is not None
        taken.append(bid)
        evict_leaf(pol, view, bid)
    return taken


LAST = TierContext("t0", "dram", 0, "")
UPPER = TierContext("t0", "dram", 0, "nvme")


@pytest.fixture
def view() -> FakeView:
    return FakeView()
