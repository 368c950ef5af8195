"""Aligned I/O on one preallocated file: ``O_DIRECT`` straight into caller memory.

``O_DIRECT`` needs the file offset, the length and the memory address of every transfer aligned
to the device's logical block size. :data:`ALIGN` (4096) covers both 512-byte and 4K devices.
Slots in the data file start on :data:`ALIGN` boundaries and are padded to a multiple of it, so
only the memory side can be misaligned:

* caller memory 4096-aligned: the aligned bulk of a block moves directly between the file and the
  caller's buffer (no copy); only the last partial page goes through a bounce buffer;
* caller memory unaligned: the whole block goes through the bounce buffer (one memcpy).

Bounce buffers are per thread (so concurrent I/O needs no lock), ``mmap``-allocated (so they are
page aligned) and grown on demand, never shrunk: the largest block is bounded by the slab size.

When the filesystem refuses ``O_DIRECT`` (tmpfs answers EINVAL at open) the file is opened
buffered instead and :attr:`DirectFile.direct` says so; callers expose it, nothing fails.

This module moves bytes and raises plain :class:`OSError`; the tier maps errors to its own types.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Sequence

import numpy as np

ALIGN = 4096
"""Alignment of offsets, lengths and memory addresses for ``O_DIRECT`` transfers."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_ZEROS = memoryview(bytes(ALIGN))
_MIN_BOUNCE = 64 * 1024


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def address(mv: memoryview) -> int:
    """The memory address of ``mv``'s first byte (works for read-only buffers too).

    Through ctypes for a writable buffer (~1.5 us; numpy's ``__array_interface__`` builds a dict,
    ~8 us, per block read); numpy for a read-only or empty one."""
    if not mv.readonly and mv.nbytes:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    return int(np.frombuffer(mv, np.uint8).__array_interface__["data"][0])


def is_aligned(mv: memoryview) -> bool:
    return address(mv) % ALIGN == 0


class _Bounce(threading.local):
    view: memoryview | None = None


class DirectFile:
    """A file opened for aligned positional I/O; thread-safe (every call is positional).

    ``open`` creates the file if needed. With ``direct=True`` it asks for ``O_DIRECT`` and falls
    back to buffered I/O when the filesystem or platform refuses it; ``fallback_reason`` then
    says why. Reads and writes of one block may run concurrently with others on other offsets.
    """

    def __init__(self, fd: int, path: str, direct: bool, fallback_reason: str = "") -> None:
        self.fd = fd
        self.path = path
        self.direct = direct
        self.fallback_reason = fallback_reason
        self._bounce = _Bounce()

    @classmethod
    def open(cls, path: str, *, direct: bool) -> DirectFile:
        flags = os.O_RDWR | os.O_CREAT | _O_CLOEXEC
        if direct and _O_DIRECT:
            try:
                return cls(os.open(path, flags | _O_DIRECT, 0o644), path, True)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                reason = "the filesystem refused O_DIRECT (EINVAL at open); using buffered I/O"
        elif direct:
            reason = "this platform has no O_DIRECT; using buffered I/O"
        else:
            reason = "direct_io is off in the config"
        return cls(os.open(path, flags, 0o644), path, False, reason)

    # ---- file sizing ------------------------------------------------------------------------

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def resize(self, size: int) -> None:
        """Make the file exactly ``size`` bytes, with every byte allocated on disk.

        Preallocation means a later write never fails with ENOSPC half way through a block and
        keeps the file's extents contiguous for sequential reads.
        """
        if self.size() > size:
            os.ftruncate(self.fd, size)
        os.posix_fallocate(self.fd, 0, size)

    def datasync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    # ---- block I/O ----------------------------------------------------------------------------

    def bounce(self, nbytes: int) -> memoryview:
        """This thread's page-aligned scratch buffer of at least ``nbytes`` bytes."""
        view = self._bounce.view
        if view is None or view.nbytes < nbytes:
            size = max(_MIN_BOUNCE, 1 << (nbytes - 1).bit_length())
            # An anonymous mapping is page aligned; the old one is unmapped when its view dies.
            view = self._bounce.view = memoryview(mmap.mmap(-1, size))
        return view

    def write_at(self, src: memoryview, offset: int) -> None:
        """Write all of ``src`` (flat bytes) at ``offset`` (ALIGN-aligned when direct).

        In direct mode the slot is written up to the next ALIGN boundary; the padding is zeros.
        """
        size = src.nbytes
        if not self.direct:
            _pwrite_full(self.fd, [src], offset)
            return
        bulk = size - size % ALIGN
        tail = size - bulk
        if is_aligned(src):
            bufs = [src[:bulk]] if bulk else []
            if tail:
                b = self.bounce(ALIGN)
                b[:tail] = src[bulk:]
                b[tail:ALIGN] = _ZEROS[: ALIGN - tail]
                bufs.append(b[:ALIGN])
        else:
            padded = round_up(size)
            b = self.bounce(padded)
            b[:size] = src
            if tail:
                b[size:padded] = _ZEROS[: padded - size]
            bufs = [b[:padded]]
        _pwrite_full(self.fd, bufs, offset)

    def read_into(self, dst: memoryview, size: int, offset: int) -> None:
        """Fill ``dst[:size]`` (flat, writable) from ``offset``; bytes of ``dst`` past ``size``
        are never touched (the caller's buffer may hold other blocks there)."""
        if not self.direct:
            _pread_full(self.fd, [dst[:size]], offset)
            return
        bulk = size - size % ALIGN
        tail = size - bulk
        if is_aligned(dst):
            if not tail:
                _pread_full(self.fd, [dst[:bulk]], offset)
                return
            b = self.bounce(ALIGN)
            _pread_full(self.fd, [dst[:bulk], b[:ALIGN]] if bulk else [b[:ALIGN]], offset)
            dst[bulk:size] = b[:tail]
        else:
            padded = round_up(size)
            b = self.bounce(padded)
            _pread_full(self.fd, [b[:padded]], offset)
            dst[:size] = b[:size]


    def read_run(self, dsts: Sequence[memoryview], offset: int) -> None:
        """Fill every view of ``dsts`` (flat, writable; in direct mode each ALIGN-aligned and a
        whole number of ALIGN bytes long) from consecutive bytes of the file at ``offset``: one
        ``preadv`` for slots that lie back to back (:meth:`can_run` says which views qualify)."""
        _pread_full(self.fd, dsts, offset)

    def can_run(self, dst: memoryview, size: int) -> bool:
        """Whether ``dst[:size]`` may be one view of a :meth:`read_run` (no bounce buffer needed)."""
        return not self.direct or (size % ALIGN == 0 and is_aligned(dst))


def _advance(bufs: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from the buffer list (after a short transfer)."""
    while bufs and n >= bufs[0].nbytes:
        n -= bufs.pop(0).nbytes
    if n:
        bufs[0] = bufs[0][n:]


def _pwrite_full(fd: int, bufs: Sequence[memoryview], offset: int) -> None:
    # One syscall in the common case; the loop only handles short writes (signals, >2 GiB).
    todo = list(bufs)
    total = sum(b.nbytes for b in todo)
    while total:
        n = os.pwritev(fd, todo, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"pwritev wrote nothing at offset {offset}")
        offset += n
        total -= n
        if total:
            _advance(todo, n)


def _pread_full(fd: int, bufs: Sequence[memoryview], offset: int) -> None:
    todo = list(bufs)
    total = sum(b.nbytes for b in todo)
    while total:
        n = os.preadv(fd, todo, offset)
        if n <= 0:
            # The file is preallocated, so end-of-file inside a slot means it was truncated.
            raise OSError(errno.EIO, f"unexpected end of file at offset {offset} (truncated?)")
        offset += n
        total -= n
        if total:
            _advance(todo, n)
