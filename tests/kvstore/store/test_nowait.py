"""KVStore.acquire_nowait / release_nowait: what the daemon's event loop serves itself (a lease
the arena holds whole, with the store not busy) and what it hands to its pool."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvstore.store import KVStore
from tests.conftest import SMALL_NS, chain_for, payload, small_tiers

Make = Callable[..., KVStore]


@contextmanager
def lock_held_elsewhere(store: KVStore) -> Iterator[None]:
    """The store's lock held by another thread (a put or a move) for the duration."""
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with store._lock:  # noqa: SLF001 - what a put on another thread holds
            held.set()
            done.wait()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    try:
        yield
    finally:
        done.set()
        t.join()


def leased(store: KVStore) -> int:
    """Blocks held under leases (the ledger's count: what keeps them from moving)."""
    return sum(store._ledger.leased.values())  # noqa: SLF001


def test_a_lease_the_arena_holds_is_served_at_once_and_is_the_same_lease(make_store: Make) -> None:
    store = make_store()
    chain = chain_for(1, 4)
    store.put(SMALL_NS, chain, [payload(h) for h in chain])
    now = store.acquire_nowait(SMALL_NS, chain)
    assert now is not None
    later = store.acquire(SMALL_NS, chain)
    assert now.locations == later.locations and now.num_blocks == 4
    buf = store.tiers[0]._buf  # noqa: SLF001 - the bytes a reader of the arena would copy
    assert [bytes(buf[o : o + n]) for o, n in now.locations] == [payload(h) for h in chain]
    assert store.release_nowait(now)
    store.release(later)
    assert leased(store) == 0


def test_a_busy_store_hands_the_lease_and_its_release_to_the_pool(make_store: Make) -> None:
    store = make_store()
    chain = chain_for(2, 3)
    store.put(SMALL_NS, chain, [payload(h) for h in chain])
    lease = store.acquire(SMALL_NS, chain)
    with lock_held_elsewhere(store):
        assert store.acquire_nowait(SMALL_NS, chain) is None
        assert not store.release_nowait(lease)
    assert leased(store) == 3  # the refused release changed nothing
    assert store.release_nowait(lease)
    assert leased(store) == 0
    assert store.release_nowait(lease)  # idempotent, as release


def test_a_lease_that_must_read_a_slower_tier_goes_to_the_pool(make_store: Make) -> None:
    store = make_store(tiers=small_tiers(dram_blocks=4))
    old, new = chain_for(3, 4), chain_for(4, 4)
    store.put(SMALL_NS, old, [payload(h) for h in old])
    store.put(SMALL_NS, new, [payload(h) for h in new])  # the arena's room: `old` goes down
    assert "dram" not in store.lookup(SMALL_NS, old).tiers[:1]
    assert store.acquire_nowait(SMALL_NS, old) is None
    lease = store.acquire(SMALL_NS, old)  # the pool's call reads and promotes it
    assert lease.num_blocks == 4
    store.release(lease)


def test_nothing_cached_is_an_empty_lease_at_once(make_store: Make) -> None:
    store = make_store()
    lease = store.acquire_nowait(SMALL_NS, chain_for(5, 2))
    assert lease is not None and lease.num_blocks == 0
    assert store.release_nowait(lease)
