"""Shared-memory arenas: mapping another component's arena by name.

A leaf module. The DRAM tier creates arenas and records them here (:func:`own_arena`,
:func:`disown_arena`); a same-node client, the daemon's data plane and the GPU load path map
them with :func:`attach_arena`.
"""

from __future__ import annotations

import sys
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


def attach_arena(shm_name: str) -> SharedMemory:
    """Map another tier's arena by name, for a same-node client; the caller closes it.

    The client never unlinks the segment (the owning tier does). Python < 3.13 registers every
    attached segment with the resource tracker, which would *unlink it* when the client exits and
    warn about a leak; the registration is undone here (or never made, on 3.13+).
    """
    if sys.version_info >= (3, 13):
        return SharedMemory(name=shm_name, track=False)  # type: ignore[call-arg]
    shm = SharedMemory(name=shm_name)
    if shm_name not in _OWNED:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm
