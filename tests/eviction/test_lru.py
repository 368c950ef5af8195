"""LRU scenario tests with exact eviction order (every policy also passes test_conformance.py)."""

from __future__ import annotations

from eviction.lru import LRUPolicy
from kvstore.registry import policy_class


def test_exact_order() -> None:
    p = LRUPolicy()
    for bid in range(5):
        p.insert(bid, 4096, float(bid))
    p.touch(1, 10.0)
    p.touch(3, 11.0)
    p.remove(0)
    p.remove(42)  # unknown: no-op
    assert list(p.candidates()) == [2, 4, 1, 3]
    assert len(p) == 4
    p.touch(99, 12.0)  # unknown: no-op
    assert list(p.candidates()) == [2, 4, 1, 3]
    assert p.admit(7, 1, 0.0)


def test_registry_builds_lru() -> None:
    assert policy_class("lru") is LRUPolicy
