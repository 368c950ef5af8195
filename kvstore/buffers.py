"""Caller-owned buffers as flat byte views, without copying, and the copy between them.

A leaf module (it imports only :mod:`kvstore.errors`): tiers, the store and the daemon client
all turn what a caller passes (bytes, bytearray, memoryview, numpy arrays, CPU tensors) into
``memoryview`` slices here, so every I/O lands in memory the caller owns. :class:`CopyPool`
moves a batch of such views with several threads (:func:`copy_pool` hands out one per size).
"""

from __future__ import annotations

import ctypes
import os
import queue
import re
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.errors import BufferSizeError, UsageError

Buffer = memoryview | bytes | bytearray


def byte_view(buf: Buffer, *, writable: bool = False) -> memoryview:
    """``buf`` as a flat, C-contiguous unsigned-byte view, without copying.

    Accepts numpy/torch-backed views of any item format and shape. UsageError for a strided
    view or, with ``writable``, a read-only buffer.
    """
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if not mv.c_contiguous:
        raise UsageError("the buffer must be C-contiguous; pass a contiguous copy or view")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    if writable and mv.readonly:
        raise UsageError("the destination buffer is read-only; pass a writable buffer")
    return mv


def as_view(buf: Any, writable: bool) -> memoryview:
    """Any buffer a caller may pass (a contiguous CPU tensor included) as a flat byte view."""
    if type(buf).__module__.startswith("torch"):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise UsageError("torch buffers must be contiguous CPU tensors")
        buf = buf.view(-1).view(__import__("torch").uint8).numpy()
    try:
        return byte_view(buf, writable=writable)
    except TypeError:
        raise UsageError(
            f"expected a buffer (bytes, bytearray, numpy array, tensor), got {type(buf).__name__}"
        ) from None


def _split(buf: Any, bb: int, writable: bool, count: int | None) -> list[memoryview]:
    mv = as_view(buf, writable)
    if count is None:
        if len(mv) % bb:
            raise BufferSizeError(
                f"buffer of {len(mv)} bytes is not a whole number of {bb}-byte blocks"
            )
        count = len(mv) // bb
    elif len(mv) != count * bb:
        raise BufferSizeError(f"expected {count} blocks of {bb} bytes ({count * bb} bytes), got {len(mv)}")
    return [mv[i * bb : (i + 1) * bb] for i in range(count)]


def dst_views(dst: Any, bb: int) -> list[memoryview]:
    """Writable views of ``bb``-byte blocks: one per buffer of a list (each at least ``bb``
    bytes), or ``dst`` cut into whole blocks."""
    if isinstance(dst, list | tuple):
        views = [as_view(d, True) for d in dst]
        for i, v in enumerate(views):
            if len(v) < bb:
                raise BufferSizeError(f"destination buffer {i} has {len(v)} bytes; a block needs {bb}")
        return views
    return _split(dst, bb, True, None)


def src_views(blocks: Any, bb: int, count: int) -> list[memoryview]:
    """Read-only views of ``count`` payloads of exactly ``bb`` bytes: one per buffer of a list,
    or ``blocks`` cut into ``count`` blocks."""
    if isinstance(blocks, list | tuple):
        if len(blocks) != count:
            raise UsageError(f"expected {count} block payloads, got {len(blocks)}")
        views = [as_view(b, False) for b in blocks]
        for i, v in enumerate(views):
            if len(v) != bb:
                raise BufferSizeError(f"payload {i} has {len(v)} bytes; a block of this namespace has {bb}")
        return views
    return _split(blocks, bb, False, count)


def address(mv: memoryview) -> int:
    """The memory address of ``mv``'s first byte (read-only views too)."""
    return int(np.frombuffer(mv, np.uint8).__array_interface__["data"][0])



def span(first: memoryview, nbytes: int, *, writable: bool = True) -> memoryview | None:
    """A view of ``nbytes`` from ``first``'s first byte on, of the exporter ``first`` was cut
    from (so that views lying back to back in it move in one copy: a copy of many MiB runs with
    the non-temporal stores that one of 2 MiB does not get); None when that memory is not one
    flat buffer of that size (writable, with ``writable``)."""
    try:
        whole = byte_view(first.obj, writable=writable)  # type: ignore[arg-type]  # any exporter: memoryview() takes it
    except (UsageError, TypeError, ValueError):
        return None
    at = address(first) - address(whole)
    if at < 0 or at + nbytes > whole.nbytes:
        return None
    return whole[at : at + nbytes]



def arena_pairs(
    arena: memoryview, locs: Sequence[tuple[int, int]], views: Sequence[memoryview], *, into_arena: bool = False
) -> list[tuple[memoryview, memoryview]]:
    """The ``(destination, source)`` pairs that copy each block ``locs[i]`` (offset, size) of
    ``arena`` into the caller's ``views[i]`` (or, ``into_arena``, ``views[i]`` into the arena).
    Blocks that lie back to back in the arena and in one caller buffer (a chain put in one go,
    loaded into one tensor) become one pair: a memcpy of many MiB runs with non-temporal stores,
    one of 1-2 MiB does not (docs/benchmarks.md)."""
    pairs: list[tuple[memoryview, memoryview]] = []
    i = 0
    while i < len(locs):
        off, n = locs[i]
        first = views[i]
        end, at, j = off + n, address(first) + n, i + 1
        while j < len(locs) and locs[j][0] == end and views[j].obj is first.obj and address(views[j]) == at:
            end, at, j = end + locs[j][1], at + locs[j][1], j + 1
        whole = span(first, end - off, writable=not into_arena) if j - i > 1 else None
        if whole is not None:
            pairs.append((arena[off:end], whole) if into_arena else (whole, arena[off:end]))
            i = j
            continue
        for k in range(i, j):
            o, m = locs[k]
            pairs.append((arena[o : o + m], views[k][:m]) if into_arena else (views[k][:m], arena[o : o + m]))
        i = j
    return pairs

# ---- copies of many bytes with several threads --------------------------------------------

PARALLEL_MIN_BYTES = 64 << 20
"""A batch smaller than this is copied by the calling thread alone: it would make fewer than two
pieces of ``PIECE_BYTES``."""
PIECE_BYTES = 32 << 20
"""The smallest piece a batch is cut into; a batch is cut into about four pieces per thread (at
page boundaries), so that a thread that is late (a busy core) leaves its share to the others.
Not smaller: 32 MiB chunks cut into 8 MiB pieces over 2 threads copied at 7.5-11.2 GB/s against
10.0-10.7 whole (load 3), likely for want of glibc's non-temporal stores on smaller copies."""
MAX_COPY_THREADS = 64

_memmove = ctypes.memmove  # a ctypes foreign call: it releases the GIL while it copies

_NT: list[int] = []  # nontemporal_threshold(), once known
_NT_LINE = re.compile(r"glibc\.cpu\.x86_non_temporal_threshold:\s*0x([0-9a-fA-F]+)")


def nontemporal_threshold() -> int:
    """glibc's ``x86_non_temporal_threshold`` in this process, in bytes (0 when not known: not
    glibc on x86-64, or a glibc before 2.33). A ``memmove`` of at least this many bytes writes
    with non-temporal stores; a smaller one writes through the caches, which on a large host
    halves a copy's speed (the H200's 16-core host, glibc 2.39, 300 MiB of L3, so ~75 MiB by
    glibc's rule of a quarter of the L3: 512 MiB into the arena in 32 MiB pieces, 8 threads,
    23.5 GB/s, and 39.2 with ``GLIBC_TUNABLES`` setting the threshold to 4 MiB). Read once, from ``ld.so --list-tunables`` (which sees this process's
    ``GLIBC_TUNABLES``)."""
    if not _NT:
        _NT.append(_read_nontemporal_threshold())
    return _NT[0]


def _read_nontemporal_threshold() -> int:
    try:
        with open("/proc/self/maps") as f:
            ldso = next((line.split()[-1] for line in f if "/ld-linux" in line), "")
        if not ldso:
            return 0
        out = subprocess.run([ldso, "--list-tunables"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    m = _NT_LINE.search(out.stdout)
    return int(m.group(1), 16) if m else 0


def default_piece_bytes() -> int:
    """The smallest piece a :class:`CopyPool` cuts a batch into by default: ``PIECE_BYTES``, or
    glibc's non-temporal threshold rounded up to a page when that is larger (up to 1 GiB), so
    that every piece is copied with non-temporal stores."""
    nt = nontemporal_threshold()
    return max(PIECE_BYTES, (nt + 4095) & ~4095 if nt <= 1 << 30 else 0)


def default_copy_threads() -> int:
    """``max(min(4, cores), min(16, cores // 2))`` of the cores this process may run on: 2 on
    2 cores, 4 on 4 to 9, half the cores from 10 on, at most 16. One core copies well under a
    host's memory bandwidth (the H200's 16-core host: 10.0 GB/s with 1 thread, 19.6 with 4, 32.6
    with 8, 39.1 with 16), and a copy takes its threads only while it runs; half the cores, not
    all, stay for the engine and the other copies."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores), min(16, cores // 2))


class _Batch:
    """One call's pieces; every participant (the caller and any worker) takes the next piece
    until none is left, so a worker that is busy elsewhere never holds a caller up."""

    __slots__ = ("pieces", "next", "left", "done", "error", "lock")

    def __init__(self, pieces: list[tuple[int, int, int]]) -> None:
        self.pieces = pieces
        self.next = 0
        self.left = len(pieces)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        while True:
            with self.lock:
                i = self.next
                if i >= len(self.pieces):
                    return
                self.next = i + 1
            dst, src, n = self.pieces[i]
            try:
                _memmove(dst, src, n)
            except Exception as e:  # reported to the caller, who raises it with context
                self.error = e
            with self.lock:
                self.left -= 1
                if self.left == 0:
                    self.done.set()


class CopyPool:
    """Copies between buffers, split across ``threads`` threads (the caller is one of them).

    ``copy(pairs)`` moves each ``(dst, src)`` pair of equally long byte views (:func:`byte_view`)
    and returns when every byte has landed. A batch of at least ``min_bytes`` is cut into pieces
    of at least ``piece_bytes`` (0: :func:`default_piece_bytes`)
    that the caller and ``threads - 1`` persistent worker threads copy at once, each with a
    GIL-releasing ``memmove``; a smaller batch, a pool of one thread, or a batch that arrives
    while another uses the workers is copied by the caller alone. Thread safety: any number of
    threads may call :meth:`copy` at once; a caller copies its own pieces too, so a worker
    that is late (its core busy) never makes a copy slower than one thread would. Worker threads are daemons that live as
    long as the process (:func:`copy_pool` keeps one pool per size).
    """

    def __init__(self, threads: int, *, min_bytes: int = PARALLEL_MIN_BYTES, piece_bytes: int = 0) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_COPY_THREADS:
            raise UsageError(f"copy threads must be a whole number in 1..{MAX_COPY_THREADS}, got {threads!r}")
        piece_bytes = piece_bytes or default_piece_bytes()
        if piece_bytes <= 0 or piece_bytes % 4096:
            raise UsageError(f"piece_bytes must be a positive multiple of 4096, got {piece_bytes}")
        self.threads = threads
        self.min_bytes = min_bytes
        self.piece_bytes = piece_bytes
        self._active = 0  # copies of min_bytes or more in flight
        self._active_lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Batch] = queue.SimpleQueue()
        for i in range(threads - 1):
            threading.Thread(target=self._serve, name=f"kvstore-copy-{threads}-{i}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._queue.get().work()

    def copy(self, pairs: Sequence[tuple[memoryview, memoryview]]) -> int:
        """Copy every ``src`` into its ``dst`` (the views stay the caller's, alive until this
        returns); returns the bytes copied. BufferSizeError when a pair's lengths differ."""
        total = 0
        for d, s in pairs:
            if d.nbytes != s.nbytes:
                raise BufferSizeError(f"a copy of {s.nbytes} bytes into a {d.nbytes}-byte destination")
            total += d.nbytes
        if self.threads == 1 or total < self.min_bytes:
            self._alone(pairs)
            return total
        # Split only a copy that runs alone: several large copies at once already keep the
        # cores busy (8 clients loading 512 MiB each at once: 25% slower in all when each one
        # also split its copy).
        with self._active_lock:
            alone = self._active == 0
            self._active += 1
        try:
            if alone:
                self._split(pairs, total)
            else:
                self._alone(pairs)
        finally:
            with self._active_lock:
                self._active -= 1
        return total

    @staticmethod
    def _alone(pairs: Sequence[tuple[memoryview, memoryview]]) -> None:
        for d, s in pairs:
            if d.nbytes:
                _memmove(address(d), address(s), d.nbytes)

    def _split(self, pairs: Sequence[tuple[memoryview, memoryview]], total: int) -> None:
        piece = max(self.piece_bytes, (-(-total // (4 * self.threads)) + 4095) & ~4095)
        pieces: list[tuple[int, int, int]] = []
        for d, s in pairs:
            da, sa, n = address(d), address(s), d.nbytes
            for at in range(0, n, piece):
                pieces.append((da + at, sa + at, min(piece, n - at)))
        batch = _Batch(pieces)
        for _ in range(min(self.threads - 1, len(pieces) - 1)):
            self._queue.put(batch)
        batch.work()
        batch.done.wait()
        if batch.error is not None:
            raise RuntimeError(f"a copy of {total} bytes in {len(pieces)} pieces failed: {batch.error}") from batch.error


_pools: dict[int, CopyPool] = {}
_pools_lock = threading.Lock()


def copy_pool(threads: int = 0) -> CopyPool:
    """The process's :class:`CopyPool` of ``threads`` threads (0: :func:`default_copy_threads`),
    created on first use and shared by every caller that asks for that size."""
    n = threads or default_copy_threads()
    with _pools_lock:
        pool = _pools.get(n)
        if pool is None:
            pool = _pools[n] = CopyPool(n)
        return pool
