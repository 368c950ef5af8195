"""A put moves its bytes outside the store lock: room is made under the lock, the payloads are
copied into the first tier without it, and the copies are published under it again."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.block import BlockMeta
from kvstore.keys import BlockHash
from kvstore.registry import make_tier
from kvstore.store import KVStore
from tests.kvstore.store.conftest import BLOCK, NS, chain, get, put, resident, where
from tiers.faulty import FaultyTier

Make = Callable[..., KVStore]
WAIT_S = 120.0
"""Generous: only a deadlock would reach it (no figure depends on it)."""


class Recording(FaultyTier):
    """Records whether the store's lock was held by the writing thread at each write."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.store: KVStore | None = None
        self.locked: list[bool] = []
        self.hook: Callable[[], None] | None = None

    def _note(self, n: int) -> None:
        assert self.store is not None
        self.locked += [self.store._lock._is_owned()] * n  # type: ignore[attr-defined]  # noqa: SLF001
        if self.hook is not None:
            self.hook()

    def write(self, key: BlockHash, src: Any, meta: BlockMeta, *, durable: bool = False) -> None:
        self._note(1)
        super().write(key, src, meta, durable=durable)

    def write_many(self, items: Sequence[tuple[BlockHash, Any, BlockMeta]], *, durable: bool = False) -> list[Any]:
        self._note(len(items))
        return [self._one(key, src, meta, durable) for key, src, meta in items]

    def _one(self, key: BlockHash, src: Any, meta: BlockMeta, durable: bool) -> Any:
        try:
            self.inner.write(key, src, meta, durable=durable)
        except Exception as e:  # the error of that block, as Tier.write_many reports it
            return e
        return None


def _store(null_store: Make, tmp_path: Any, blocks: int) -> tuple[KVStore, Recording]:
    tier = Recording(make_tier("null", "t0", {"capacity_blocks": blocks}, tmp_path))
    s = null_store(tiers=[tier])
    tier.store = s
    return s, tier


def test_payloads_are_written_without_the_lock_and_published_under_it(null_store: Make, tmp_path: Any) -> None:
    s, tier = _store(null_store, tmp_path, 4)
    assert put(s, ["a0", "a1", "a2"]) == 3
    assert tier.locked == [False, False, False]
    assert put(s, ["b0", "b1"]) == 2  # room made under the lock first: a2, a1 leave
    assert tier.locked[3:] == [False, False]
    assert resident(s) == {"a0", "a1", "b0", "b1"}
    assert get(s, ["b0", "b1"]) == 2
    assert s.stats()["evictions"] == 1 and tier.inner.usage().blocks == 4


def test_a_lookup_runs_while_a_put_copies_its_payloads(null_store: Make, tmp_path: Any) -> None:
    s, tier = _store(null_store, tmp_path, 8)
    put(s, ["a0", "a1"])
    writing, go = threading.Event(), threading.Event()
    seen: list[Any] = []

    def hold() -> None:
        writing.set()
        assert go.wait(WAIT_S)

    tier.hook = hold
    t = threading.Thread(target=lambda: seen.append(put(s, ["a0", "a1", "a2", "a3"], start=2)))
    t.start()
    try:
        assert writing.wait(WAIT_S)
        during = s.lookup_nowait(NS, chain("a0", "a1", "a2", "a3"))  # None if the lock were held
        assert during is not None and during.num_blocks == 2  # the new blocks are not published yet
    finally:
        go.set()
        t.join(WAIT_S)
    assert seen == [2]
    assert s.lookup(NS, chain("a0", "a1", "a2", "a3")).num_blocks == 4


def test_a_second_put_of_a_chain_in_flight_stops_where_the_first_is_writing(null_store: Make, tmp_path: Any) -> None:
    s, tier = _store(null_store, tmp_path, 8)
    writing, go = threading.Event(), threading.Event()
    answers: list[int] = []

    def hold_once() -> None:
        tier.hook = None
        writing.set()
        assert go.wait(WAIT_S)

    tier.hook = hold_once
    t = threading.Thread(target=lambda: answers.append(put(s, ["a0", "a1", "a2"])))
    t.start()
    try:
        assert writing.wait(WAIT_S)
        assert put(s, ["a0", "a1", "a2", "a3"]) == 0  # a0.. are being written by the first put
    finally:
        go.set()
        t.join(WAIT_S)
    assert answers == [3]
    assert where(s) == {"a0": ["t0"], "a1": ["t0"], "a2": ["t0"]}
    assert put(s, ["a0", "a1", "a2", "a3"], start=3) == 1


def test_copies_that_landed_past_the_end_of_a_short_chain_are_deleted(null_store: Make, tmp_path: Any) -> None:
    s, tier = _store(null_store, tmp_path, 3)
    taken = threading.Event()

    def squeeze() -> None:
        # While the put copies its payloads, another writer takes a slot it had made room for.
        if not taken.is_set():
            taken.set()
            tier.inner.write(BlockHash(b"x" * 16), BLOCK, BlockMeta(NS.root, NS.root, 0, len(BLOCK), 1e12, 0, 0.0))

    tier.hook = squeeze
    assert put(s, ["a0", "a1", "a2"]) == 2  # a2's copy found no room; nothing else may leave
    assert resident(s) == {"a0", "a1"}
    assert tier.inner.usage().blocks == 3  # a0, a1 and the other writer's block: no stray copy
    assert s.stats()["truncated_puts"] == 1
