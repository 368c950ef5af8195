"""The in-process store; see :mod:`kvstore.store.core` (the class) and its parts:
:mod:`._read` (read path), :mod:`._placement` (placement, eviction, demotion, expiry),
:mod:`._durable` (durable puts), :mod:`._restart` (warm restart), :mod:`._common` (types)."""

from kvstore.store._common import (
    NAMESPACES_FILE,
    Lease,
    LookupResult,
    StoreCounters,
    _dst_views,
    _src_views,
    read_namespaces,
)
from kvstore.store.core import KVStore

__all__ = ["NAMESPACES_FILE", "KVStore", "Lease", "LookupResult", "StoreCounters", "_dst_views", "_src_views", "read_namespaces"]
