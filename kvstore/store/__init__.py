"""The in-process store: :class:`KVStore` (:mod:`.core`, the public facade) over its parts,
:mod:`.ledger` (who holds which copy), :mod:`.placer` (placement, room, demotion, expiry),
:mod:`.loads` and :mod:`.puts` (load and store plans, and the reserve/commit put:
:mod:`.reservation`), :mod:`.namespaces` and :mod:`.restart`.

``Lease`` and ``LookupResult`` live in :mod:`kvstore.api`, the buffer helpers in
:mod:`kvstore.buffers`; they are re-exported here for older imports."""

from kvstore.api import Lease, LookupResult
from kvstore.buffers import dst_views as _dst_views
from kvstore.buffers import src_views as _src_views
from kvstore.store._common import atomic_write
from kvstore.store.core import KVStore
from kvstore.store.ledger import StoreCounters
from kvstore.store.namespaces import NAMESPACES_FILE, read_namespaces
from kvstore.store.reservation import Reservation

__all__ = ["NAMESPACES_FILE", "KVStore", "atomic_write", "Lease", "LookupResult", "StoreCounters", "_dst_views", "_src_views", "read_namespaces", "Reservation"]
