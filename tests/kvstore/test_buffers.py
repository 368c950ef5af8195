"""kvstore.buffers: the multi-threaded copy (CopyPool) and its process-wide pools."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvstore.buffers as buffers
from kvstore.buffers import CopyPool, copy_pool, default_copy_threads
from kvstore.errors import BufferSizeError, UsageError

KiB = 1024
WAIT_S = 120.0  # generous: a loaded 2-core box may not run a worker for a long while


def _pairs(sizes: list[int], seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    return [np.zeros(n, np.uint8) for n in sizes], srcs


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_byte_lands_across_pieces_and_pairs(threads: int) -> None:
    pool = CopyPool(threads, min_bytes=0, piece_bytes=4 * KiB)
    sizes = [0, 1, 4 * KiB, 4 * KiB + 7, 37 * KiB + 3, 100 * KiB]
    dsts, srcs = _pairs(sizes, seed=threads)
    got = pool.copy([(memoryview(d), memoryview(s)) for d, s in zip(dsts, srcs, strict=True)])
    assert got == sum(sizes)
    for d, s in zip(dsts, srcs, strict=True):
        assert np.array_equal(d, s)


def record_memmoves(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that run each memmove of kvstore.buffers from now on."""
    seen: list[str] = []
    real = buffers._memmove

    def recording(dst: int, src: int, n: int) -> int:
        seen.append(threading.current_thread().name)
        return real(dst, src, n)

    monkeypatch.setattr(buffers, "_memmove", recording)
    return seen


def test_a_small_batch_stays_in_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = CopyPool(2, min_bytes=64 * KiB, piece_bytes=4 * KiB)
    seen = record_memmoves(monkeypatch)
    dsts, srcs = _pairs([16 * KiB, 16 * KiB], seed=1)
    pool.copy([(memoryview(d), memoryview(s)) for d, s in zip(dsts, srcs, strict=True)])
    assert seen == [threading.current_thread().name] * 2  # one memmove per pair, no pieces
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def test_a_large_batch_is_shared_with_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's first piece waits until a worker has copied one: so the pieces really go to
    more than one thread (no timing involved; the wait only bounds a broken pool)."""
    pool = CopyPool(2, min_bytes=0, piece_bytes=4 * KiB)
    me = threading.current_thread()
    worker_copied = threading.Event()
    who: list[str] = []
    real = buffers._memmove

    def gated(dst: int, src: int, n: int) -> int:
        if threading.current_thread() is me:
            assert worker_copied.wait(WAIT_S), "no worker thread took a piece"
        else:
            worker_copied.set()
        who.append(threading.current_thread().name)
        return real(dst, src, n)

    monkeypatch.setattr(buffers, "_memmove", gated)
    dsts, srcs = _pairs([64 * KiB], seed=2)
    pool.copy([(memoryview(dsts[0]), memoryview(srcs[0]))])
    assert np.array_equal(dsts[0], srcs[0])
    assert len(who) == 4 * 2  # 64 KiB in four pieces per thread of 8 KiB (two pages)
    assert any(name.startswith("kvstore-copy-") for name in who)


def test_a_copy_that_arrives_during_another_is_not_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several large copies at once already keep the cores busy: the second copies alone."""
    pool = CopyPool(2, min_bytes=0, piece_bytes=4 * KiB)
    first_started, second_done = threading.Event(), threading.Event()
    who: list[tuple[str, int]] = []
    real = buffers._memmove
    first = threading.Thread(target=lambda: pool.copy([(memoryview(da), memoryview(sa))]), name="first")

    def gated(dst: int, src: int, n: int) -> int:
        name = threading.current_thread().name
        if name == "first" and not first_started.is_set():
            first_started.set()
            assert second_done.wait(WAIT_S), "the second copy did not finish alone"
        who.append((name, n))
        return real(dst, src, n)

    monkeypatch.setattr(buffers, "_memmove", gated)
    (da, db), (sa, sb) = _pairs([64 * KiB, 64 * KiB], seed=3)
    first.start()
    assert first_started.wait(WAIT_S)
    pool.copy([(memoryview(db), memoryview(sb))])
    second_done.set()
    first.join()
    assert (threading.current_thread().name, 64 * KiB) in who  # one memmove of the whole pair
    assert sum(n for name, n in who if name == threading.current_thread().name) == 64 * KiB
    assert np.array_equal(da, sa) and np.array_equal(db, sb)


def test_concurrent_callers_share_one_pool() -> None:
    pool = CopyPool(3, min_bytes=0, piece_bytes=4 * KiB)
    results: list[bool] = []
    errors: list[BaseException] = []

    def caller(seed: int) -> None:
        try:
            dsts, srcs = _pairs([50 * KiB, 3 * KiB], seed=seed)
            for _ in range(5):
                for d in dsts:
                    d.fill(0)
                pool.copy([(memoryview(d), memoryview(s)) for d, s in zip(dsts, srcs, strict=True)])
                results.append(all(np.array_equal(d, s) for d, s in zip(dsts, srcs, strict=True)))
        except Exception as e:  # surfaced below with the others
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [True] * 40


def test_mismatched_lengths_and_bad_sizes_are_refused() -> None:
    pool = CopyPool(1)
    with pytest.raises(BufferSizeError, match="10 bytes into a 9-byte"):
        pool.copy([(memoryview(bytearray(9)), memoryview(bytes(10)))])
    for bad in (0, -1, True, 2.0, buffers.MAX_COPY_THREADS + 1):
        with pytest.raises(UsageError, match="copy threads"):
            CopyPool(bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="multiple of 4096"):
        CopyPool(2, piece_bytes=1000)


def test_pools_are_shared_per_size() -> None:
    assert 1 <= default_copy_threads() <= 16
    assert copy_pool(2) is copy_pool(2)
    assert copy_pool(0) is copy_pool(default_copy_threads())
    assert copy_pool(1).threads == 1


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 2), (3, 3), (4, 4), (8, 4), (9, 4), (10, 5), (16, 8),
                                                (24, 12), (32, 16), (128, 16)])
def test_the_default_copy_threads_scale_with_the_cores(monkeypatch: pytest.MonkeyPatch, cores: int, threads: int) -> None:
    """As a 2-core VM always had (2), half the cores on a large host (8 on the H200's 16: 32.6 GB/s
    against 19.6 with 4), never more than 16."""
    monkeypatch.setattr(buffers.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert default_copy_threads() == threads


def test_default_pieces_reach_glibcs_non_temporal_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece under glibc's threshold is copied through the caches (half speed on a large host):
    the default piece is the larger of PIECE_BYTES and the threshold, page-rounded."""
    monkeypatch.setattr(buffers, "_NT", [75 * 1024 * 1024 + 1])
    assert buffers.default_piece_bytes() == 75 * 1024 * 1024 + 4096
    assert CopyPool(1).piece_bytes == 75 * 1024 * 1024 + 4096
    assert CopyPool(1, piece_bytes=8 * KiB).piece_bytes == 8 * KiB  # an explicit size stays
    monkeypatch.setattr(buffers, "_NT", [1 << 20])  # a small threshold: PIECE_BYTES
    assert buffers.default_piece_bytes() == buffers.PIECE_BYTES
    monkeypatch.setattr(buffers, "_NT", [0])  # not known
    assert buffers.default_piece_bytes() == buffers.PIECE_BYTES


def test_the_non_temporal_threshold_is_read_from_glibc_or_is_zero() -> None:
    nt = buffers._read_nontemporal_threshold()
    assert nt == 0 or nt >= 0x4040  # glibc's own minimum
