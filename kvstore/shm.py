"""Shared-memory arenas: mapping another component's arena by name, or by a descriptor.

A leaf module. The DRAM tier creates arenas and records them here (:func:`own_arena`,
:func:`disown_arena`); a same-node client, the daemon's data plane and the GPU load path map
them with :func:`attach_arena`.

The daemon removes its arena's name from ``/dev/shm`` once it has mapped it, so no process can
open the arena by name; a client it grants shared memory receives a *read-only* descriptor of
it instead (over a Unix socket, :mod:`kvstore.server.fdpass`) and records it here
(:func:`remember_arena`), after which :func:`attach_arena` of that name in the client's
process maps the descriptor, read-only. Staging segments are memfds: they never have a name.
:class:`Segment` is the mapping of such a descriptor (the ``SharedMemory`` surface callers
use: ``buf``, ``size``, ``name``, ``close``).
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

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
        return SharedMemory(name=shm_name, track=False)  # type: ignore[call-arg]
    shm = SharedMemory(name=shm_name)
    if shm_name not in _OWNED:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm
