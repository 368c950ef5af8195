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
    store = make_store()
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
    assert store.stats()["promotions"] == 4


def test_acquire_honours_promote_on_hit_false(make_store: Callable[..., KVStore]) -> None:
    """Without promotion a lease holds only the leading blocks the arena already has."""
    store = make_store(promote_on_hit=False)
    chain = chain_for(3, 4)
    _put(store, chain)
    for seed in range(20, 24):  # push the chain out of DRAM
        _put(store, chain_for(seed, 8))
    before = store.lookup(SMALL_NS, chain).tiers
    assert before[0] != "dram"
    lease = store.acquire(SMALL_NS, chain)
    assert lease.num_blocks == 0
    assert store.lookup(SMALL_NS, chain).tiers == before  # nothing moved into the arena
    assert store.stats()["promotions"] == 0
    store.release(lease)
    head = chain_for(30, 3)
    _put(store, head)  # in DRAM: leased in place
    lease = store.acquire(SMALL_NS, head)
    assert lease.num_blocks == 3
    assert _arena_bytes(store, lease.locations) == [payload(h) for h in head]
    store.release(lease)


def test_leases_use_the_shared_memory_tier_wherever_it_is(tmp_path, clock) -> None:
    """The arena need not be tier 0: a null tier first, then DRAM."""
    from kvstore.config import StoreConfig, TierSpec
    tiers = (TierSpec("fast", "null", {"capacity_blocks": 2}),) + small_tiers()[:2]
    with KVStore(StoreConfig(root=tmp_path / "s", tiers=tiers, promote_on_hit=False), clock=clock) as store:
        store.register_namespace(SMALL_NS)
        chain = chain_for(40, 6)
        _put(store, chain)  # the last two stay in the null tier, the first four went down to DRAM
        assert store.lookup(SMALL_NS, chain).tiers == ("dram",) * 4 + ("fast",) * 2
        assert store.arena == store.tiers[1].shm_name
        lease = store.acquire(SMALL_NS, chain)
        assert lease.arena == store.tiers[1].shm_name
        assert lease.num_blocks == 4  # the lease ends where the arena does
        # (no payload check: the null tier keeps no bytes, so what it demoted is zeros)
        assert [off for off, _ in lease.locations] == [store.tiers[1].location(h)[0] for h in chain[:4]]
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


def _in_use(store: KVStore, chain: list[bytes]) -> list[int]:
    return [row["in_use"] for row in store.iter_blocks(chain)]


@pytest.mark.parametrize("promote", [True, False])
def test_a_lease_holds_exactly_its_blocks_until_released(make_store: Callable[..., KVStore], promote: bool) -> None:
    """The lease's blocks are in use once each, no other block is, and none after the release:
    both when every block is in the arena (served in place, no read) and when the tail comes
    from a slower tier (promoted, or left out without ``promote_on_hit``)."""
    store = make_store(promote_on_hit=promote)
    cold = chain_for(50, 3)
    _put(store, cold)
    for seed in range(51, 55):  # push the cold chain out of DRAM
        _put(store, chain_for(seed, 4))
    assert store.lookup(SMALL_NS, cold).tiers[0] != "dram"
    hot = chain_for(60, 5)
    _put(store, hot)
    other = chain_for(61, 2)
    _put(store, other)
    assert store.lookup(SMALL_NS, hot).tiers == ("dram",) * 5
    lease = store.acquire(SMALL_NS, hot + chain_for(62, 2))  # two uncached blocks past the prefix
    assert lease.num_blocks == 5
    assert [off for off, _ in lease.locations] == [store.tiers[0].location(h)[0] for h in hot]
    assert _in_use(store, hot) == [1] * 5 and _in_use(store, other) == [0, 0] and _in_use(store, cold) == [0] * 3
    store.release(lease)
    assert _in_use(store, hot) == [0] * 5
    lease = store.acquire(SMALL_NS, cold)
    held = 3 if promote else 0
    assert lease.num_blocks == held
    assert _in_use(store, cold) == [1] * held + [0] * (3 - held)
    if held:
        assert _arena_bytes(store, lease.locations) == [payload(h) for h in cold]
    store.release(lease)
    assert _in_use(store, cold) == [0] * 3 and _in_use(store, hot) == [0] * 5


def test_dram_locations_answer_every_key_at_once(make_store: Callable[..., KVStore]) -> None:
    store = make_store()
    chain = chain_for(70, 3)
    _put(store, chain)
    dram = store.tiers[0]
    missing = chain_for(71, 1)[0]
    assert dram.locations([*chain, missing]) == [dram.location(h) for h in chain] + [None]
