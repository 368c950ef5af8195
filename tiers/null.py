"""The null tier: a tier's bookkeeping without its bytes, for trace replay.

It keeps ``key -> BlockMeta`` and enforces a capacity in blocks and/or bytes, so that the store's
own placement, promotion, demotion, expiry and eviction run unchanged on it (``tools/replay``
drives a real :class:`~kvstore.store.KVStore` over null tiers), but it stores no payload: a write
checks the source's size and keeps nothing of it, and a read checks the destination's size and
writes nothing into it. Only a replay, which never looks at the bytes, may use it.

Not persistent; ``meta``/``scan`` work so that the store's metadata paths stay exercised.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.block import BlockMeta
from kvstore.buffers import Buffer, byte_view
from kvstore.clock import Clock, system_clock
from kvstore.errors import (
    BlockNotFound,
    BufferSizeError,
    ConfigError,
    KVStoreError,
    TierFullError,
    TierIOError,
)
from kvstore.keys import BlockHash
from tiers.base import Tier, TierUsage


@dataclass(frozen=True, slots=True)
class NullConfig:
    """A tier that keeps metadata only (for replays); at least one bound must be set, so that a
    replay never measures an unbounded tier by mistake."""

    capacity_blocks: int = 0
    """Blocks the tier holds at most (0: no bound on blocks)."""
    capacity_bytes: int = 0
    """Bytes the tier holds at most (0: no bound on bytes)."""

    def __post_init__(self) -> None:
        for field in ("capacity_blocks", "capacity_bytes"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"null tier {field} must be a whole number >= 0, got {v!r}")
        if not self.capacity_blocks and not self.capacity_bytes:
            raise ConfigError("null tier needs capacity_blocks or capacity_bytes (or both)")


class NullTier(Tier):
    """Metadata-only tier; see the module docstring for what it does not do."""

    kind = "null"
    persistent = False
    Config = NullConfig

    def __init__(
        self, name: str, config: NullConfig, *, root: Path | None = None, clock: Clock = system_clock
    ) -> None:
        super().__init__(name)
        self.config = config
        self._max_blocks = config.capacity_blocks or (1 << 62)
        self._max_bytes = config.capacity_bytes or (1 << 62)
        self._map: dict[BlockHash, BlockMeta] = {}
        self._used = 0
        self._closed = False
        self._lock = threading.Lock()

    def contains(self, key: BlockHash) -> bool:
        return key in self._map

    def read_into(self, key: BlockHash, dst: memoryview) -> int:
        meta = self._map.get(key)
        if meta is None:
            raise BlockNotFound(f"block {key.hex()} is not in tier {self.name!r}")
        n = byte_view(dst, writable=True).nbytes
        if n < meta.size:
            raise BufferSizeError(f"dst has {n} bytes; block {key.hex()} needs {meta.size}")
        return meta.size

    def read_many(self, keys: Sequence[BlockHash], dsts: Sequence[memoryview]) -> list[int | KVStoreError]:
        """:meth:`read_into` of each key, in one call (a replay's hit prefix)."""
        out: list[int | KVStoreError] = []
        get = self._map.get
        for key, dst in zip(keys, dsts, strict=True):
            meta = get(key)
            if meta is None:
                out.append(BlockNotFound(f"block {key.hex()} is not in tier {self.name!r}"))
                continue
            if type(dst) is memoryview and dst.c_contiguous and not dst.readonly:
                n = dst.nbytes
            else:
                try:
                    n = byte_view(dst, writable=True).nbytes
                except KVStoreError as e:  # (a read-only or strided buffer)
                    out.append(e)
                    continue
            if n < meta.size:  # (as the default read_many reports read_into's error)
                out.append(BufferSizeError(f"dst has {n} bytes; block {key.hex()} needs {meta.size}"))
                continue
            out.append(meta.size)
        return out

    def write(self, key: BlockHash, src: Buffer, meta: BlockMeta, *, durable: bool = False) -> None:
        n = byte_view(src).nbytes
        if n != meta.size:
            raise BufferSizeError(f"src has {n} bytes but meta.size says {meta.size}")
        with self._lock:
            if self._closed:
                raise TierIOError(f"null tier {self.name!r} is closed")
            old = self._map.get(key)
            used = self._used - (old.size if old is not None else 0) + n
            count = len(self._map) + (old is None)
            if count > self._max_blocks or used > self._max_bytes:
                raise TierFullError(f"null tier {self.name!r} is full (block {key.hex()})")
            self._map[key] = meta
            self._used = used

    def write_many(
        self, items: Sequence[tuple[BlockHash, Buffer, BlockMeta]], *, durable: bool = False
    ) -> list[KVStoreError | None]:
        """:meth:`write` of each item under one lock (a replay's put writes its chain at once)."""
        out: list[KVStoreError | None] = []
        with self._lock:
            if self._closed:
                raise TierIOError(f"null tier {self.name!r} is closed")
            blocks, used, limit_blocks, limit_bytes, m = len(self._map), self._used, self._max_blocks, self._max_bytes, self._map
            for key, src, meta in items:
                # (a flat view's size without re-viewing it: the put passes slices of one buffer)
                n = src.nbytes if type(src) is memoryview and src.c_contiguous else byte_view(src).nbytes
                if n != meta.size:
                    out.append(BufferSizeError(f"src has {n} bytes but meta.size says {meta.size}"))
                    continue
                old = m.get(key)
                grown = used - (old.size if old is not None else 0) + n
                count = blocks + (old is None)
                if count > limit_blocks or grown > limit_bytes:
                    out.append(TierFullError(f"null tier {self.name!r} is full (block {key.hex()})"))
                    continue
                m[key] = meta
                used, blocks = grown, count
                out.append(None)
            self._used = used
        return out

    def delete(self, key: BlockHash) -> bool:
        with self._lock:
            meta = self._map.pop(key, None)
            if meta is None:
                return False
            self._used -= meta.size
            return True

    def delete_many(self, keys: Sequence[BlockHash]) -> list[bool | KVStoreError]:
        """:meth:`delete` of each key under one lock."""
        out: list[bool | KVStoreError] = []
        with self._lock:
            pop, freed = self._map.pop, 0
            for key in keys:
                meta = pop(key, None)
                if meta is not None:
                    freed += meta.size
                out.append(meta is not None)
            self._used -= freed
        return out

    def usage(self) -> TierUsage:
        cap = self.config.capacity_bytes
        if not cap:
            # A block-bounded tier reports its bytes at the size of the blocks it holds.
            avg = self._used // len(self._map) if self._map else 0
            cap = self._max_blocks * avg
        return TierUsage(self._used, cap, len(self._map))

    def fits(self, size: int) -> bool:
        return len(self._map) < self._max_blocks and self._used + size <= self._max_bytes

    def meta(self, key: BlockHash) -> BlockMeta | None:
        return self._map.get(key)

    def scan(self) -> Iterator[tuple[BlockHash, BlockMeta]]:
        with self._lock:
            return iter(list(self._map.items()))

    def update_expiry(self, items: Iterable[tuple[BlockHash, float]]) -> None:
        with self._lock:
            for key, expiry in items:
                meta = self._map.get(key)
                if meta is not None:
                    self._map[key] = meta.with_expiry(expiry)

    def close(self) -> None:
        with self._lock:
            self._map.clear()
            self._used = 0
            self._closed = True

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(capacity_blocks=self.config.capacity_blocks)
        return d
