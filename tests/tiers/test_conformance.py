"""The one suite every tier passes (the Tier contract of tiers/base.py), run once per kind.

Persistent kinds also pass the restart and corruption tests; kinds that expose a shared-memory
arena (``Tier.arena``) pass the arena's tests. Every kind, wrapped in a FaultyTier, raises the
injected errors and otherwise behaves like itself.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from kvstore.block import BlockMeta
from kvstore.errors import (
    BlockNotFound,
    BufferSizeError,
    CorruptBlockError,
    KVStoreError,
    TierFullError,
    TierIOError,
    UsageError,
)
from kvstore.shm import attach_arena
from tiers.base import Arena, Tier, TierUsage
from tiers.faulty import FaultyTier

KiB = 1024
MiB = 1024 * KiB
Block = Any  # conftest.Block: key, data, meta
MakeBlock = Callable[..., Any]
Factory = Any  # conftest.TierFactory


def _read(tier: Tier, block: Block) -> bytes:
    dst = bytearray(block.meta.size)
    assert tier.read_into(block.key, memoryview(dst)) == block.meta.size
    return bytes(dst)


def _put(tier: Tier, block: Block, *, durable: bool = False) -> None:
    tier.write(block.key, block.data, block.meta, durable=durable)


# ---- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 4096, 5000, 1 * MiB])
@pytest.mark.parametrize("source", ["bytes", "odd_slice", "numpy_2d"])
def test_round_trip_exact_bytes(tier: Tier, size: int, source: str, make_block: MakeBlock) -> None:
    block = make_block(size, seed=size)
    if source == "bytes":
        src: bytes | memoryview = block.data
    elif source == "odd_slice":
        # A view starting at an odd address: no tier may assume aligned caller memory.
        backing = bytearray(size + 3)
        backing[3:] = block.data
        src = memoryview(backing)[3:]
    else:
        # A 2-D view, as from a tensor: tiers cast it to flat bytes, never copy it.
        src = memoryview(np.frombuffer(block.data, dtype=np.uint8).reshape(1, size))
    tier.write(block.key, src, block.meta)
    assert tier.contains(block.key)
    assert _read(tier, block) == block.data
    # Into an unaligned destination as well.
    backing = bytearray(size + 1)
    assert tier.read_into(block.key, memoryview(backing)[1:]) == size
    assert bytes(backing[1:]) == block.data


def test_read_into_larger_dst_leaves_tail_untouched(tier: Tier, make_block: MakeBlock) -> None:
    block = make_block(5000, seed=1)
    _put(tier, block)
    dst = bytearray(b"\xab" * 9000)
    assert tier.read_into(block.key, memoryview(dst)) == 5000
    assert bytes(dst[:5000]) == block.data
    assert dst[5000:] == b"\xab" * 4000


def test_read_into_numpy_dst(tier: Tier, make_block: MakeBlock) -> None:
    block = make_block(8192, seed=2)
    _put(tier, block)
    dst = np.zeros(4096, dtype=np.float16)
    assert tier.read_into(block.key, memoryview(dst)) == 8192
    assert dst.tobytes() == block.data


def test_dst_too_small_raises_buffer_size_error(tier: Tier, make_block: MakeBlock) -> None:
    block = make_block(4096, seed=3)
    _put(tier, block)
    with pytest.raises(BufferSizeError):
        tier.read_into(block.key, memoryview(bytearray(4095)))


def test_readonly_dst_raises_usage_error(tier: Tier, make_block: MakeBlock) -> None:
    block = make_block(100, seed=4)
    _put(tier, block)
    with pytest.raises(UsageError):
        tier.read_into(block.key, memoryview(bytes(100)))


def test_src_size_must_match_meta(tier: Tier, make_block: MakeBlock) -> None:
    block = make_block(100, seed=5)
    with pytest.raises(BufferSizeError):
        tier.write(block.key, block.data[:99], block.meta)
    assert not tier.contains(block.key)
    assert tier.usage().blocks == 0


def test_missing_block(tier: Tier, make_block: MakeBlock) -> None:
    block = make_block(10, seed=6)
    assert not tier.contains(block.key)
    assert tier.meta(block.key) is None
    with pytest.raises(BlockNotFound):
        tier.read_into(block.key, memoryview(bytearray(10)))


# ---- contains, delete, overwrite, usage ------------------------------------------------------


def test_contains_and_delete(tier: Tier, make_block: MakeBlock) -> None:
    a, b = make_block(4096, seed=7), make_block(4096, seed=8)
    _put(tier, a)
    _put(tier, b)
    assert tier.delete(a.key) is True
    assert tier.delete(a.key) is False
    assert not tier.contains(a.key)
    with pytest.raises(BlockNotFound):
        tier.read_into(a.key, memoryview(bytearray(4096)))
    assert tier.contains(b.key)
    assert _read(tier, b) == b.data


def test_delete_many_is_delete_of_each(tier: Tier, make_block: MakeBlock) -> None:
    a, b, c = (make_block(4096, seed=s) for s in (11, 12, 13))
    for blk in (a, b, c):
        _put(tier, blk)
    used = tier.usage().used_bytes
    assert tier.delete_many([a.key, b.key, a.key]) == [True, True, False]
    assert not tier.contains(a.key) and not tier.contains(b.key)
    assert tier.usage().used_bytes < used and tier.usage().blocks == 1
    assert _read(tier, c) == c.data
    assert tier.delete_many([]) == []


@pytest.mark.parametrize("new_size", [4096, 3000, 70 * KiB])
def test_overwrite_replaces(tier: Tier, new_size: int, make_block: MakeBlock) -> None:
    old = make_block(4096, seed=9)
    new = make_block(new_size, seed=10)
    _put(tier, old)
    tier.write(old.key, new.data, new.meta)
    assert tier.usage().blocks == 1
    assert tier.meta(old.key) == new.meta
    dst = bytearray(new_size)
    assert tier.read_into(old.key, memoryview(dst)) == new_size
    assert bytes(dst) == new.data
    assert tier.delete(old.key) is True
    assert tier.usage() == TierUsage(0, tier.usage().capacity_bytes, 0)


def test_usage_goes_up_and_down(tier: Tier, make_block: MakeBlock) -> None:
    empty = tier.usage()
    assert empty.blocks == 0 and empty.used_bytes == 0 and empty.capacity_bytes > 0
    blocks = [make_block(5000, seed=20 + i) for i in range(3)]
    seen = [empty]
    for b in blocks:
        _put(tier, b)
        seen.append(tier.usage())
    assert [u.blocks for u in seen] == [0, 1, 2, 3]
    assert all(x.used_bytes < y.used_bytes for x, y in zip(seen, seen[1:], strict=False))
    assert all(u.used_bytes >= u.blocks * 5000 for u in seen)
    for b in blocks:
        tier.delete(b.key)
    assert tier.usage() == empty


def test_fill_to_capacity(tier: Tier, make_block: MakeBlock) -> None:
    size = 256 * KiB
    written: list[Block] = []
    with pytest.raises(TierFullError):
        for i in range(1000):
            b = make_block(size, seed=100 + i)
            _put(tier, b)
            written.append(b)
    assert written, "not even one block fitted"
    failed = make_block(size, seed=100 + len(written))
    before = tier.usage()
    # Nothing of the failed block is left behind.
    assert not tier.contains(failed.key)
    assert tier.meta(failed.key) is None
    with pytest.raises(BlockNotFound):
        tier.read_into(failed.key, memoryview(bytearray(size)))
    assert not tier.fits(size)
    with pytest.raises(TierFullError):
        _put(tier, failed)
    assert tier.usage() == before
    # Room freed by a delete is usable again.
    assert tier.delete(written[0].key)
    assert tier.fits(size)
    _put(tier, failed)
    assert _read(tier, failed) == failed.data
    assert all(_read(tier, b) == b.data for b in written[1:])


def test_rewrite_of_a_present_key_succeeds_when_full(tier: Tier, make_block: MakeBlock) -> None:
    size = 256 * KiB
    written: list[Block] = []
    with pytest.raises(TierFullError):
        for i in range(1000):
            b = make_block(size, seed=300 + i)
            _put(tier, b)
            written.append(b)
    fresh = make_block(size, seed=999)
    tier.write(written[0].key, fresh.data, fresh.meta)
    dst = bytearray(size)
    assert tier.read_into(written[0].key, memoryview(dst)) == size
    assert bytes(dst) == fresh.data
    assert tier.usage().blocks == len(written)


def test_meta_round_trips_all_fields(tier: Tier, make_block: MakeBlock) -> None:
    block = make_block(777, seed=11, depth=42, ns=bytes(range(16)))
    meta = BlockMeta(
        ns=block.meta.ns,
        parent=block.meta.parent,
        depth=42,
        size=777,
        expiry=1_900_000_000.25,
        checksum=block.meta.checksum,
        created=1_700_000_123.5,
    )
    tier.write(block.key, block.data, meta)
    assert tier.meta(block.key) == meta


def test_update_expiry_of_missing_keys_is_harmless(tier: Tier, make_block: MakeBlock) -> None:
    block = make_block(100, seed=12)
    _put(tier, block)
    tier.update_expiry([(make_block(1, seed=13).key, 1.0), (block.key, 2_000_000_000.0)])
    assert _read(tier, block) == block.data
    got = tier.meta(block.key)
    assert got is not None and got.checksum == block.meta.checksum


# ---- persistence -------------------------------------------------------------------------------


def test_reopen_scan_yields_every_block(factory: Factory, make_block: MakeBlock) -> None:
    factory.require_persistent()
    tier = factory()
    blocks = [make_block(s, seed=40 + i, depth=i) for i, s in enumerate([1, 4096, 5000, 70 * KiB])]
    for i, b in enumerate(blocks):
        _put(tier, b, durable=i % 2 == 0)
    tier.flush()  # makes the non-durable ones durable too
    gone = blocks.pop()
    tier.delete(gone.key)
    usage = tier.usage()
    tier = factory.reopen(tier)
    assert dict(tier.scan()) == {b.key: b.meta for b in blocks}
    assert tier.usage() == usage
    assert not tier.contains(gone.key)
    for b in blocks:
        assert tier.contains(b.key)
        assert tier.meta(b.key) == b.meta
        assert _read(tier, b) == b.data


def test_flipped_payload_byte_is_corrupt(
    factory: Factory, make_block: MakeBlock
) -> None:
    factory.require_persistent()
    tier = factory()
    block = make_block(5000, seed=50)
    other = make_block(5000, seed=51)
    _put(tier, block, durable=True)
    _put(tier, other, durable=True)
    tier.close()
    factory.corrupt(block.data)
    tier = factory()
    with pytest.raises(CorruptBlockError):
        tier.read_into(block.key, memoryview(bytearray(5000)))
    assert _read(tier, other) == other.data


def test_flipped_last_payload_byte_is_corrupt(
    factory: Factory, make_block: MakeBlock
) -> None:
    factory.require_persistent()
    tier = factory()
    block = make_block(4096, seed=52)
    _put(tier, block, durable=True)
    tier.close()
    factory.corrupt(block.data, at=4095)
    tier = factory()
    with pytest.raises(CorruptBlockError):
        tier.read_into(block.key, memoryview(bytearray(4096)))


# ---- concurrency, batches, lifecycle ---------------------------------------------------------


def test_concurrent_writes_and_reads(tier: Tier, make_block: MakeBlock) -> None:
    per_thread = 8
    start = threading.Barrier(4)

    def work(t: int) -> list[Block]:
        blocks = [make_block(16 * KiB + t, seed=1000 + t * 100 + i) for i in range(per_thread)]
        start.wait()
        for b in blocks:
            _put(tier, b)
            assert _read(tier, b) == b.data
        for b in blocks[::2]:
            assert tier.delete(b.key)
        return blocks[1::2]

    with ThreadPoolExecutor(4) as pool:
        kept = [b for blocks in pool.map(work, range(4)) for b in blocks]
    assert tier.usage().blocks == len(kept)
    for b in kept:
        assert _read(tier, b) == b.data


def test_read_many_results_and_errors(tier: Tier, make_block: MakeBlock) -> None:
    a, b = make_block(4096, seed=60), make_block(5000, seed=61)
    missing = make_block(10, seed=62)
    _put(tier, a)
    _put(tier, b)
    dsts = [memoryview(bytearray(4096)), memoryview(bytearray(10)), memoryview(bytearray(100))]
    out = tier.read_many([a.key, missing.key, b.key], dsts)
    assert out[0] == 4096 and bytes(dsts[0]) == a.data
    assert isinstance(out[1], BlockNotFound)
    assert isinstance(out[2], BufferSizeError)


def test_close_twice_is_harmless(tier: Tier, make_block: MakeBlock) -> None:
    _put(tier, make_block(100, seed=70))
    tier.close()
    tier.close()


def test_write_after_close_raises(tier: Tier, make_block: MakeBlock) -> None:
    tier.close()
    block = make_block(100, seed=71)
    with pytest.raises(TierIOError):
        _put(tier, block)


def test_describe(tier: Tier, make_block: MakeBlock) -> None:
    _put(tier, make_block(100, seed=72))
    d = tier.describe()
    assert d["kind"] == tier.kind and d["name"] == "t0" and d["blocks"] == 1
    assert d["persistent"] is tier.persistent


# ---- the shared-memory arena (kinds that expose one) -------------------------------------------


def _arena(tier: Tier) -> Arena:
    arena = tier.arena()
    if arena is None:
        pytest.skip(f"tier kind {tier.kind!r} exposes no shared-memory arena")
    assert isinstance(arena, Arena)
    return arena


def test_arena_locations_point_at_the_payloads(tier: Tier, make_block: MakeBlock) -> None:
    arena = _arena(tier)
    blocks = [make_block(4096, seed=s) for s in (101, 102, 103)]
    for b in blocks[:2]:
        _put(tier, b)
    shm = attach_arena(arena.shm_name)
    try:
        locs = arena.locations([b.key for b in blocks])
        assert locs[2] is None and arena.location(blocks[2].key) is None
        for b, loc in zip(blocks[:2], locs[:2], strict=True):
            assert loc is not None and loc == arena.location(b.key) and loc[1] == b.meta.size
            assert bytes(shm.buf[loc[0] : loc[0] + loc[1]]) == b.data
        fd = arena.readonly_fd()
        try:
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as ro:
                off, size = locs[0]  # type: ignore[misc]
                assert ro[off : off + size] == blocks[0].data
        finally:
            os.close(fd)
    finally:
        shm.close()


def test_arena_peek_sees_leading_blocks_and_frees(tier: Tier, make_block: MakeBlock) -> None:
    arena = _arena(tier)
    a, b, c = (make_block(4096, seed=s) for s in (111, 112, 113))
    _put(tier, a)
    _put(tier, c)
    locations, stamp = arena.peek([a.key, b.key, c.key])
    assert locations == [arena.location(a.key)]  # up to the first block it lacks
    offsets = [off for off, _ in locations]
    assert not arena.freed_since(offsets, stamp)
    assert tier.delete(a.key)
    assert arena.freed_since(offsets, stamp)


def test_arena_reserved_slots_publish_or_free(tier: Tier, make_block: MakeBlock) -> None:
    arena = _arena(tier)
    a, b = make_block(4096, seed=121), make_block(4096, seed=122)
    slots = arena.reserve_slots(4096, 2)
    assert len(slots) == 2 and not tier.contains(a.key)
    view = arena.slot_view(slots[0], 4096)
    view[:] = a.data
    del view
    arena.publish_slots({a.key: (slots[0], a.meta)})
    arena.free_slots(slots[1:])
    assert tier.contains(a.key) and not tier.contains(b.key)
    assert arena.location(a.key) == (slots[0], 4096)
    assert _read(tier, a) == a.data
    assert tier.usage().blocks == 1


def test_arena_publishes_many_slots_at_once_and_a_held_key_moves_to_its_new_slot(
        tier: Tier, make_block: MakeBlock) -> None:
    arena = _arena(tier)
    a, b = make_block(4096, seed=123), make_block(4096, seed=124)
    first = arena.reserve_slots(4096, 1)
    arena.slot_view(first[0], 4096)[:] = a.data
    arena.publish_slots({a.key: (first[0], a.meta)})
    slots = arena.reserve_slots(4096, 2)
    for off, blk in zip(slots, (a, b), strict=True):
        arena.slot_view(off, 4096)[:] = blk.data
    arena.publish_slots({a.key: (slots[0], a.meta), b.key: (slots[1], b.meta)})
    assert arena.locations([a.key, b.key]) == [(slots[0], 4096), (slots[1], 4096)]
    assert _read(tier, a) == a.data and _read(tier, b) == b.data
    assert tier.usage().blocks == 2
    assert first[0] in arena.reserve_slots(4096, 64)  # a's first slot was given back


# ---- fault injection ------------------------------------------------------------------------


def test_faulty_write_error_leaves_nothing(plain_tier: Tier, make_block: MakeBlock) -> None:
    faulty = FaultyTier(plain_tier)
    assert (faulty.kind, faulty.persistent, faulty.name) == (
        plain_tier.kind,
        plain_tier.persistent,
        plain_tier.name,
    )
    a, b = make_block(4096, seed=80), make_block(4096, seed=81)
    faulty.inject("write", TierIOError)
    with pytest.raises(TierIOError, match="injected"):
        _put(faulty, a)
    assert not faulty.contains(a.key) and faulty.usage().blocks == 0
    _put(faulty, a)  # the fault fired once and is spent
    _put(faulty, b)
    assert _read(faulty, a) == a.data
    assert faulty.injected == [("write", a.key)]
    assert faulty.calls["write"] == 3


def test_faulty_corrupt_read_by_predicate(plain_tier: Tier, make_block: MakeBlock) -> None:
    faulty = FaultyTier(plain_tier)
    a, b = make_block(4096, seed=82), make_block(100, seed=83)
    _put(faulty, a)
    _put(faulty, b)
    faulty.inject("read_into", CorruptBlockError, times=None, when=lambda k: k == a.key)
    for _ in range(2):
        with pytest.raises(CorruptBlockError):
            faulty.read_into(a.key, memoryview(bytearray(4096)))
    assert _read(faulty, b) == b.data
    out = faulty.read_many(
        [b.key, a.key], [memoryview(bytearray(100)), memoryview(bytearray(4096))]
    )
    assert out[0] == 100 and isinstance(out[1], CorruptBlockError)
    faulty.clear()
    assert _read(faulty, a) == a.data


def test_faulty_full_after_count(plain_tier: Tier, make_block: MakeBlock) -> None:
    faulty = FaultyTier(plain_tier)
    blocks = [make_block(4096, seed=84 + i) for i in range(4)]
    faulty.inject("write", TierFullError, after=2, times=1)
    _put(faulty, blocks[0])
    _put(faulty, blocks[1])
    with pytest.raises(TierFullError):
        _put(faulty, blocks[2])
    _put(faulty, blocks[3])
    assert [faulty.contains(b.key) for b in blocks] == [True, True, False, True]
    assert faulty.usage().blocks == 3


def test_faulty_delete_and_instance_errors(plain_tier: Tier, make_block: MakeBlock) -> None:
    faulty = FaultyTier(plain_tier)
    a = make_block(100, seed=90)
    _put(faulty, a)
    boom = TierIOError("disk on fire")
    faulty.inject("delete", boom)
    with pytest.raises(TierIOError) as err:
        faulty.delete(a.key)
    assert err.value is boom
    assert faulty.contains(a.key)
    assert faulty.delete(a.key) is True
    with pytest.raises(UsageError):
        faulty.inject("teleport", TierIOError)
    with pytest.raises(UsageError):
        faulty.inject("write", ValueError)  # type: ignore[arg-type]


def test_faulty_passes_through_extras(plain_tier: Tier, make_block: MakeBlock) -> None:
    faulty = FaultyTier(plain_tier)
    a = make_block(100, seed=91)
    _put(faulty, a)
    assert faulty.meta(a.key) == a.meta
    assert faulty.size_class(100) == plain_tier.size_class(100)
    assert faulty.fits(100) == plain_tier.fits(100)
    assert faulty.describe()["faults_injected"] == 0
    assert dict(faulty.scan()) == dict(plain_tier.scan())
    assert faulty.arena() is plain_tier.arena()  # the inner tier's arena, or None for both
    faulty.inject("scan", TierIOError)
    with pytest.raises(KVStoreError):
        faulty.scan()
    faulty.close()
    faulty.close()
