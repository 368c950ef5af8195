"""The in-process store; see :mod:`kvstore.store.core` (the class) and its parts:
:mod:`._read` (read path), :mod:`._placement` (placement, eviction, demotion, expiry),
:mod:`._durable` (durable puts), :mod:`._restart` (warm restart), :mod:`._common` (types).

``Lease`` and ``LookupResult`` live in :mod:`kvstore.api`, the buffer helpers in
:mod:`kvstore.buffers`; they are re-exported here for older imports."""

from kvstore.api import Lease, LookupResult
from kvstore.buffers import dst_views as _dst_views
from kvstore.buffers import src_views as _src_views
from kvstore.store._common import NAMESPACES_FILE, StoreCounters, read_namespaces
from kvstore.store.core import KVStore

__all__ = ["NAMESPACES_FILE", "KVStore", "Lease", "LookupResult", "StoreCounters", "_dst_views", "_src_views", "read_namespaces"]
