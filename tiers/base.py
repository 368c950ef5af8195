"""The Tier protocol: where payload bytes live.

A tier moves bytes and never decides: which blocks it holds, when they leave and where they go
is the store's business (kvstore.store). A tier only promises:

* ``write(key, src, meta)`` copies ``len(src)`` bytes out of the caller's buffer. When it returns
  the block is readable; with ``durable=True`` on a persistent tier it also survives a crash of
  the process and of the machine. It raises :class:`TierFullError` when there is no room (the
  store then evicts and retries) and :class:`TierIOError` when the device fails; in both cases
  nothing of the block is left behind. Writing a key that is present replaces it.
* ``read_into(key, dst)`` copies the payload into the caller's buffer ``dst`` (at least
  ``meta.size`` bytes, writable) and returns the number of bytes. A persistent tier verifies the
  checksum and raises :class:`CorruptBlockError` on mismatch: corrupt KV is a miss, never a wrong
  answer. A missing key raises :class:`BlockNotFound`.
* ``delete(key)`` frees the block's room; it returns whether the key was present.
* ``contains`` and ``usage`` never write.

Thread safety: every method may be called from several threads at once. A tier never calls back
into the store. Reads never write to disk.

A tier whose payloads lie in one shared-memory segment a same-node process can map may expose it
as an :class:`Arena` (:meth:`Tier.arena`): the store's leases, peeks and reservations point into
it, and the daemon maps it and hands same-node clients a read-only descriptor of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

import numpy as np

from kvstore.block import BlockMeta
from kvstore.buffers import Buffer
from kvstore.buffers import byte_view as byte_view  # re-exported for older imports
from kvstore.clock import Clock
from kvstore.errors import KVStoreError
from kvstore.keys import HASH_BYTES, BlockHash

HASH = np.dtype(f"V{HASH_BYTES}")
"""The dtype of a column of block hashes (16 raw bytes a row)."""
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class BlockColumns:
    """The metadata of many blocks as columns, one row a block: what :meth:`Tier.scan_columns`
    yields, so that a restart reads a million blocks without an object per block. Row ``i`` is
    block ``keys[i]`` with ``BlockMeta(ns[i], parent[i], depth[i], size[i], expiry[i],
    checksum[i], created[i])``. ``keys``, ``ns`` and ``parent`` are :data:`HASH` columns;
    ``depth`` and ``size`` int64, ``expiry`` and ``created`` float64, ``checksum`` uint64 (a
    volatile tier's deferred checksum, -1, reads as 2**64 - 1)."""

    keys: np.ndarray
    ns: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    size: np.ndarray
    expiry: np.ndarray
    created: np.ndarray
    checksum: np.ndarray

    def __len__(self) -> int:
        return int(self.keys.size)

    @classmethod
    def empty(cls) -> BlockColumns:
        h, i, f = np.empty(0, HASH), np.empty(0, np.int64), np.empty(0, np.float64)
        return cls(h, h, h, i, i, f, f, np.empty(0, np.uint64))

    @classmethod
    def from_items(cls, items: Iterable[tuple[bytes, BlockMeta]]) -> BlockColumns:
        """Columns of ``(key, meta)`` pairs, in order (the slow way, for tiers that keep a
        :class:`BlockMeta` per block)."""
        rows = list(items)
        if not rows:
            return cls.empty()
        n = len(rows)
        metas = [m for _, m in rows]

        def col(attr: str, dtype: Any) -> np.ndarray:
            return np.fromiter((getattr(m, attr) for m in metas), dtype, n)

        return cls(
            np.frombuffer(b"".join(bytes(k) for k, _ in rows), HASH),
            np.frombuffer(b"".join(m.ns for m in metas), HASH),
            np.frombuffer(b"".join(m.parent for m in metas), HASH),
            col("depth", np.int64),
            col("size", np.int64),
            col("expiry", np.float64),
            col("created", np.float64),
            np.fromiter((m.checksum & _MASK64 for m in metas), np.uint64, n),
        )

    @classmethod
    def concat(cls, parts: Iterable[BlockColumns]) -> BlockColumns:
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]
        names = cls.__slots__
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in names))

    def take(self, rows: np.ndarray) -> BlockColumns:
        """The rows ``rows`` (indices or a mask), in that order."""
        return BlockColumns(*(getattr(self, f)[rows] for f in self.__slots__))

    def key_list(self) -> list[BlockHash]:
        """The keys as ``bytes`` (what maps and the index are keyed by)."""
        return hash_list(self.keys)

    def items(self) -> Iterator[tuple[BlockHash, BlockMeta]]:
        """``(key, meta)`` per row: the per-block form of :meth:`Tier.scan`."""
        cols = (hash_list(self.ns), hash_list(self.parent), self.depth.tolist(), self.size.tolist(),
                self.expiry.tolist(), self.checksum.tolist(), self.created.tolist())
        for key, *fields in zip(self.key_list(), *cols, strict=True):
            yield key, BlockMeta(*fields)


def hash_list(column: np.ndarray) -> list[BlockHash]:
    """A :data:`HASH` column as a list of 16-byte ``bytes``."""
    raw = np.ascontiguousarray(column).tobytes()
    w = HASH_BYTES
    return cast("list[BlockHash]", [raw[i : i + w] for i in range(0, len(raw), w)])


def hash_groups(column: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct hashes of a :data:`HASH` column: the row of each one's first occurrence,
    and each row's group (an index into the first). Sorted on the hashes' first 8 bytes as
    integers; exact (a column where two hashes share those bytes is sorted as bytes)."""
    halves = np.frombuffer(np.ascontiguousarray(column).tobytes(), np.uint64).reshape(-1, 2)
    _, first, group = np.unique(halves[:, 0], return_index=True, return_inverse=True)
    if (halves[first[group], 1] != halves[:, 1]).any():
        _, first, group = np.unique(column, return_index=True, return_inverse=True)
    return first, group.reshape(-1)


@dataclass(frozen=True, slots=True)
class OfflineScan:
    """What :meth:`Tier.read_offline` found: every block with its metadata, and what else the
    tier can say about itself (``descriptors``: ``{namespace digest: descriptor}`` its data
    carries; counts of damaged or foreign objects; its URL)."""

    blocks: list[tuple[BlockHash, BlockMeta]]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TierUsage:
    used_bytes: int
    capacity_bytes: int
    blocks: int


@runtime_checkable
class Arena(Protocol):
    """The zero-copy surface of a tier whose payloads lie in one shared-memory segment, cut into
    slots at fixed offsets (:class:`tiers.dram.DramTier`). What the store's leases
    (``KVStore.acquire``), peeks (``peek_arena``) and reservations (``KVStore.reserve``) use,
    and what the daemon maps and hands same-node clients (a read-only descriptor, never a name).

    Offsets are the store's to keep valid: a location is good while the store holds the block
    (in use, leased), or, for a :meth:`peek`, until :meth:`freed_since` says one of its slots was
    freed (a slot is never rewritten for another key without being freed first). A reserved slot
    belongs to its reserver until :meth:`publish_slots` enters it or :meth:`free_slots` gives it
    back; no read finds it and no delete frees it in between."""

    @property
    def shm_name(self) -> str:
        """The segment's shared-memory name (no leading slash), for :func:`kvstore.shm.attach_arena`."""
        ...

    def unlink_name(self) -> None:
        """Remove the name from ``/dev/shm``; mappings stay. From then on only a process handed a
        descriptor (:meth:`readonly_fd`) can map the arena."""
        ...

    def readonly_fd(self) -> int:
        """A new read-only descriptor of the segment (the caller closes it)."""
        ...

    def location(self, key: BlockHash) -> tuple[int, int] | None:
        """``(offset, size)`` of ``key``'s payload in the segment, or None."""
        ...

    def locations(self, keys: Sequence[bytes]) -> list[tuple[int, int] | None]:
        """:meth:`location` of every key, under one lock."""
        ...

    def peek(self, keys: Sequence[bytes]) -> tuple[list[tuple[int, int]], int]:
        """``(offset, size)`` of the leading ``keys`` held now, and the free stamp they were seen at."""
        ...

    def freed_since(self, offsets: Iterable[int], stamp: int) -> bool:
        """Whether a slot at one of ``offsets`` was freed after :meth:`peek` gave ``stamp``."""
        ...

    def reserve_slots(self, size: int, count: int) -> list[int]:
        """Up to ``count`` fresh slots (offsets) for ``size``-byte blocks, named by no key."""
        ...

    def slot_view(self, off: int, size: int) -> memoryview:
        """A writable view of a reserved slot."""
        ...

    def publish_slots(self, entries: Mapping[BlockHash, tuple[int, BlockMeta]]) -> None:
        """Enter reserved slots whose payloads are written: ``{key: (offset, meta)}``, in order
        (a mapping the caller may build ahead, while its copies into the slots run)."""
        ...

    def free_slots(self, offsets: Iterable[int]) -> None:
        """Give back reserved slots that were not published."""
        ...


class Tier(ABC):
    """Abstract tier. Subclasses set ``kind``, ``persistent`` and a frozen ``Config`` dataclass."""

    kind: ClassVar[str] = ""
    persistent: ClassVar[bool] = False
    Config: ClassVar[type]
    shared: bool = False
    """Other nodes write to this tier too (a shared bucket): it may hold blocks this node's
    index never saw (the store probes for them on a miss) and the store never deletes its
    blocks as orphans."""

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    def contains(self, key: BlockHash) -> bool: ...

    @abstractmethod
    def read_into(self, key: BlockHash, dst: memoryview) -> int: ...

    @abstractmethod
    def write(self, key: BlockHash, src: Buffer, meta: BlockMeta, *, durable: bool = False) -> None: ...

    @abstractmethod
    def delete(self, key: BlockHash) -> bool: ...

    @abstractmethod
    def usage(self) -> TierUsage: ...

    # ---- derived surface, overridden only for speed or by persistent tiers -------------------

    def fits(self, size: int) -> bool:
        """Whether a block of ``size`` bytes could be written now without evicting anything."""
        u = self.usage()
        return u.capacity_bytes - u.used_bytes >= size

    def size_class(self, size: int) -> int:
        """Blocks of the same class free room for each other (slab tiers override)."""
        return 0

    def meta(self, key: BlockHash) -> BlockMeta | None:
        """The stored metadata of ``key``, or None. Persistent tiers must implement it."""
        return None

    def scan(self) -> Iterator[tuple[BlockHash, BlockMeta]]:
        """Every block held, with its metadata, one pair a block. Tiers that keep a
        :class:`BlockMeta` per block override this; persistent tiers override
        :meth:`scan_columns` instead and answer this from it."""
        return iter(())

    def scan_columns(self) -> Iterator[BlockColumns]:
        """Every block held, with its metadata, as batches of columns: how a restart rebuilds
        the index (:func:`kvstore.store.restart.recover`). The same blocks as :meth:`scan`, in
        the same order; the default builds the columns from it."""
        cols = BlockColumns.from_items(self.scan())
        return iter([cols] if len(cols) else [])

    def register_namespace(self, digest: bytes, descriptor: bytes) -> None:  # noqa: B027
        """Learn a namespace's descriptor (tiers whose objects are self-describing embed it)."""

    def update_expiry(self, items: Iterable[tuple[BlockHash, float]]) -> None:  # noqa: B027
        """Persist refreshed expiry times, batched (the store calls it on flush, not per read)."""

    def read_many(self, keys: Sequence[BlockHash], dsts: Sequence[memoryview]) -> list[int | KVStoreError]:
        """Batched reads; each result is the byte count or the error of that block."""
        out: list[int | KVStoreError] = []
        for k, d in zip(keys, dsts, strict=True):
            try:
                out.append(self.read_into(k, d))
            except KVStoreError as e:
                out.append(e)
        return out

    def write_many(
        self, items: Sequence[tuple[BlockHash, Buffer, BlockMeta]], *, durable: bool = False
    ) -> list[KVStoreError | None]:
        """Batched writes; each result is None or the error :meth:`write` raised for that block."""
        out: list[KVStoreError | None] = []
        for key, src, meta in items:
            try:
                self.write(key, src, meta, durable=durable)
                out.append(None)
            except KVStoreError as e:
                out.append(e)
        return out

    def delete_many(self, keys: Sequence[BlockHash]) -> list[bool | KVStoreError]:
        """Batched deletes (an eviction's victims); each result is what :meth:`delete` returned
        for that key, or the error it raised."""
        out: list[bool | KVStoreError] = []
        for key in keys:
            try:
                out.append(self.delete(key))
            except KVStoreError as e:
                out.append(e)
        return out

    def available(self) -> bool:
        """Whether requests can be made now. False while a remote tier is known to be down (a
        circuit breaker is open): the store skips it, with no request and no timeout, and
        lookups report it. Never blocks."""
        return True

    def namespaces(self) -> dict[bytes, bytes]:
        """``{digest: descriptor}`` of the namespaces the tier's own data describes (a cold
        store learns the namespaces of blocks other stores wrote from here)."""
        return {}

    def probe(self, keys: Sequence[BlockHash]) -> list[BlockMeta]:
        """Metadata of the leading ``keys`` the tier holds, stopping at the first it lacks: a
        bounded look-up by hash for blocks other nodes wrote to a shared tier. A private tier
        has nothing the index does not know: none."""
        return []

    def flush(self) -> None:  # noqa: B027
        """Make every completed write durable."""

    def close(self) -> None:  # noqa: B027
        """Release files, mappings and handles. Idempotent."""

    def arena(self) -> Arena | None:
        """The shared-memory arena this tier's payloads lie in, for zero-copy readers and
        writers (:class:`Arena`); None (the default) when it has none. A wrapper answers for
        the tier it wraps."""
        return None

    @classmethod
    def read_offline(cls, name: str, config: Any, root: Path, clock: Clock) -> OfflineScan | None:
        """What a tier of this kind named ``name`` holds under store ``root``, read without
        writing, locking or deleting anything there (a store directory that no process
        serves, or one a daemon holds: :mod:`kvstore.store.snapshot`). None: this kind cannot be
        read so (a volatile tier's blocks live only inside its process)."""
        return None

    @classmethod
    def holder(cls, name: str, root: Path) -> int | None:
        """The pid of another process that holds a tier of this kind named ``name`` under
        ``root`` open, where the kind can tell (a lock file); None otherwise."""
        return None

    def describe(self) -> dict[str, Any]:
        u = self.usage()
        return {
            "name": self.name,
            "kind": self.kind,
            "persistent": self.persistent,
            "used_bytes": u.used_bytes,
            "capacity_bytes": u.capacity_bytes,
            "blocks": u.blocks,
        }


def tier_dir(root: Path, name: str) -> Path:
    """The directory a tier named ``name`` keeps its files in under the store root."""
    return root / "tiers" / name
