"""The HBM tier: a device page pool on torch.

One preallocated ``uint8`` tensor on the accelerator (CUDA when present; any torch device name
works through the same calls, e.g. Ascend's ``npu``; the CPU device in tests) carved by the slab
allocator. Device-side consumers (an engine's attention kernels) can use a block in place through
:meth:`HbmTier.view` with no copy at all.

Host copies run on the tier's own streams: reads (the store's demotion path, HBM -> DRAM) copy
device-to-host on a dedicated stream into a pinned bounce buffer and wait for that stream's
event only, never for the device, so the engine's compute stream is not stalled; writes copy
host-to-device on another stream. Not persistent.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.block import BlockMeta
from kvstore.buffers import Buffer, byte_view
from kvstore.clock import Clock, system_clock
from kvstore.errors import BlockNotFound, BufferSizeError, ConfigError, TierFullError, TierIOError
from kvstore.keys import BlockHash
from tiers._slab import SlabAllocator, SlabMap
from tiers.base import Tier, TierUsage


@dataclass(frozen=True, slots=True)
class HbmConfig:
    capacity_bytes: int
    """GPU memory the tier may hold (rounded down to whole slabs), e.g. ``"40GiB"``."""
    slab_bytes: int = 64 << 20
    """The allocator's unit; must hold the largest block."""
    device: str = ""
    """torch device name; empty: ``cuda`` when available, else ``cpu``."""

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ConfigError("hbm capacity_bytes must be positive, e.g. '40GiB'")
        if self.device:
            try:
                torch.device(self.device)
            except RuntimeError as e:
                raise ConfigError(f"hbm device {self.device!r} is not a torch device name: {e}") from None


def _readonly_tensor(data: memoryview) -> torch.Tensor:
    """A uint8 tensor over a (possibly read-only) host buffer, without a copy; only read from."""
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # torch warns that it cannot mark the tensor read-only; this tensor is a copy source only.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


class _Streams:
    """Per-device copy streams; no-ops on devices without streams (the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None


class HbmTier(Tier):
    kind = "hbm"
    persistent = False
    Config = HbmConfig

    def __init__(self, name: str, config: HbmConfig, *, root: Path, clock: Clock = system_clock) -> None:
        super().__init__(name)
        self.config = config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._alloc = SlabAllocator(config.capacity_bytes, config.slab_bytes)
        try:
            self._pool = torch.empty(self._alloc.capacity_bytes, dtype=torch.uint8, device=self.device)
        except (RuntimeError, torch.OutOfMemoryError) as e:
            raise TierIOError(
                f"hbm tier {name!r}: cannot allocate {config.capacity_bytes} bytes on {self.device}: {e}; "
                "lower capacity_bytes"
            ) from e
        self._streams = _Streams(self.device)
        self._map: dict[bytes, tuple[int, BlockMeta]] = {}
        self._lock = threading.Lock()
        self._slots = SlabMap(self._lock, self._map, self._alloc)
        self._local = threading.local()
        self._closed = False

    # ---- device-side access ---------------------------------------------------------------

    def view(self, key: BlockHash) -> torch.Tensor:
        """The block's bytes in device memory, in place (valid until it is deleted)."""
        with self._lock:
            entry = self._map.get(key)
        if entry is None:
            raise BlockNotFound(key.hex())
        off, meta = entry
        return self._pool[off : off + meta.size]

    def reserve(self, key: BlockHash, meta: BlockMeta) -> torch.Tensor:
        """A slot for ``key``, returned as its device bytes for the caller to fill in place (a
        device-to-device copy on the caller's stream, which orders later reads after it).
        :class:`TierFullError` when no slot of its class is free."""
        with self._lock:
            self._check_open()
            old = self._map.pop(key, None)
            if old is not None:
                self._alloc.free(old[0])
            off = self._alloc.alloc(meta.size)
            if off is None:
                raise TierFullError(f"hbm tier {self.name!r} has no free slot for {meta.size} bytes")
            self._map[key] = (off, meta)
        return self._pool[off : off + meta.size]

    def offsets(self, keys: list[BlockHash]) -> list[int]:
        """Byte offsets of the blocks in :attr:`pool` (for one gather over many blocks)."""
        with self._lock:
            try:
                return [self._map[k][0] for k in keys]
            except KeyError as e:
                raise BlockNotFound(bytes(e.args[0]).hex()) from None

    @property
    def pool(self) -> torch.Tensor:
        """The whole page pool (uint8, on :attr:`device`)."""
        return self._pool

    # ---- Tier -----------------------------------------------------------------------------

    def contains(self, key: BlockHash) -> bool:
        return key in self._map

    def meta(self, key: BlockHash) -> BlockMeta | None:
        entry = self._map.get(key)
        return entry[1] if entry else None

    def delete(self, key: BlockHash) -> bool:
        return self._slots.delete(key)

    def usage(self) -> TierUsage:
        return self._slots.usage()

    def fits(self, size: int) -> bool:
        return self._slots.fits(size)

    def size_class(self, size: int) -> int:
        return self._slots.size_class(size)

    def read_into(self, key: BlockHash, dst: memoryview) -> int:
        out = byte_view(dst, writable=True)
        with self._lock:
            self._check_open()
            entry = self._map.get(key)
        if entry is None:
            raise BlockNotFound(key.hex())
        off, meta = entry
        if len(out) < meta.size:
            raise BufferSizeError(f"destination has {len(out)} bytes; block {key.hex()} has {meta.size}")
        host = torch.frombuffer(out, dtype=torch.uint8, count=meta.size)
        src = self._pool[off : off + meta.size]
        if self._streams.cuda:
            bounce = self._bounce(meta.size)
            with torch.cuda.stream(self._streams.d2h):
                bounce.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
            ev.synchronize()  # this stream's copy only; compute keeps running
            host.copy_(bounce)
        else:
            host.copy_(src)
        return meta.size

    def write(self, key: BlockHash, src: Buffer, meta: BlockMeta, *, durable: bool = False) -> None:
        data = byte_view(src)
        if len(data) != meta.size:
            raise BufferSizeError(f"payload has {len(data)} bytes, meta says {meta.size}")
        dst = self.reserve(key, meta)
        host = _readonly_tensor(data)
        if self._streams.cuda:
            bounce = self._bounce(meta.size)
            bounce.copy_(host)
            with torch.cuda.stream(self._streams.h2d):
                dst.copy_(bounce, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
            ev.synchronize()  # the caller may reuse src, and the bounce buffer is reused
        else:
            dst.copy_(host)

    def scan(self) -> Iterator[tuple[BlockHash, BlockMeta]]:
        with self._lock:
            items = [(BlockHash(k), m) for k, (_, m) in self._map.items()]
        return iter(items)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._map.clear()
            self._pool = torch.empty(0, dtype=torch.uint8, device=self.device)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["device"] = str(self.device)
        return d

    # ---- helpers --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TierIOError(f"hbm tier {self.name!r} is closed")

    def _bounce(self, size: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < size:
            buf = torch.empty(max(size, 1 << 20), dtype=torch.uint8, pin_memory=True)
            self._local.buf = buf
        return buf[:size]
