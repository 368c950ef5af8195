"""KVStore.acquire / release: blocks held in the shared-memory arena for a same-node reader."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvstore.errors import UsageError
from kvstore.shm import attach_arena
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload, small_tiers


def _put(store: KVStore, chain: list[bytes]) -> None:
    store.put(SMALL_NS, chain, [payload(h) for h in chain])


def _arena_bytes(store: KVStore, lease_locs: tuple[tuple[int, int], ...]) -> list[bytes]:
    shm = attach_arena(store.tiers[0].shm_name)
    try:
        return [bytes(shm.buf[off : off + size]) for off, size in lease_locs]
    finally:
        shm.close()


def test_acquire_returns_arena_locations_of_the_cached_prefix(make_store: Callable[..., KVStore]) -> None:
    store = make_store()
    chain = chain_for(1, 6)
    _put(store, chain[:4])
    lease = store.acquire(SMALL_NS, chain)
    assert lease.num_blocks == 4
    assert lease.arena == store.tiers[0].shm_name
    assert _arena_bytes(store, lease.locations) == [payload(h) for h in chain[:4]]
    store.release(lease)
    assert store.stats()["hit_blocks"] == 4


def test_leased_blocks_neither_leave_nor_move_until_released(make_store: Callable[..., KVStore]) -> None:
    store = make_store()
    chain = chain_for(2, 3)
    _put(store, chain)
    lease = store.acquire(SMALL_NS, chain)
    assert store.delete(SMALL_NS, chain[:1]) == 0  # in use: kept
    # Fill DRAM far past its 16 blocks: the leased blocks must stay in the arena, in place.
    for seed in range(10, 16):
        _put(store, chain_for(seed, 8))
    assert _arena_bytes(store, lease.locations) == [payload(h) for h in chain]
    store.release(lease)
    store.release(lease)  # a second release changes nothing
    assert store.delete(SMALL_NS, chain[:1]) == 3


def test_acquire_promotes_blocks_from_slower_tiers(make_store: Callable[..., KVStore]) -> None:
    store = make_store(promote_on_hit=False)
    chain = chain_for(3, 4)
    _put(store, chain)
    for seed in range(20, 24):  # push the chain out of DRAM
        _put(store, chain_for(seed, 8))
    assert store.lookup(SMALL_NS, chain).tiers[0] != "dram"
    lease = store.acquire(SMALL_NS, chain)
    assert lease.num_blocks == 4
    assert _arena_bytes(store, lease.locations) == [payload(h) for h in chain]
    assert store.lookup(SMALL_NS, chain).tiers == ("dram",) * 4
    store.release(lease)


def test_acquire_of_a_miss_is_an_empty_lease(make_store: Callable[..., KVStore]) -> None:
    store = make_store()
    lease = store.acquire(SMALL_NS, chain_for(4, 2))
    assert lease.num_blocks == 0
    store.release(lease)


def test_acquire_needs_a_shared_memory_first_tier(make_store: Callable[..., KVStore]) -> None:
    store = make_store(tiers=small_tiers()[1:])
    with pytest.raises(UsageError, match="kind = 'dram' tier first"):
        store.acquire(SMALL_NS, chain_for(5, 1))


def test_namespace_usage_counts_blocks_and_bytes(make_store: Callable[..., KVStore]) -> None:
    store = make_store()
    _put(store, chain_for(6, 5))
    assert store.namespace_usage() == {bytes(SMALL_NS.root): (5, 5 * BB)}
