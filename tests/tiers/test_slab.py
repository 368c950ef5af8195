"""SlabAllocator: size classes, slab reuse across classes, occupancy rebuild, and a seeded
random workload that checks the allocator's invariants after every step."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import UsageError
from tiers._slab import SlabAllocator

KiB = 1024
SLAB = 64 * KiB


def test_rejects_bad_geometry() -> None:
    with pytest.raises(UsageError, match="multiple of 4096"):
        SlabAllocator(4 * SLAB, 5000)
    with pytest.raises(UsageError, match="smaller than one slab"):
        SlabAllocator(SLAB - 1, SLAB)


def test_capacity_rounds_down_to_whole_slabs() -> None:
    a = SlabAllocator(3 * SLAB + 100, SLAB)
    assert a.n_slabs == 3
    assert a.capacity_bytes == 3 * SLAB
    assert a.used_bytes == 0


@pytest.mark.parametrize(
    ("size", "slot"), [(1, 4096), (4096, 4096), (4097, 8192), (5000, 8192), (SLAB, SLAB)]
)
def test_slot_bytes_rounds_up_to_align(size: int, slot: int) -> None:
    assert SlabAllocator(SLAB, SLAB).slot_bytes(size) == slot


@pytest.mark.parametrize("size", [0, -1, SLAB + 1])
def test_slot_bytes_rejects_impossible_sizes(size: int) -> None:
    with pytest.raises(UsageError):
        SlabAllocator(SLAB, SLAB).slot_bytes(size)


def test_fresh_arena_fills_front_to_back() -> None:
    a = SlabAllocator(2 * SLAB, SLAB)
    assert [a.alloc(100) for _ in range(4)] == [0, 4096, 8192, 12288]
    assert a.used_bytes == 4 * 4096


def test_each_slab_serves_one_class() -> None:
    a = SlabAllocator(3 * SLAB, SLAB)
    assert a.alloc(4096) == 0
    assert a.alloc(8192) == SLAB  # another class takes the next slab
    assert a.alloc(4096) == 4096  # and the first class keeps filling its own
    assert a.alloc(8192) == SLAB + 8192


def test_full_class_and_pool_returns_none() -> None:
    a = SlabAllocator(2 * SLAB, SLAB)
    offsets = [a.alloc(SLAB // 2) for _ in range(4)]
    assert offsets == [0, SLAB // 2, SLAB, SLAB + SLAB // 2]
    assert not a.fits(SLAB // 2)
    assert not a.fits(4096)  # no slab left for another class either
    assert a.alloc(SLAB // 2) is None
    assert a.alloc(4096) is None
    assert a.used_bytes == a.capacity_bytes


def test_free_makes_the_slot_reusable() -> None:
    a = SlabAllocator(SLAB, SLAB)
    offsets = [a.alloc(SLAB // 4) for _ in range(4)]
    assert a.alloc(SLAB // 4) is None
    a.free(offsets[2])
    assert a.used_bytes == 3 * SLAB // 4
    assert a.fits(SLAB // 4)
    assert a.alloc(SLAB // 4) == offsets[2]


def test_emptied_slab_serves_another_class() -> None:
    a = SlabAllocator(SLAB, SLAB)
    offsets = [a.alloc(4096) for _ in range(SLAB // 4096)]
    assert not a.fits(8192)
    for off in offsets:
        a.free(off)
    assert a.used_bytes == 0
    assert a.fits(8192)
    assert a.alloc(8192) == 0
    # The slab now belongs to the 8 KiB class: the 4 KiB class has no room left.
    assert not a.fits(4096)
    assert a.alloc(4096) is None


def test_free_of_an_unassigned_slab_is_an_error() -> None:
    a = SlabAllocator(2 * SLAB, SLAB)
    a.alloc(4096)
    with pytest.raises(RuntimeError):
        a.free(SLAB)


def test_claim_rebuilds_occupancy() -> None:
    a = SlabAllocator(3 * SLAB, SLAB)
    live = {a.alloc(4096): 4096, a.alloc(5000): 5000, a.alloc(100): 100, a.alloc(SLAB): SLAB}
    live.pop(next(iter(live)))  # a hole in the middle of the 4 KiB slab after a delete
    b = SlabAllocator(3 * SLAB, SLAB)
    for off, size in live.items():
        b.claim(off, size)
    assert b.used_bytes == sum(b.slot_bytes(s) for s in live.values())
    # New allocations never land on claimed slots, and the hole is used again.
    fresh = [b.alloc(4096) for _ in range(3)]
    assert 0 in fresh
    assert not set(fresh) & set(live)
    assert b.alloc(SLAB) is None  # the claims assigned all three slabs


def test_claim_many_is_claim_in_order() -> None:
    """A restart claims every record at once: the same outcome as one claim each, bad records
    (no size, too big, past the end, another class, a slot past the slab's last, a repeat)
    included."""
    rng = np.random.default_rng(7)
    sizes = [0, 100, 4096, 5000, 12 * KiB, SLAB // 3, SLAB, SLAB + 1]
    for _ in range(20):
        one, many = SlabAllocator(6 * SLAB, SLAB), SlabAllocator(6 * SLAB, SLAB)
        for a in (one, many):  # some slots used before
            a.claim(SLAB + 4096, 4096)
        offsets = [int(o) for o in rng.integers(0, 7 * SLAB // 4096, 300) * 4096]
        offsets += offsets[:20] + [2 * SLAB // 3 * 2, SLAB + 4096]
        sz = [sizes[int(i)] for i in rng.integers(0, len(sizes), len(offsets))]
        want = []
        for off, size in zip(offsets, sz, strict=True):
            try:
                one.claim(off, size)
                want.append(True)
            except (RuntimeError, IndexError, UsageError):
                want.append(False)
        got = many.claim_many(np.array(offsets, np.uint64), np.array(sz, np.uint64))
        assert got.tolist() == want
        assert [(s.slot_bytes, bytes(s.busy), s.used) for s in one._slabs] == [(s.slot_bytes, bytes(s.busy), s.used) for s in many._slabs]
        assert (one.used_bytes, one._unassigned, one._empty) == (many.used_bytes, many._unassigned, many._empty)
        assert [one.alloc(4096) for _ in range(40)] == [many.alloc(4096) for _ in range(40)]


def test_claim_of_a_slot_in_a_slab_of_another_class_is_an_error() -> None:
    a = SlabAllocator(2 * SLAB, SLAB)
    a.claim(0, 4096)
    with pytest.raises(RuntimeError, match="claimed for class"):
        a.claim(8192, 8192)


def test_random_workload_keeps_invariants() -> None:
    rng = np.random.default_rng(1234)
    a = SlabAllocator(8 * SLAB, SLAB)
    sizes = [100, 4096, 5000, 12 * KiB, SLAB // 2, SLAB]
    live: dict[int, int] = {}  # offset -> size
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = list(live)[int(rng.integers(len(live)))]
            a.free(off)
            del live[off]
        else:
            size = sizes[int(rng.integers(len(sizes)))]
            could = a.fits(size)
            off = a.alloc(size)
            assert (off is not None) == could, "fits() and alloc() disagree"
            if off is not None:
                assert off not in live
                live[off] = size
        # Every live slot lies inside one slab, on a boundary of its class, without overlap.
        spans = sorted((o, o + a.slot_bytes(s)) for o, s in live.items())
        starts = [o for o, _ in spans[1:]] + [a.capacity_bytes]
        for (o, end), next_start in zip(spans, starts, strict=False):
            assert (o % SLAB) % a.slot_bytes(live[o]) == 0
            assert o // SLAB == (end - 1) // SLAB
            assert end <= next_start
        assert a.used_bytes == sum(a.slot_bytes(s) for s in live.values())


def test_double_free_and_double_claim_are_bugs() -> None:
    a = SlabAllocator(capacity_bytes=4 * 16384, slab_bytes=16384)
    off = a.alloc(4096)
    assert off is not None
    a.free(off)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(off)
    b = SlabAllocator(capacity_bytes=4 * 16384, slab_bytes=16384)
    b.claim(4096, 4096)
    with pytest.raises(RuntimeError, match="claimed twice"):
        b.claim(4096, 4096)


def test_claims_settle_into_free_lists() -> None:
    a = SlabAllocator(capacity_bytes=2 * 16384, slab_bytes=16384)
    for off in (0, 8192):  # slots 0 and 2 of slab 0 survived a restart
        a.claim(off, 4000)
    got = {a.alloc(4000), a.alloc(4000)}
    assert got == {4096, 12288}  # the two free slots of slab 0, before a new slab
    assert a.used_bytes == 4 * 4096
    a.free(0)
    a.free(8192)
    a.free(4096)
    a.free(12288)
    assert a.fits(16384)  # the emptied slab serves another class
    assert a.alloc(16384) is not None and a.alloc(16384) is not None


def _books(a: SlabAllocator) -> tuple[object, ...]:
    a._settle()
    return (a.used_bytes, sorted(a._unassigned), sorted(a._empty), {c: sorted(s) for c, s in a._partial.items() if s},
            [(s.slot_bytes, sorted(s.free), bytes(s.busy), s.used) for s in a._slabs])


@pytest.mark.parametrize("count", [0, 1, 5, 16, 17, 40, 200])
def test_alloc_many_hands_out_what_as_many_allocs_would(count: int) -> None:
    """The reserve path's bulk allocation: the same offsets, in order, and the same books as
    ``count`` calls of ``alloc`` (across a partly used slab, fresh slabs, a full pool)."""
    rng = np.random.default_rng(count)
    one, many = SlabAllocator(5 * SLAB, SLAB), SlabAllocator(5 * SLAB, SLAB)
    for a in (one, many):  # the same history: a partly used slab of the class, another class
        offs = [a.alloc(4 * KiB) for _ in range(10)]
        a.alloc(8 * KiB)
        for i in rng.permutation(10)[:4].tolist():
            a.free(offs[i])
        rng = np.random.default_rng(count)
    want = []
    for _ in range(count):
        off = one.alloc(4 * KiB)
        if off is None:
            break
        want.append(off)
    got = many.alloc_many(4 * KiB, count)
    assert got == want
    assert len(set(got)) == len(got)
    assert _books(many) == _books(one)
    for off in got:  # every one is a live slot: freed once, refused twice
        many.free(off)
    if got:
        with pytest.raises(RuntimeError, match="double free"):
            many.free(got[0])
