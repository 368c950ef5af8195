"""Types and helpers shared by the parts of :class:`kvstore.store.KVStore`."""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.api import Lease as Lease  # moved to kvstore.api; re-exported for the store's parts
from kvstore.api import LookupResult as LookupResult
from kvstore.api import field_diffs as _diff  # noqa: F401 (the store's parts import it from here)
from kvstore.buffers import dst_views, src_views
from kvstore.errors import (
    KVStoreError,
    TierIOError,
)
from kvstore.keys import Namespace

log = logging.getLogger(__name__)

# The buffer helpers moved to kvstore.buffers; the old private names stay for the store's parts.
_dst_views = dst_views
_src_views = src_views

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
