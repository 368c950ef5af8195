"""Block metadata: the record every persistent tier stores beside a payload.

It carries what a restart needs to rebuild the index without any other state: the namespace,
the parent hash (prefix structure), depth, size, expiry and the payload checksum.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import xxhash

from kvstore.errors import CorruptBlockError
from kvstore.keys import HASH_BYTES, BlockHash

_META = struct.Struct("<16s16sIQddQ")


def payload_checksum(data: memoryview | bytes | bytearray) -> int:
    """xxh3-64 of a payload; verified on every read from a persistent tier."""
    return xxhash.xxh3_64_intdigest(data)


CHECKSUM_DEFERRED = -1
"""``BlockMeta.checksum`` of a put's block until a copy goes to a persistent tier: volatile tiers
never verify checksums, so a put computes none (hashing every payload cost a third of an
in-process put); the store computes it from the payload when it writes the first persistent
copy (``Placer.write_copy``). It cannot be packed (``pack`` raises), so it never reaches a disk."""


@dataclass(frozen=True, slots=True)
class BlockMeta:
    ns: bytes
    """Root digest of the block's namespace."""
    parent: bytes
    """Hash of the previous block; the namespace root for depth 0."""
    depth: int
    """0-based position of the block in its prefix chain."""
    size: int
    """Payload bytes."""
    expiry: float
    """Wall-clock time after which the block may be dropped."""
    checksum: int
    created: float

    PACKED_SIZE = _META.size
    FORMAT = _META.format
    """The struct format of :meth:`pack`: ns, parent, depth, size, expiry, created, checksum."""

    def __post_init__(self) -> None:
        if len(self.ns) != HASH_BYTES or len(self.parent) != HASH_BYTES:
            raise ValueError("BlockMeta.ns and .parent must be 16-byte hashes")

    def pack(self) -> bytes:
        if self.checksum == CHECKSUM_DEFERRED:
            raise ValueError("BlockMeta.pack: the checksum was deferred; compute it (with_checksum) first")
        return _META.pack(
            self.ns, self.parent, self.depth, self.size, self.expiry, self.created, self.checksum
        )

    @classmethod
    def unpack(cls, buf: bytes | memoryview, key: BlockHash | None = None) -> BlockMeta:
        try:
            ns, parent, depth, size, expiry, created, checksum = _META.unpack_from(buf)
        except struct.error as e:
            raise CorruptBlockError(
                f"block metadata{' of ' + key.hex() if key else ''} is truncated: {e}"
            ) from e
        return cls(ns, parent, depth, size, expiry, checksum, created)

    @classmethod
    def of_chain(
        cls, ns: bytes, parents: Sequence[bytes], depth0: int, size: int, expiry: float,
        checksums: Sequence[int], created: float,
    ) -> list[BlockMeta]:
        """The records of consecutive blocks of one chain: block ``i`` has parent
        ``parents[i]``, depth ``depth0 + i`` and checksum ``checksums[i]``. The same as a
        ``BlockMeta(...)`` each, checked once for the chain (a put builds one per block)."""
        if len(ns) != HASH_BYTES or not set(map(len, parents)) <= {HASH_BYTES}:
            raise ValueError("BlockMeta.ns and .parent must be 16-byte hashes")
        new = object.__new__
        s_ns, s_parent, s_depth, s_size, s_expiry, s_checksum, s_created = _SETTERS
        out = []
        for depth, (parent, checksum) in enumerate(zip(parents, checksums, strict=True), depth0):
            m = new(cls)
            s_ns(m, ns)
            s_parent(m, parent)
            s_depth(m, depth)
            s_size(m, size)
            s_expiry(m, expiry)
            s_checksum(m, checksum)
            s_created(m, created)
            out.append(m)
        return out

    def with_expiry(self, expiry: float) -> BlockMeta:
        return replace(self, expiry=expiry)

    def with_checksum(self, checksum: int) -> BlockMeta:
        return replace(self, checksum=checksum)


_SETTERS = tuple(BlockMeta.__dict__[f.name].__set__ for f in fields(BlockMeta))
"""The slots' own setters, in field order: :meth:`BlockMeta.of_chain` fills a record without
the frozen class's ``__setattr__`` (which refuses) or its ``__init__``."""
