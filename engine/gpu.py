"""Host-to-device loads straight from the store's shared-memory DRAM arena.

The arena is mapped once per process and registered with the CUDA driver
(``cudaHostRegister``), so a cached block is copied from where it lies in the arena to the
device with one asynchronous DMA: no CPU gather, no staging copy on the host. Blocks are held by
a store lease (:meth:`kvstore.store.KVStore.acquire`) until the copies that read them complete.

Copies go in block order on one stream per direction; callers split a block into layer groups
(:meth:`ArenaBlocks.copy_range`) to load layer-wise, and record events instead of synchronizing.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from tiers.dram import attach_arena

_ARENAS: dict[str, tuple[Any, torch.Tensor]] = {}
_LOCK = threading.Lock()


def arena_tensor(name: str) -> torch.Tensor:
    """The whole arena ``name`` as a host uint8 tensor, page-locked when CUDA is present."""
    with _LOCK:
        hit = _ARENAS.get(name)
        if hit is not None:
            return hit[1]
        shm = attach_arena(name)
        host = torch.frombuffer(shm.buf, dtype=torch.uint8)
        if torch.cuda.is_available():
            err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of arena {name} ({host.numel()} bytes) failed: {err}")
        _ARENAS[name] = (shm, host)
        return host


class ArenaBlocks:
    """The leading cached blocks of a prompt, held in the arena by a lease."""

    def __init__(self, store: Any, lease: Any) -> None:
        self._store = store
        self.lease = lease
        self.host = arena_tensor(lease.arena) if lease.num_blocks else torch.empty(0, dtype=torch.uint8)

    @property
    def num_blocks(self) -> int:
        return int(self.lease.num_blocks)

    def block(self, i: int) -> torch.Tensor:
        off, size = self.lease.locations[i]
        return self.host[off : off + size]

    def copy_range(self, dst: torch.Tensor, lo: int, hi: int) -> None:
        """Bytes ``lo:hi`` of every block into ``dst[i, lo:hi]`` (asynchronous on the current
        stream): one DMA per block from its place in the arena."""
        for i, (off, _) in enumerate(self.lease.locations):
            dst[i, lo:hi].copy_(self.host[off + lo : off + hi], non_blocking=True)

    def release(self) -> None:
        """Give the lease back; call only after the copies that read the blocks completed."""
        self._store.release(self.lease)


class HostBlocks:
    """Blocks already copied into a caller buffer (``[n, block_bytes]`` uint8, pinned when CUDA
    is present): the path for stores without leases (a remote daemon over TCP)."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])

    def block(self, i: int) -> torch.Tensor:
        return self.blocks[i]

    def copy_range(self, dst: torch.Tensor, lo: int, hi: int) -> None:
        for i in range(self.num_blocks):
            dst[i, lo:hi].copy_(self.blocks[i, lo:hi], non_blocking=True)

    def release(self) -> None:
        pass
