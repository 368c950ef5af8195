"""Types and helpers shared by the parts of :class:`kvstore.store.KVStore`."""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.errors import (
    BufferSizeError,
    KVStoreError,
    TierIOError,
    UsageError,
)
from kvstore.keys import Namespace
from tiers.base import byte_view

log = logging.getLogger(__name__)

NAMESPACES_FILE = "namespaces.json"


def read_namespaces(root: Path) -> list[tuple[Namespace, float]]:
    """The registered namespaces and their TTLs saved under a store's ``root`` (none if absent)."""
    path = root / NAMESPACES_FILE
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise KVStoreError(f"cannot read {path}: {e}; restore it or remove it to re-register") from e
    return [(Namespace.from_dict(e["namespace"]), float(e["ttl_s"])) for e in entries]


@dataclass(slots=True)
class _NsInfo:
    nid: int
    digest: bytes
    namespace: Namespace | None  # None: seen on a persistent tier, not registered yet
    ttl_s: float


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
    that maps it (``tiers.dram.attach_arena(arena)``); see :meth:`KVStore.acquire`.

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


@dataclass(slots=True)
class StoreCounters:
    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0
    put_blocks: int = 0
    dedup_blocks: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    expirations: int = 0
    corrupt_blocks: int = 0
    tier_errors: int = 0
    orphans_dropped: int = 0
    recovered_blocks: int = 0
    discovered_blocks: int = 0
    """Blocks other nodes wrote to a shared tier, learned by probing past a lookup miss."""
    foreign_blocks: int = 0
    """Blocks of another schema version or layout found on a persistent tier: never served."""
    unavailable_reads: int = 0
    """Reads skipped or failed because a tier was unreachable (the copy is kept)."""
    per_tier_hits: Counter[str] = field(default_factory=Counter)


def _lowest_bit(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


class _Scratch:
    """A page-aligned, reusable buffer for tier-to-tier copies (O_DIRECT wants alignment)."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None

    def view(self, size: int) -> memoryview:
        if self._map is None or len(self._map) < size:
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(-1, max(size, 1 << 20))
        return memoryview(self._map)[:size]

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


# ---- helpers ------------------------------------------------------------------------------------


def _diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            yield from _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            yield f"{prefix}{k}", va, vb


def _as_view(buf: Any, writable: bool) -> memoryview:
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
    mv = _as_view(buf, writable)
    if count is None:
        if len(mv) % bb:
            raise BufferSizeError(
                f"buffer of {len(mv)} bytes is not a whole number of {bb}-byte blocks"
            )
        count = len(mv) // bb
    elif len(mv) != count * bb:
        raise BufferSizeError(f"expected {count} blocks of {bb} bytes ({count * bb} bytes), got {len(mv)}")
    return [mv[i * bb : (i + 1) * bb] for i in range(count)]


def _dst_views(dst: Any, bb: int) -> list[memoryview]:
    if isinstance(dst, list | tuple):
        views = [_as_view(d, True) for d in dst]
        for i, v in enumerate(views):
            if len(v) < bb:
                raise BufferSizeError(f"destination buffer {i} has {len(v)} bytes; a block needs {bb}")
        return views
    return _split(dst, bb, True, None)


def _src_views(blocks: Any, bb: int, count: int) -> list[memoryview]:
    if isinstance(blocks, list | tuple):
        if len(blocks) != count:
            raise UsageError(f"expected {count} block payloads, got {len(blocks)}")
        views = [_as_view(b, False) for b in blocks]
        for i, v in enumerate(views):
            if len(v) != bb:
                raise BufferSizeError(f"payload {i} has {len(v)} bytes; a block of this namespace has {bb}")
        return views
    return _split(blocks, bb, False, count)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise TierIOError(f"cannot write {path}: {e.strerror}; check the store directory") from e
