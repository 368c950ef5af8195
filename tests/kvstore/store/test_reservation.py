"""KVStore.reserve / Reservation.commit: a put whose caller writes the payloads into arena slots
itself (the GPU save's device-to-host copy lands where the store keeps the block)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from kvstore.config import TierSpec
from kvstore.errors import MissingPrefixError, TierIOError, UsageError
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload, small_tiers

Make = Callable[..., KVStore]
WAIT_S = 120.0
"""Generous: only a deadlock would reach it (no figure depends on it)."""


def dram_only(blocks: int = 16) -> tuple[TierSpec, ...]:
    return small_tiers(dram_blocks=blocks)[:1]


def write(res: object, chain: list[bytes], count: int | None = None) -> None:
    """The payloads of the reserved blocks into their slots (the leading ``count``)."""
    views = res.views()  # type: ignore[attr-defined]
    for i, v in enumerate(views[:count]):
        v[:] = payload(chain[res.first + i])  # type: ignore[attr-defined]
    del views


def served(store: KVStore, chain: list[bytes]) -> int:
    """Leading blocks a load serves, each checked against its payload."""
    bufs = [bytearray(BB) for _ in chain]
    n = store.get_into(SMALL_NS, chain, bufs)
    assert [bytes(b) for b in bufs[:n]] == [payload(h) for h in chain[:n]]
    return n


def used(store: KVStore) -> int:
    return store.tiers[0].usage().used_bytes


def test_commit_serves_exactly_the_written_blocks(make_store: Make) -> None:
    store = make_store()
    chain = chain_for(1, 5)
    res = store.reserve(SMALL_NS, chain)
    assert (res.first, res.num_blocks, res.arena) == (0, 5, store.tiers[0].shm_name)
    write(res, chain)
    assert res.commit() == 5
    assert store.lookup(SMALL_NS, chain).num_blocks == 5
    assert served(store, chain) == 5
    assert store.stats()["put_blocks"] == 5
    assert store.put(SMALL_NS, chain, [payload(h) for h in chain]) == 0  # deduplicated


def test_nothing_is_seen_before_the_commit(make_store: Make) -> None:
    store = make_store()
    chain = chain_for(2, 4)
    res = store.reserve(SMALL_NS, chain)
    write(res, chain)
    assert store.lookup(SMALL_NS, chain).num_blocks == 0
    assert served(store, chain) == 0
    assert store.acquire(SMALL_NS, chain).num_blocks == 0
    # Another put of the chain stops at the reserved blocks (as at blocks another put writes).
    assert store.put(SMALL_NS, chain, [b"\0" * BB] * 4) == 0
    assert res.commit() == 4
    assert served(store, chain) == 4  # the reservation's bytes, not the other put's


def test_a_concurrent_lookup_sees_none_or_all(make_store: Make) -> None:
    store = make_store()
    chain = chain_for(3, 8)
    res = store.reserve(SMALL_NS, chain)
    seen: list[int] = []

    def look() -> None:  # loads until the commit shows
        while not seen or seen[-1] != 8:
            seen.append(served(store, chain))

    t = threading.Thread(target=look)
    t.start()
    write(res, chain)
    res.commit()
    t.join(WAIT_S)
    assert not t.is_alive()
    assert set(seen) <= {0, 8}


def test_abort_leaves_nothing(make_store: Make) -> None:
    store = make_store()
    before = used(store)
    chain = chain_for(4, 6)
    with store.reserve(SMALL_NS, chain) as res:
        write(res, chain)  # written but never committed
    assert res.done
    assert store.lookup(SMALL_NS, chain).num_blocks == 0
    assert list(store.iter_blocks()) == []
    assert used(store) == before
    assert store.put(SMALL_NS, chain, [payload(h) for h in chain]) == 6  # the chain is free again
    assert served(store, chain) == 6


def test_commit_of_fewer_blocks_than_reserved(make_store: Make) -> None:
    store = make_store()
    chain = chain_for(5, 6)
    res = store.reserve(SMALL_NS, chain)
    write(res, chain, 2)
    assert res.commit(2) == 2
    assert served(store, chain) == 2
    assert len(list(store.iter_blocks())) == 2  # the hollow rest is gone
    assert used(store) == 2 * store.tiers[0].size_class(BB)
    with pytest.raises(UsageError):
        res.commit()  # once
    res.abort()  # a no-op after the commit
    assert served(store, chain) == 2


@pytest.mark.parametrize(("start", "count"), [(0, None), (0, 3), (2, None)])
def test_prepare_before_the_commit_publishes_the_same_records(make_store: Make, start: int, count: int | None) -> None:
    """``prepare`` (the records built while the copies are in flight) changes nothing that the
    commit publishes: the same metadata as a commit without it, for all or the leading slots,
    from the chain's start or after a cached prefix."""
    store = make_store()
    records = []
    for ahead, chain in ((False, chain_for(16, 6)), (True, chain_for(17, 6))):
        if start:
            store.put(SMALL_NS, chain[:start], [payload(h) for h in chain[:start]])
        res = store.reserve(SMALL_NS, chain)
        write(res, chain)
        if ahead:
            res.prepare()
            res.prepare()  # idempotent
        n = res.commit(count)
        assert n == (count if count is not None else 6 - start)
        assert served(store, chain) == start + n
        with pytest.raises(UsageError):
            res.prepare()  # after the commit: the slots are the store's
        metas = {bytes(k): m for k, m in store.tiers[0].scan()}
        got = [metas[h] for h in chain[start : start + n]]
        assert [m.depth for m in got] == list(range(start, start + n))
        assert [m.parent for m in got[1:]] == list(chain[start : start + n - 1])
        records.append([(m.ns, m.size, m.checksum, m.expiry - m.created) for m in got])
    assert records[0] == records[1]


def test_failure_in_the_middle_of_the_copy_leaves_the_store_consistent(make_store: Make) -> None:
    store = make_store()
    chain = chain_for(6, 6)
    with pytest.raises(RuntimeError), store.reserve(SMALL_NS, chain) as res:
        views = res.views()
        views[0][:] = payload(chain[0])
        views[1][: BB // 2] = payload(chain[1])[: BB // 2]  # half a block, then the copy fails
        del views
        raise RuntimeError("the device copy failed")
    assert served(store, chain) == 0
    assert used(store) == 0
    # Or the caller commits the blocks that landed whole: only those are served.
    res = store.reserve(SMALL_NS, chain)
    write(res, chain, 3)
    res.commit(3)
    assert served(store, chain) == 3
    assert store.put(SMALL_NS, chain, [payload(h) for h in chain[3:]], start=3) == 3
    assert served(store, chain) == 6


def test_a_commit_the_tier_refuses_publishes_nothing(make_store: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store()
    chain = chain_for(15, 4)
    res = store.reserve(SMALL_NS, chain)
    write(res, chain)

    def broken(items: object) -> None:
        raise TierIOError("the arena is gone")

    monkeypatch.setattr(store.tiers[0], "publish_slots", broken)
    with pytest.raises(TierIOError):
        res.commit()
    monkeypatch.undo()
    assert served(store, chain) == 0
    assert (used(store), list(store.iter_blocks())) == (0, [])  # slots back, no hollow block left
    assert store.put(SMALL_NS, chain, [payload(h) for h in chain]) == 4


def test_start_skips_the_cached_prefix_and_cached_blocks(make_store: Make) -> None:
    store = make_store()
    chain = chain_for(7, 6)
    with pytest.raises(MissingPrefixError):
        store.reserve(SMALL_NS, chain, start=2)
    store.put(SMALL_NS, chain[:4], [payload(h) for h in chain[:4]])
    res = store.reserve(SMALL_NS, chain, start=2)  # blocks 2 and 3 are cached: deduplicated
    assert (res.stored, res.first, res.num_blocks) == (4, 4, 2)
    write(res, chain)
    assert res.commit() == 2
    assert served(store, chain) == 6
    assert store.stats()["dedup_blocks"] == 2
    whole = store.reserve(SMALL_NS, chain)  # all cached: nothing to write
    assert (whole.num_blocks, whole.commit()) == (0, 0)


def test_a_long_chain_gets_slots_for_its_leading_blocks(make_store: Make) -> None:
    store = make_store(tiers=dram_only(16))
    other = chain_for(8, 10)
    store.put(SMALL_NS, other, [payload(h) for h in other])
    chain = chain_for(9, 20)
    res = store.reserve(SMALL_NS, chain)  # never fails for room while a block can leave
    assert res.num_blocks == 16
    assert store.lookup(SMALL_NS, other).num_blocks == 0  # made room as a put does
    write(res, chain)
    assert res.commit() == 16
    assert served(store, chain) == 16
    assert store.stats()["truncated_puts"] == 1


def test_reserved_slots_are_not_given_away(make_store: Make) -> None:
    store = make_store(tiers=dram_only(16))
    chain = chain_for(10, 10)
    res = store.reserve(SMALL_NS, chain)
    other = chain_for(11, 10)
    # Only 6 slots are free: the other put stores its leading blocks that fit, none of ours.
    assert store.put(SMALL_NS, other, [payload(h) for h in other]) == 6
    write(res, chain)
    assert res.commit() == 10
    assert served(store, chain) == 10
    assert served(store, other) == 6


def test_reserve_needs_a_dram_arena_first(make_store: Make) -> None:
    store = make_store(tiers=small_tiers()[1:])
    with pytest.raises(UsageError, match="shared-memory DRAM arena"):
        store.reserve(SMALL_NS, chain_for(12, 2))


def test_a_reservation_dropped_without_a_commit_is_aborted_by_the_store(make_store: Make) -> None:
    import gc

    store = make_store(tiers=dram_only(8))
    chain = chain_for(40, 6)
    res = store.reserve(SMALL_NS, chain)
    assert res.num_blocks == 6 and used(store) == 6 * BB
    del res  # no commit, no abort: the chain stays pinned and its slots taken until the store sees it
    gc.collect()
    assert store.stats()["abandoned_reservations"] == 1  # (stats aborts what was dropped)
    assert used(store) == 0 and store.lookup(SMALL_NS, chain).num_blocks == 0
    # the chain is free again: a put stores it whole, and the arena has room for 8 other blocks after
    assert store.put(SMALL_NS, chain, [payload(h) for h in chain]) == 6
    assert served(store, chain) == 6
    other = chain_for(41, 8)
    assert store.put(SMALL_NS, other, [payload(h) for h in other]) == 8  # the old chain could leave


def test_settled_reservations_are_not_counted_as_abandoned(make_store: Make) -> None:
    import gc

    store = make_store(tiers=dram_only())
    a, b = chain_for(42, 2), chain_for(43, 2)
    res = store.reserve(SMALL_NS, a)
    write(res, a)
    res.commit()
    with store.reserve(SMALL_NS, b):
        pass  # aborted by the with block
    del res
    gc.collect()
    assert store.stats()["abandoned_reservations"] == 0
    assert store.lookup(SMALL_NS, a).num_blocks == 2 and store.lookup(SMALL_NS, b).num_blocks == 0


def test_a_quarantined_reservation_stores_nothing_and_keeps_its_slots_until_released(make_store: Make) -> None:
    """PUT_DEVICE after a deadline: the copies may still land in the slots, so nothing is
    committed and the chain is free again, but the slots go to no other put until released."""
    store = make_store(tiers=dram_only(8))
    chain = chain_for(44, 6)
    res = store.reserve(SMALL_NS, chain)
    taken = {off for off, _ in res.locations}
    release = res.quarantine()
    assert res.done and store.lookup(SMALL_NS, chain).num_blocks == 0
    with pytest.raises(UsageError, match="already"):
        res.commit()
    assert used(store) == 6 * BB
    other = chain_for(45, 8)
    again = store.reserve(SMALL_NS, other)  # only the 2 free slots: none of the quarantined ones
    assert again.num_blocks == 2 and taken.isdisjoint(off for off, _ in again.locations)
    again.abort()
    assert store.put(SMALL_NS, chain, [payload(h) for h in chain]) == 2  # the chain is not pinned
    release()
    release()  # (once)
    assert used(store) == 2 * BB
    assert store.put(SMALL_NS, other, [payload(h) for h in other]) == 8
    assert served(store, other) == 8
