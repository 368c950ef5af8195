"""Promotion on a hit (``Placer.promote``): a hit chain longer than the first tier."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstore.store import KVStore
from tests.kvstore.store.conftest import get, put, where

Make = Callable[..., KVStore]


def test_a_hit_longer_than_the_first_tier_asks_it_for_room_until_it_cannot(null_store: Make) -> None:
    # Every block the first tier holds is the hit chain's own (protected while it loads), so
    # once one promotion finds no room the rest cannot either: the placer stops asking
    # instead of walking the whole tier once per remaining block.
    s = null_store(4, 64, policy="lru")
    names = [f"a{i}" for i in range(40)]
    put(s, names)
    placer: Any = s._placer
    calls: list[int] = []
    make_room = placer.make_room

    def counting(k: int, size: int, protect: set[int]) -> bool:
        calls.append(k)
        return make_room(k, size, protect)

    placer.make_room = counting
    assert get(s, names) == 40
    first = [n for n, tiers in where(s).items() if "t0" in tiers]
    assert len(first) == 4  # the tier is full of the chain's blocks
    assert calls.count(0) <= 2 + len(first)  # not once per block of the chain (36 more)
    assert get(s, names) == 40  # every block still served
