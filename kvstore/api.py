"""The store's public result types, shared by the in-process store and the daemon client.

A leaf module: it imports nothing of the store, so engines, the daemon and the client can use
these types without pulling in the store core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How many leading blocks of a prompt are cached, and in which tier each one is."""

    num_blocks: int
    block_tokens: int
    tiers: tuple[str, ...]
    """Fastest tier holding each cached block."""
    unavailable: tuple[str, ...] = ()
    """Tiers that cannot be reached now (a remote store is down): blocks held only there are
    not counted, so the engine recomputes them instead of waiting on a timeout."""

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_tokens


@dataclass(slots=True, eq=False)
class Lease:
    """Leading cached blocks held in the shared-memory arena of the first tier for a reader
    that maps it (``kvstore.shm.attach_arena(arena)``); see :meth:`KVStore.acquire`.

    Block ``i`` is at ``locations[i] = (offset, size)`` of the arena. While the lease is held the
    blocks are *in use*: they neither move nor leave, so their bytes stay put. Give it back with
    :meth:`KVStore.release` (a second release is a no-op).
    """

    arena: str
    locations: tuple[tuple[int, int], ...]
    _ids: np.ndarray = field(repr=False)
    _released: bool = field(default=False, repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.locations)
