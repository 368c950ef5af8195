"""Blocks between the store's host memory and an engine's paged KV cache on its device.

The one fast path that the vLLM connector (``engine.vllm.worker``) and the benchmarks
(``tools.bench peers --device cuda``) use; the reference engines reach the same DMAs through
:mod:`engine.gpu`.

**Restore** (:class:`PagedLoader`): the blocks lie on the host where the store keeps them, a lease
on a shared-memory arena (:class:`engine.gpu.ArenaBlocks`: the arena mapped read-only and
``cudaHostRegister``-ed once per process) or a pinned buffer a remote plane filled
(:class:`engine.gpu.HostBlocks`). They are copied to the device in *tiles* (a range of blocks
times a range of layers) by DMA on the loader's copy stream, one ``cudaMemcpy2DAsync`` per run of
equally spaced blocks, into a bounded device staging ring; each tile is scattered into the pages
on the loader's scatter stream as soon as it lands, and a tile waits (on the device) for the
scatter that last read its slot, in this load or the one before. Every layer gets the CUDA event of its last
tile's scatter: a layer-wise load makes the forward stream wait on that layer's event only. No
host copy, no pageable memory, no host wait until the caller asks for one.

**Save** (:class:`PagedSaver`): the pages are gathered into device staging on the caller's
stream, in stream order with the forward pass that wrote them (a few gather kernels; nothing
waits on the host), then copied to the host in pieces on the saver's copy stream, each piece
straight into the memory the store takes it from (a daemon connection's staging segment,
registered with CUDA once, or a pinned buffer for a remote plane), while the store ingests the
piece before it.

On the CPU (vLLM's CPU build) there is no link: a restore scatters straight from the host rows
and a save gathers straight into host memory, on the saver thread where the engine fences its
page writes (:class:`DeferredGather`: vLLM's ``handle_preemptions``, before a step touches a page).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

MiB = 1 << 20
PIECE_BYTES = 128 * MiB
"""Bytes of one tile of a restore (or one piece of a save) at most: large enough that a 32K-token
restore of an 8B model is 32 tiles (host time to queue them, ~2 ms, hides under the DMAs), small
enough that the first scatter starts early."""
READY_EVENTS = 4
"""Interprocess events a :class:`PagedSaver` records its gathers with (``StagedSave.ready``)."""
STAGE_BYTES = 512 * MiB
"""Device staging of a restore: a ring of ``STAGE_BYTES // PIECE_BYTES`` tiles."""
TAIL_PARTS = 4
"""A restore of this many tiles or more has its last tile cut into this many parts, each half the
one before (the last two equal: 1/2, 1/4, 1/8, 1/8): the scatter left after the last DMA lands,
the restore's tail, is then that of an eighth of a tile (a 128 MiB tile's took 0.38-0.42 ms of
device time on an H100)."""


class PagedTarget(Protocol):
    """An engine's paged KV cache as blocks in the store's format (``engine.vllm.pages.PagedKV``)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def page_bytes(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...

    def block_ids(self, block_ids: Sequence[int]) -> torch.Tensor: ...

    def scatter_layer(self, layer: int, block_ids: torch.Tensor, src: torch.Tensor) -> None: ...

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None: ...


class BlockSource(Protocol):
    """Blocks on the host (``engine.gpu.ArenaBlocks``, ``engine.gpu.HostBlocks``)."""

    @property
    def num_blocks(self) -> int: ...

    def copy_into(self, dst: torch.Tensor, lo: int, hi: int, first: int = 0, stream: Any = None) -> int: ...

    def layer_rows(self, first: int, count: int, layer: int, page_bytes: int) -> torch.Tensor: ...


def tiles(n: int, num_layers: int, page_bytes: int, piece_bytes: int = PIECE_BYTES,
          layer_group: int = 0, tail_parts: int = TAIL_PARTS) -> list[tuple[int, int, int, int]]:
    """The tiles ``(first block, end block, first layer, end layer)`` of a restore of ``n``
    blocks, layer group by layer group (``layer_group`` layers each; 0: all layers at once, whole
    blocks), each group cut into block ranges of ``piece_bytes`` at most (one block at least);
    the last tile cut into up to ``tail_parts`` shrinking parts (:data:`TAIL_PARTS`) where the
    plan has ``tail_parts`` tiles or more (the tiles before it give the host time to queue the
    parts' launches while the DMAs run)."""
    if n <= 0:
        return []
    group = num_layers if layer_group <= 0 else min(layer_group, num_layers)
    out: list[tuple[int, int, int, int]] = []
    for lo in range(0, num_layers, group):
        hi = min(lo + group, num_layers)
        step = max(1, piece_bytes // ((hi - lo) * page_bytes))
        out.extend((a, min(a + step, n), lo, hi) for a in range(0, n, step))
    if len(out) < tail_parts:  # a short restore: each part's launches (a layer's kernel each
        return out              # without engine.pagecopy) would come after the DMAs, not under them
    a, b, lo, hi = out.pop()
    for _ in range(tail_parts - 1):  # the last tile in shrinking parts, while a part has a block
        if b - a < 2:
            break
        k = (b - a) // 2
        out.append((a, a + k, lo, hi))
        a += k
    out.append((a, b, lo, hi))
    return out


def scatter_each_layer(target: PagedTarget, lo: int, hi: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Layers ``lo..hi-1`` of ``rows`` (``[n, (hi - lo) * page_bytes]``, any row stride) into
    pages ``ids``, one :meth:`PagedTarget.scatter_layer` a layer."""
    pb = target.page_bytes
    for layer in range(lo, hi):
        off = (layer - lo) * pb
        target.scatter_layer(layer, ids, rows[:, off : off + pb])


@dataclass
class DeviceLoad:
    """A restore queued on the device: the event after which each layer's pages hold the blocks
    (None on the CPU, where they do once :meth:`PagedLoader.load` returns)."""

    layer_events: list[Any]
    done: Any = None
    tiles: list[tuple[Any, Any, Any]] = field(default_factory=list)
    """With :attr:`PagedLoader.timing`: each tile's (DMA queued, landed, scattered) timing events."""

    def tile_ms(self) -> list[tuple[float, float]]:
        """Each tile's landing and scatter end, in ms since the first DMA began (after
        :meth:`synchronize`; empty without :attr:`PagedLoader.timing`)."""
        if not self.tiles:
            return []
        t0 = self.tiles[0][0]
        return [(t0.elapsed_time(a), t0.elapsed_time(b)) for _, a, b in self.tiles]

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (default the current one) wait on the device for layer ``layer``."""
        ev = self.layer_events[layer]
        if ev is not None:
            (stream or torch.cuda.current_stream()).wait_event(ev)

    def wait_all(self, stream: Any = None) -> None:
        if self.done is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.done)

    def ready(self) -> bool:
        return self.done is None or bool(self.done.query())

    def synchronize(self) -> None:
        """Wait on the host until every copy and scatter of this load is done (before its source
        is given back)."""
        if self.done is not None:
            self.done.synchronize()


class PagedLoader:
    """Restores blocks into a device's pages (see the module docstring). One per engine worker;
    one load at a time (its staging ring and streams are its own): callers serialize loads
    (the connector's loader thread does)."""

    def __init__(self, device: torch.device, *, piece_bytes: int = PIECE_BYTES,
                 stage_bytes: int = STAGE_BYTES, tail_parts: int | None = None) -> None:
        if piece_bytes <= 0 or stage_bytes < piece_bytes:
            raise ValueError(f"a restore needs 0 < piece_bytes <= stage_bytes, got {piece_bytes}, {stage_bytes}")
        tail_parts = TAIL_PARTS if tail_parts is None else tail_parts  # (read here: a bench may set it)
        if tail_parts < 1:
            raise ValueError(f"a restore's last tile is cut into 1 part at least, got tail_parts={tail_parts}")
        self.device = torch.device(device)
        self.piece_bytes = piece_bytes
        self.stage_bytes = stage_bytes
        self.tail_parts = tail_parts
        self._cuda = self.device.type == "cuda"
        self._copy: Any = torch.cuda.Stream(self.device) if self._cuda else None
        self._scatter: Any = torch.cuda.Stream(self.device) if self._cuda else None
        nslots = max(1, stage_bytes // piece_bytes)
        self._slots: list[torch.Tensor | None] = [None] * nslots
        """The staging ring: one device buffer per slot, allocated (and grown) on first use."""
        self._freed: list[Any] = [None] * nslots
        """Each slot's last scatter (the CUDA event after which it may be written again)."""
        self._next = 0
        """The ring's next slot: it goes on across loads, so a load queued right after another
        (the connector's chunks of one request) needs no wait for the other's last scatter."""
        self._held: list[Callable[[], None]] = []
        """Scatters of tiles whose DMA is queued, not yet queued themselves (the next tile's DMA
        goes first); a ``hold_last`` load leaves its last for the next load or :meth:`flush`."""
        self.timing = False
        """Record timing events per tile (:attr:`DeviceLoad.tiles`): benchmarks."""

    def _slot(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """The ring's next slot, ``nbytes`` at least, and its index; the copy stream waits (on
        the device) for the scatter that last read it."""
        s = self._next
        self._next = (s + 1) % len(self._slots)
        buf = self._slots[s]
        if buf is None or buf.numel() < nbytes:
            if buf is not None:  # the allocator keeps it until the scatters queued on it are done
                buf.record_stream(self._scatter)
            buf = self._slots[s] = None
            with torch.cuda.stream(self._copy):  # the copy stream's own memory: no race with
                # kernels still queued on the engine's stream over memory it has just freed;
                # a whole piece at least, so a small first tile does not make it grow later
                size = max(nbytes, self.piece_bytes)
                buf = self._slots[s] = torch.empty(size, dtype=torch.uint8, device=self.device)
        if self._freed[s] is not None:
            self._copy.wait_event(self._freed[s])
        return buf, s

    def load(self, src: BlockSource, target: PagedTarget, ids: Sequence[int], *, layer_group: int = 0,
             after: Any = None, on_layers: Callable[[int, int, Any], None] | None = None,
             first: int = 0, cancelled: Callable[[], bool] | None = None, hold_last: bool = False) -> DeviceLoad:
        """Queue the restore of blocks ``first .. first+len(ids)-1`` of ``src`` into pages ``ids``
        of ``target``; returns at once on a GPU (the copies and scatters are queued). ``after``:
        a CUDA event the scatters wait for (the engine's stream when the pages were handed out:
        kernels still reading a page's previous contents). ``on_layers(lo, hi, event)`` is called
        as soon as layers ``lo..hi-1`` are queued, with the CUDA event after which they hold the
        blocks (None on the CPU), so a waiter on another thread can make its stream wait on it.
        ``cancelled()``, asked before each tile (each layer on the CPU), stops the queueing: the
        layers not yet queued are never written. ``hold_last``: the last tile's scatters are
        queued only after the next load's first DMA (or by :meth:`flush`), so that the copy
        engine does not idle while the host queues them (a load in chunks: the connector's
        leases); the returned load's events are complete only then."""
        n, num_layers, pb = len(ids), target.num_layers, target.page_bytes
        if n == 0:
            return DeviceLoad([None] * num_layers)
        plan = tiles(n, num_layers, pb, max(self.piece_bytes, target.block_bytes), layer_group, self.tail_parts)
        if not self._cuda:
            return self._load_host(src, target, ids, first, on_layers, cancelled)
        copy, scat = self._copy, self._scatter
        if after is not None:
            scat.wait_event(after)
        with torch.cuda.stream(copy):
            # One small copy on the copy stream, ahead of the tiles' DMAs: on the scatter stream
            # it queued behind them in the copy engine (and every scatter with it) until the
            # ring's last queued tile had landed.
            idx = target.block_ids(list(ids))
        idx.record_stream(scat)
        out = DeviceLoad([None] * num_layers)

        def scatter(a: int, b: int, lo: int, hi: int, dst: torch.Tensor, s: int, landed: Any, began: Any) -> None:
            scat.wait_event(landed)
            with torch.cuda.stream(scat):
                many = getattr(target, "scatter_layers", None)  # every layer at once (engine.pagecopy)
                if many is not None:
                    many(lo, hi, idx[a:b], dst)
                else:
                    scatter_each_layer(target, lo, hi, idx[a:b], dst)
                done = torch.cuda.Event(enable_timing=self.timing)
                done.record(scat)
            self._freed[s] = out.done = done
            if began is not None:
                out.tiles.append((began, landed, done))
            if b == n:  # the group's last tile: its layers are ready after this scatter
                for layer in range(lo, hi):
                    out.layer_events[layer] = done
                if on_layers is not None:
                    on_layers(lo, hi, done)

        # The next tile's DMA is queued before this tile's scatters (a layer's kernel launch
        # each, ~0.8 ms of host time for 32 layers: the copy engine would idle behind them).
        # A slot is written only once the scatter that last read it is queued: with one
        # slot, no tile runs ahead.
        ahead = 1 if len(self._slots) > 1 else 0
        for a, b, lo, hi in plan:
            if cancelled is not None and cancelled():
                break
            width = (hi - lo) * pb
            buf, s = self._slot((b - a) * width)
            dst = buf[: (b - a) * width].view(b - a, width)
            began = None
            if self.timing:
                began = torch.cuda.Event(enable_timing=True)
                began.record(copy)
            src.copy_into(dst, lo * pb, hi * pb, first=first + a, stream=copy)
            landed = torch.cuda.Event(enable_timing=self.timing)
            landed.record(copy)
            self._held.append(lambda t=(a, b, lo, hi, dst, s, landed, began): scatter(*t))
            while len(self._held) > ahead:
                self._held.pop(0)()
        if not (hold_last and ahead):
            self.flush()
        return out

    def flush(self) -> None:
        """Queue the scatters a ``hold_last`` load left (call before waiting on its events)."""
        while self._held:
            self._held.pop(0)()

    @staticmethod
    def _load_host(src: BlockSource, target: PagedTarget, ids: Sequence[int], first: int,
                   on_layers: Callable[[int, int, Any], None] | None,
                   cancelled: Callable[[], bool] | None) -> DeviceLoad:
        idx = target.block_ids(ids)
        n, pb = len(ids), target.page_bytes
        for layer in range(target.num_layers):
            if cancelled is not None and cancelled():
                break
            target.scatter_layer(layer, idx, src.layer_rows(first, n, layer, pb))
            if on_layers is not None:
                on_layers(layer, layer + 1, None)
        return DeviceLoad([None] * target.num_layers)


class ConcatSource:
    """Several sources as one (the requests of one step: one load of all their blocks)."""

    def __init__(self, parts: Sequence[tuple[BlockSource, int]]) -> None:
        self.parts = [(src, n) for src, n in parts if n > 0]
        self.num_blocks = sum(n for _, n in self.parts)

    def _split(self, first: int, count: int) -> list[tuple[BlockSource, int, int, int]]:
        """(source, its first block, count, row in the caller's range) covering ``first..``."""
        out, at = [], 0
        for src, n in self.parts:
            lo, hi = max(first, at), min(first + count, at + n)
            if lo < hi:
                out.append((src, lo - at, hi - lo, lo - first))
            at += n
        return out

    def copy_into(self, dst: torch.Tensor, lo: int, hi: int, first: int = 0, stream: Any = None) -> int:
        calls = 0
        for src, f, c, row in self._split(first, dst.shape[0]):
            calls += src.copy_into(dst[row : row + c], lo, hi, first=f, stream=stream)
        return calls

    def layer_rows(self, first: int, count: int, layer: int, page_bytes: int) -> torch.Tensor:
        rows = [src.layer_rows(f, c, layer, page_bytes) for src, f, c, _ in self._split(first, count)]
        return rows[0] if len(rows) == 1 else torch.cat(rows)


@dataclass
class StagedSave:
    """Pages gathered into device staging (``[n, block_bytes]``), ready once ``ready`` fires."""

    rows: torch.Tensor
    ready: Any = None

    @property
    def num_blocks(self) -> int:
        return int(self.rows.shape[0])


class DeferredGather:
    """A save's gather on the CPU, off the engine's step: the saver thread runs it (:meth:`run`),
    or the engine's fence does (:meth:`settle`: before the engine next writes pages) if the saver
    has not begun it. Whichever comes first gathers; the other waits for it (a copy of the pages,
    never a store call) and takes its result."""

    def __init__(self, saver: PagedSaver, target: PagedTarget, ids: Sequence[int]) -> None:
        self._saver, self._target, self._ids = saver, target, list(ids)
        self._lock = threading.Lock()
        self._out: StagedSave | None = None
        self._error: BaseException | None = None

    @property
    def num_blocks(self) -> int:
        return len(self._ids)

    def run(self) -> StagedSave:
        """The gathered pages (gathers them if nobody has); raises what the gather raised."""
        with self._lock:
            if self._out is None and self._error is None:
                try:
                    self._out = self._saver.stage(self._target, self._ids)
                except Exception as e:  # noqa: BLE001 - kept for the saver thread, which reports it
                    self._error = e
            if self._error is not None:
                raise self._error
            assert self._out is not None
            return self._out

    def settle(self) -> None:
        """Gathered (or failed: the saver thread reports it when it takes the save) once this returns."""
        with contextlib.suppress(Exception):
            self.run()


class PagedSaver:
    """Saves pages to the host (see the module docstring): :meth:`stage` on the engine's thread
    (gather kernels on its stream, no host wait), :meth:`drain` on a saver thread."""

    def __init__(self, device: torch.device, *, piece_bytes: int = PIECE_BYTES) -> None:
        if piece_bytes <= 0:
            raise ValueError(f"a save's piece must be > 0 bytes, got {piece_bytes}")
        self.device = torch.device(device)
        self.piece_bytes = piece_bytes
        self._cuda = self.device.type == "cuda"
        self._copy: Any = torch.cuda.Stream(self.device) if self._cuda else None
        self._events: list[Any] = []
        """Interprocess CUDA events (a daemon's PUT_DEVICE may wait for one), used in turn."""
        self._next_event = 0

    def _ready_event(self) -> Any:
        """The next of :data:`READY_EVENTS` interprocess events, each used in turn: a consumer
        that waits for one after it was recorded again waits for a later gather on the same
        stream, which is later still."""
        if len(self._events) < READY_EVENTS:
            self._events.append(torch.cuda.Event(interprocess=True))
        ev = self._events[self._next_event % READY_EVENTS]
        self._next_event += 1
        return ev

    def stage(self, target: PagedTarget, ids: Sequence[int]) -> StagedSave:
        """Gather pages ``ids`` of every layer into a new ``[n, block_bytes]`` tensor on the
        device, on the current stream (after the kernels that wrote them); raises
        ``torch.OutOfMemoryError`` when the staging does not fit (the caller drops the save)."""
        rows = torch.empty((len(ids), target.block_bytes), dtype=torch.uint8, device=self.device)
        target.gather(ids, rows)
        if not self._cuda:
            return StagedSave(rows)
        ev = self._ready_event()
        ev.record(torch.cuda.current_stream(self.device))
        return StagedSave(rows, ev)

    def defer(self, target: PagedTarget, ids: Sequence[int]) -> DeferredGather:
        """:meth:`stage` of pages ``ids`` later, on another thread (the CPU: a gather there is a
        copy on the caller's thread, not a kernel queued on a stream); the caller settles it
        before the pages may be written again."""
        return DeferredGather(self, target, ids)

    def pieces(self, n: int, block_bytes: int, room: int) -> list[tuple[int, int]]:
        """Block ranges of a drain of ``n`` blocks into a host buffer of ``room`` bytes: each of
        ``piece_bytes`` at most and of half the room at most (two alternate), one block at least."""
        per = max(1, min(self.piece_bytes, room // 2 if room >= 2 * block_bytes else room) // block_bytes)
        return [(a, min(a + per, n)) for a in range(0, n, per)]

    def drain(self, staged: StagedSave, host: torch.Tensor,
              put: Callable[[int, int, int], None]) -> None:
        """Copy ``staged`` to the host buffer ``host`` (1-D uint8, registered or pinned) in pieces,
        the two halves in turn, and call ``put(a, b, offset)`` for blocks ``a..b-1`` once they
        have landed at byte ``offset`` of ``host``: the next piece's copy runs while ``put``
        stores this one. ``host`` must hold one block at least."""
        rows, n = staged.rows, staged.num_blocks
        bb = int(rows.shape[1]) if n else 0
        if n == 0:
            return
        if host.numel() < bb:
            raise ValueError(f"a host buffer of {host.numel()} bytes cannot hold a {bb}-byte block")
        pieces = self.pieces(n, bb, host.numel())
        half = (pieces[0][1] - pieces[0][0]) * bb
        two = len(pieces) > 1 and host.numel() >= 2 * half  # the two halves in turn
        if not self._cuda:
            for k, (a, b) in enumerate(pieces):
                off = (k % 2) * half if two else 0
                host[off : off + (b - a) * bb].view(b - a, bb).copy_(rows[a:b])
                put(a, b, off)
            return
        copy = self._copy
        landed: list[Any] = []

        def queue(k: int) -> None:
            a, b = pieces[k]
            off = (k % 2) * half if two else 0
            with torch.cuda.stream(copy):
                if k == 0 and staged.ready is not None:
                    copy.wait_event(staged.ready)
                host[off : off + (b - a) * bb].view(b - a, bb).copy_(rows[a:b], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(copy)
            landed.append((ev, off))

        queue(0)
        for k, (a, b) in enumerate(pieces):
            if two and k + 1 < len(pieces):
                queue(k + 1)  # into the other half, whose put has returned
            ev, off = landed[k]
            ev.synchronize()
            put(a, b, off)
            if not two and k + 1 < len(pieces):
                queue(k + 1)
        rows.record_stream(copy)  # the caching allocator keeps it until the copies are done
