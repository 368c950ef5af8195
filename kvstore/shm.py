"""Shared-memory arenas: mapping another component's arena by name, or by a descriptor.

A leaf module. The DRAM tier creates arenas and records them here (:func:`own_arena`,
:func:`disown_arena`); a same-node client, the daemon's data plane and the GPU load path map
them with :func:`attach_arena`.

The daemon removes its arena's name from ``/dev/shm`` once it has mapped it, so no process can
open the arena by name; a client it grants shared memory receives a *read-only* descriptor of
it instead (over a Unix socket, :mod:`kvstore.wire.fdpass`) and records it here
(:func:`remember_arena`), after which :func:`attach_arena` of that name in the client's
process maps the descriptor, read-only. Staging segments are memfds: they never have a name.
:class:`Segment` is the mapping of such a descriptor (the ``SharedMemory`` surface callers
use: ``buf``, ``size``, ``name``, ``close``).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import numpy as np

# Segments created by this process. attach_arena() must not unregister these from the resource
# tracker: in-process the tracker entry is shared with the creator, and removing it twice makes
# the tracker print a KeyError traceback when the creator unlinks.
_OWNED: set[str] = set()


def own_arena(shm_name: str) -> None:
    """Record that this process created the segment ``shm_name`` (and will unlink it)."""
    _OWNED.add(shm_name)


def disown_arena(shm_name: str) -> None:
    """Forget ``shm_name`` once its creator has unlinked it."""
    _OWNED.discard(shm_name)


class Segment:
    """A shared mapping of the file descriptor ``fd`` (which it owns and closes): read-only
    unless ``writable``. ``buf`` is read-only too when the mapping is."""

    def __init__(self, fd: int, *, writable: bool, name: str = "") -> None:
        self._fd = fd
        self.name = name
        self.size = os.fstat(fd).st_size
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(fd, self.size, access=access)
        except BaseException:
            os.close(fd)
            raise
        self._buf: memoryview | None = memoryview(self._mmap)

    @property
    def buf(self) -> memoryview:
        if self._buf is None:
            raise ValueError(f"segment {self.name!r} is closed")
        return self._buf

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Unmap and close; BufferError (nothing closed) while a view of ``buf`` is alive."""
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        if self._mmap is not None:
            self._mmap.close()  # BufferError while a view exists: the caller retries later
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close_fd(self) -> None:
        """Close the descriptor, keeping the mapping (once handed over, nobody needs it here)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def forget(self) -> None:
        """Drop the mapping without unmapping (at exit, when a view may still be alive)."""
        self._buf = self._mmap = None


def memfd_segment(size: int, name: str) -> Segment:
    """A writable anonymous shared segment of ``size`` bytes: no name anywhere, so only a process
    handed its descriptor can map it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return Segment(fd, writable=True, name=name)


def reopen_readonly(fd: int) -> int:
    """A new, read-only descriptor of the file ``fd`` refers to (what a client is handed: it
    can map it for reading only, and a process of another user cannot reopen it writable)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


_RECEIVED: dict[str, int] = {}
_RECEIVED_LOCK = threading.Lock()


def remember_arena(shm_name: str, fd: int) -> None:
    """Record a descriptor of arena ``shm_name`` handed to this process (kept open for the
    process's life; a later one for the same name replaces it)."""
    with _RECEIVED_LOCK:
        old = _RECEIVED.get(shm_name)
        _RECEIVED[shm_name] = fd
    if old is not None and old != fd:
        os.close(old)


def attach_arena(shm_name: str) -> SharedMemory | Segment:
    """Map another tier's arena, for a same-node client; the caller closes it.

    An arena whose descriptor this process was handed (:func:`remember_arena`) is mapped from
    it, read-only. Otherwise by name: the client never unlinks the segment (the owning tier
    does). Python < 3.13 registers every attached segment with the resource tracker, which would
    *unlink it* when the client exits and warn about a leak; the registration is undone here (or
    never made, on 3.13+).
    """
    with _RECEIVED_LOCK:
        fd = _RECEIVED.get(shm_name)
        if fd is not None:
            fd = os.dup(fd)
    if fd is not None:
        return Segment(fd, writable=False, name=shm_name)
    if sys.version_info >= (3, 13):
        return SharedMemory(name=shm_name, track=False)  # type: ignore[call-arg]  # track: 3.13+
    shm = SharedMemory(name=shm_name)
    if shm_name not in _OWNED:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # CPython private
    return shm


# madvise(2) advice values (Linux >= 5.14); Python 3.11's mmap module does not name them.
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
PREFAULT_CHUNK = 32 * 1024 * 1024
"""Bytes faulted in per madvise call: small enough that :meth:`Prefault.stop` returns quickly,
large enough that the calls cost nothing."""

_libc: ctypes.CDLL | None = None


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]  # not in typeshed
    """libc's madvise through ctypes, which releases the GIL during the call (mmap.madvise
    holds it: a background populate would stall every other thread); None off Linux."""
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


class Prefault:
    """Fault in every page of a mapping ahead of use, in a background thread.

    A fresh tmpfs arena has no page mapped: the first write to each 4 KiB page takes a page
    fault that also zeroes it (and, in a VM, may fault on the host too), so a store's first
    rounds ran at a fraction of memcpy speed. ``madvise(MADV_POPULATE_WRITE)`` (or ``_READ`` for
    a read-only mapping) maps the pages in the kernel in large batches, several times faster
    than taking the faults one by one, and off the store's path. It never changes a byte, so
    it may run while the owner already writes to the mapping. Kernels before 5.14 lack the
    advice: the thread then reads one byte of each page (a read fault maps a shmem page as
    well). The thread holds an export of ``buf``, so :meth:`stop` must run before the mapping
    is closed.
    """

    def __init__(self, buf: memoryview, *, write: bool, name: str = "kvstore-prefault") -> None:
        self._arr: np.ndarray | None = np.frombuffer(buf, np.uint8)
        self._advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
        self._stop = threading.Event()
        self.done = threading.Event()
        """Set once every page was faulted in (or the thread stopped)."""
        self.faulted_bytes = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        arr = self._arr
        assert arr is not None
        try:
            madvise = _madvise()
            addr, size = arr.ctypes.data, arr.size
            for off in range(0, size, PREFAULT_CHUNK):
                if self._stop.is_set():
                    return
                n = min(PREFAULT_CHUNK, size - off)
                if madvise is None or madvise(addr + off, n, self._advice) != 0:
                    if madvise is not None and ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS):
                        return  # EFAULT/ENOMEM: the pages cannot be backed; a write reports it
                    madvise = None  # no such advice here: touch the pages instead
                    int(arr[off : off + n : mmap.PAGESIZE].sum())
                self.faulted_bytes = off + n
        finally:
            self._arr = None  # the export goes with the thread
            self.done.set()

    def stop(self) -> None:
        """Stop early and wait for the thread (at most one chunk's madvise). Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
