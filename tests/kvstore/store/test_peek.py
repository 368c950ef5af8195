"""KVStore.peek_arena / confirm_peek: an optimistic read of the arena (the GPU restore queues its
head's copy before it holds a lease, and keeps it only where the lease confirms it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from kvstore.api import ArenaPeek
from kvstore.config import TierSpec
from kvstore.errors import UsageError
from kvstore.keys import KVLayout, LayerGroup, Namespace
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload, small_tiers
from tiers._slab import SlabAllocator

Make = Callable[..., KVStore]


def dram_only(blocks: int = 8) -> tuple[TierSpec, ...]:
    return small_tiers(dram_blocks=blocks)[:1]


def put(store: KVStore, chain: list[bytes]) -> None:
    assert store.put(SMALL_NS, chain, [payload(h) for h in chain]) == len(chain)


@contextlib.contextmanager
def leased(store: KVStore, chain: list[bytes]) -> Iterator[object]:
    lease = store.acquire(SMALL_NS, chain)
    try:
        yield lease
    finally:
        store.release(lease)


def peeked(make_store: Make, seed: int, n: int) -> tuple[KVStore, list[bytes], ArenaPeek]:
    """A DRAM-only store of 8 blocks holding a chain of ``n``, and a peek at the whole chain."""
    store = make_store(tiers=dram_only())
    chain = chain_for(seed, n)
    put(store, chain)
    return store, chain, store.peek_arena(SMALL_NS, chain)


def arena_bytes(store: KVStore, locations: tuple[tuple[int, int], ...]) -> list[bytes]:
    buf = store.tiers[0]._buf  # noqa: SLF001 - the bytes a reader of the arena would copy
    return [bytes(buf[off : off + size]) for off, size in locations]


def test_a_peek_confirmed_by_the_lease_read_the_right_bytes(make_store: Make) -> None:
    store = make_store(tiers=dram_only())
    chain = chain_for(1, 5)
    put(store, chain)
    before = store.stats()
    peek = store.peek_arena(SMALL_NS, chain[:3])
    assert (peek.arena, peek.num_blocks) == (store.tiers[0].shm_name, 3)
    assert arena_bytes(store, peek.locations) == [payload(h) for h in chain[:3]]
    assert store.stats() == before  # nothing counted, touched or held
    with leased(store, chain) as lease:
        assert lease.locations[:3] == peek.locations  # type: ignore[attr-defined]
        assert store.confirm_peek(peek, lease) == 3  # type: ignore[arg-type]


def test_a_peek_stops_at_the_first_block_the_arena_lacks(make_store: Make) -> None:
    store = make_store(tiers=dram_only())
    chain = chain_for(2, 4)
    put(store, chain[:2])
    assert store.peek_arena(SMALL_NS, chain).num_blocks == 2
    assert store.peek_arena(SMALL_NS, chain_for(3, 2)).num_blocks == 0


def test_a_block_that_left_and_came_back_after_the_peek_is_not_confirmed(make_store: Make) -> None:
    store, chain, peek = peeked(make_store, 4, 4)
    assert peek.num_blocks == 4
    for seed in (10, 11, 12):  # 12 other blocks: the arena of 8 evicts the whole chain
        put(store, chain_for(seed, 4))
    assert store.peek_arena(SMALL_NS, chain).num_blocks == 0
    put(store, chain)  # back, in slots that were freed (maybe the same ones) since the peek
    with leased(store, chain) as lease:
        assert lease.num_blocks == 4  # type: ignore[attr-defined]
        assert store.confirm_peek(peek, lease) == 0  # type: ignore[arg-type]


def test_only_the_leading_blocks_at_the_same_place_are_confirmed(make_store: Make) -> None:
    store, chain, peek = peeked(make_store, 5, 3)
    with leased(store, chain[:2]) as lease:  # a shorter lease (the prompt's prefix)
        assert store.confirm_peek(peek, lease) == 2  # type: ignore[arg-type]
        moved = type(peek)(peek.arena, ((peek.locations[0][0] + BB, BB), *peek.locations[1:]), peek.stamp)
        assert store.confirm_peek(moved, lease) == 0  # type: ignore[arg-type]  # the first differs: nothing kept
        other = type(peek)("another-arena", peek.locations, peek.stamp)
        assert store.confirm_peek(other, lease) == 0  # type: ignore[arg-type]


def test_a_slot_freed_for_another_block_is_caught_even_at_the_same_place(make_store: Make) -> None:
    store, _, peek = peeked(make_store, 6, 2)
    tier = store.tiers[0]
    offsets = [off for off, _ in peek.locations]
    assert not tier.freed_since(offsets, peek.stamp)
    tier._alloc.free(offsets[1])  # noqa: SLF001 - a free of that slot, whatever comes after
    tier._alloc.claim(offsets[1], BB)  # noqa: SLF001 - ...and the same slot taken again
    assert tier.freed_since(offsets, peek.stamp)
    assert not tier.freed_since(offsets[:1], peek.stamp)


def test_peek_needs_an_arena_and_a_registered_namespace(make_store: Make) -> None:
    store = make_store(tiers=small_tiers()[1:])  # nvme and object: no shared-memory tier
    with pytest.raises(UsageError, match="shared-memory tier"):
        store.peek_arena(SMALL_NS, chain_for(7, 1))
    other = Namespace("test/other", KVLayout("bfloat16", 16, (LayerGroup("full", 1, 1, 64),)))
    arena = make_store(tiers=dram_only())
    with pytest.raises(UsageError):
        arena.peek_arena(other, chain_for(7, 1))


def test_the_allocator_stamps_each_free() -> None:
    a = SlabAllocator(4 * 4096, 4096)
    x, y = a.alloc(4096), a.alloc(4096)
    assert x is not None and y is not None
    stamp = a.frees
    assert not a.freed_since([x, y], stamp)
    a.free(x)
    assert a.frees == stamp + 1
    assert a.freed_since([x, y], stamp) and not a.freed_since([y], stamp)
    assert not a.freed_since([x, y], a.frees)


def test_a_slab_that_changed_class_since_the_stamp_counts_as_freed() -> None:
    a = SlabAllocator(2 * 8192, 8192)
    x = a.alloc(4096)  # slab 0 takes the 4 KiB class
    y = a.alloc(8192)  # slab 1 the 8 KiB one
    assert x == 0 and y == 8192
    stamp = a.frees
    a.free(x)  # slab 0 empties...
    z = a.alloc(8192)  # ...and is taken for the 8 KiB class: offset 0 is another slot now
    assert z == 0
    assert a.freed_since([0], stamp) and not a.freed_since([y], stamp)
    # the slab's new class starts with no per-slot stamps: the slab's own stamp answers
    assert a.freed_since([0], stamp) and not a.freed_since([0], a.frees)
