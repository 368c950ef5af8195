"""put_device: the daemon's own time in a GPU engine's save (PUT_DEVICE), on a fake CUDA runtime.

A vLLM worker saves a request's new blocks with one PUT_DEVICE: the daemon reserves arena slots
(``KVStore.reserve``), DMAs the blocks out of the engine's GPU memory into them, then commits
(``Reservation.commit``, usage, the KV event pump, the reply). This benchmark runs a real daemon
(``ThreadedDaemon``, this process) with a fake CUDA runtime whose copies are host ``memmove``s
and whose stream stays busy for ``DMA_S_PER_BLOCK`` a block after them (a 2 MiB block at ~50
GB/s), drives PUT_DEVICEs of 256 and 2,048 new blocks through the real client
(``Client.put_device``), and reads the daemon's phases from ``kvstore_put_device_seconds``:
``reserve`` (request parsed to copies issued) and ``commit`` (copies landed to the reply's turn
on the event loop). Small blocks: the cost is per block, not per byte.

Figures: the median reserve and commit over the puts of a run (ms), with the daemon's event log
on (the daemon's default) and off. Baseline, same run: the in-process store's
``KVStore.reserve`` and ``Reservation.commit`` of as many new blocks, with
``Reservation.prepare`` and the same wait between them (both run during the DMA in the daemon).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import re
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.client import connect
from kvstore.config import StoreConfig, TierSpec
from kvstore.events import EventsConfig
from kvstore.keys import KVLayout, LayerGroup, Namespace
from kvstore.server.config import Limits, ServerConfig
from kvstore.server.daemon import ThreadedDaemon
from kvstore.server.devcopy import POLL_FIRST_S, POLL_MAX_S
from kvstore.store import KVStore
from tools.bench._common import result

NS = Namespace("bench/put-device", KVLayout("bfloat16", 64, (LayerGroup("full", 1, 1, 8),)))
"""64-token blocks of 2 KiB: the per-block costs, not the bytes."""
DMA_S_PER_BLOCK = 40e-6
"""How long the fake stream stays busy per block copied: a 2 MiB block over ~50 GB/s."""
HANDLE, EVENT = b"H" * 64, b"E" * 64
_NOT_READY = 600


class FakeCudart:
    """libcudart as ``kvstore.server.devcopy.CudaRuntime`` calls it, in one process: an IPC
    memory handle names a host buffer of this process (:meth:`export`), a copy is a ``memmove``
    per row, and a stream answers ``cudaErrorNotReady`` until ``dma_s_per_block`` a block copied
    has passed since its copies were queued (the wait polls, as on a GPU, while other threads
    run). Events are complete when opened (the engine's gather has finished)."""

    def __init__(self, dma_s_per_block: float = DMA_S_PER_BLOCK) -> None:
        self.dma_s_per_block = dma_s_per_block
        self._lock = threading.Lock()
        self._memory: dict[bytes, int] = {}
        self._busy: dict[int, float] = {}
        self._next = 0x1000
        ok: Callable[..., int] = lambda *_a: 0  # noqa: E731
        for name in ("cudaSetDevice", "cudaIpcCloseMemHandle", "cudaHostRegister", "cudaHostUnregister",
                     "cudaStreamWaitEvent", "cudaEventDestroy", "cudaStreamDestroy", "cudaGetLastError"):
            setattr(self, name, _Fn(ok))
        self.cudaGetDeviceCount = _Fn(self._count)
        self.cudaIpcOpenMemHandle = _Fn(lambda out, h, _f: self._out(out, self._memory[bytes(h)]))
        self.cudaIpcOpenEventHandle = _Fn(lambda out, _h: self._out(out, self._new()))
        self.cudaStreamCreateWithFlags = _Fn(lambda out, _f: self._out(out, self._new()))
        self.cudaMemcpy2DAsync = _Fn(self._copy)
        self.cudaStreamQuery = _Fn(lambda s: _NOT_READY if time.perf_counter() < self._busy.get(s, 0.0) else 0)

    def export(self, handle: bytes, buf: bytearray) -> None:
        """``handle`` names ``buf`` (the engine's "device" buffer)."""
        self._memory[handle] = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))

    @staticmethod
    def _count(out: Any) -> int:
        out._obj.value = 1
        return 0

    @staticmethod
    def _out(out: Any, value: int) -> int:
        out._obj.value = value
        return 0

    def _new(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def _copy(self, dst: int, dpitch: int, src: int, spitch: int, width: int, rows: int, _kind: int,
              stream: int) -> int:
        for r in range(rows):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        now = time.perf_counter()
        self._busy[stream] = max(now, self._busy.get(stream, 0.0)) + rows * self.dma_s_per_block
        return 0


class _Fn:
    """A callable that takes the ``argtypes`` / ``restype`` CudaRuntime sets."""

    def __init__(self, impl: Callable[..., int]) -> None:
        self.impl = impl
        self.argtypes: Any = None
        self.restype: Any = None

    def __call__(self, *args: Any) -> int:
        return self.impl(*args)


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    puts = 5 if args.quick else 15
    sizes = (256,) if args.quick else (256, 2048)
    for events in (True, False):
        for blocks in sizes:
            yield from _measure(blocks, puts, events)


def _tiers(blocks: int, puts: int) -> tuple[TierSpec, ...]:
    room = max(64 << 20, 2 * (puts + 2) * blocks * NS.block_bytes)
    return (TierSpec("dram", "dram", {"capacity_bytes": f"{room}B", "slab_bytes": "16MiB"}),)


def _chains(blocks: int, count: int, seed: int) -> list[list[bytes]]:
    rng = np.random.default_rng(seed)
    return [[rng.bytes(16) for _ in range(blocks)] for _ in range(count)]


def _phases(url: str) -> dict[str, float]:
    """The sums of ``kvstore_put_device_seconds`` by phase."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'^kvstore_put_device_seconds_sum\{phase="(\w+)"\} (\S+)$',
                                                   text, re.M)}


def daemon_phases(blocks: int, puts: int, events: bool, root: Path,
                  lib: FakeCudart | None = None) -> list[dict[str, float]]:
    """Each PUT_DEVICE's phases (ms by phase) through a threaded daemon on ``lib``, ``puts`` puts
    of ``blocks`` new blocks each after one untimed put."""
    from kvstore.server import devcopy

    lib = lib or FakeCudart()
    load = devcopy.load_runtime
    devcopy.load_runtime = lambda: (devcopy.CudaRuntime(lib), "")  # type: ignore[arg-type]  # the fake stands for libcudart
    store_cfg = StoreConfig(root=root, tiers=_tiers(blocks, puts), policy="lru", persist_on_close=False,
                            events=EventsConfig(enabled=events))
    cfg = ServerConfig(http_port=0, data_port=0, ucx_port=0,
                       limits=Limits(max_blocks=max(blocks, 4096), max_payload_bytes=1 << 30))
    out: list[dict[str, float]] = []
    try:
        with ThreadedDaemon(store_cfg, cfg) as d, connect(d.url) as c:
            assert c.plane == "shm" and c.info.get("put_device"), c.info.get("put_device_unavailable")
            c.register_namespace(NS)
            buf = bytearray(np.random.default_rng(1).integers(0, 256, blocks * NS.block_bytes, np.uint8).tobytes())
            lib.export(HANDLE, buf)
            gc.collect()
            gc.freeze()  # as the daemon's own process does after its start (daemon.freeze_startup_objects)
            for i, chain in enumerate(_chains(blocks, puts + 1, blocks)):
                before = _phases(d.url)
                assert c.put_device(NS, chain, device=0, handle=HANDLE, offset=0, size=len(buf), after=EVENT) == blocks
                after = _phases(d.url)
                if i:
                    out.append({k: 1e3 * (after[k] - before.get(k, 0.0)) for k in after})
    finally:
        devcopy.load_runtime = load
        gc.unfreeze()
    return out


def _dma(seconds: float) -> None:
    """Wait ``seconds`` as ``DeviceCopier`` waits for its DMAs: polling, first after 50 µs,
    then every 0.1 ms (a commit after a wait runs on a cooler core and cache than one right
    after its reservation: the baseline waits as the daemon does)."""
    end, pause = time.perf_counter() + seconds, POLL_FIRST_S
    while time.perf_counter() < end:
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)


def store_phases(blocks: int, puts: int, root: Path, dma_s_per_block: float = DMA_S_PER_BLOCK) -> list[dict[str, float]]:
    """The same puts in process: ``KVStore.reserve``, ``prepare``, the DMA's wait, ``commit``
    (ms each, the wait apart)."""
    out: list[dict[str, float]] = []
    with KVStore(StoreConfig(root=root, tiers=_tiers(blocks, puts), policy="lru", persist_on_close=False)) as s:
        s.register_namespace(NS)
        for i, chain in enumerate(_chains(blocks, puts + 1, blocks)):
            t0 = time.perf_counter()
            res = s.reserve(NS, chain)
            t1 = time.perf_counter()
            res.prepare()
            tp = time.perf_counter()
            _dma(blocks * dma_s_per_block)
            t2 = time.perf_counter()
            assert res.commit() == blocks
            t3 = time.perf_counter()
            if i:
                out.append({"reserve": 1e3 * (t1 - t0), "prepare": 1e3 * (tp - t1), "commit": 1e3 * (t3 - t2)})
    return out


def _med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _spread(rows: list[dict[str, float]], key: str) -> list[float]:
    return [round(min(r[key] for r in rows), 3), round(max(r[key] for r in rows), 3)]


def _measure(blocks: int, puts: int, events: bool) -> Iterator[dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-put-device-"))
    try:
        base = store_phases(blocks, puts, tmp / "store")
        daemon = daemon_phases(blocks, puts, events, tmp / "daemon")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log = "events" if events else "no_events"
    for phase in ("reserve", "commit"):
        extra: dict[str, Any] = {"baseline_prepare_ms": round(_med(base, "prepare"), 3)} if phase == "commit" else {
            "queue_ms": round(_med(daemon, "queue"), 3), "wait_ms": round(_med(daemon, "wait"), 3)}
        yield result("put_device", f"{phase}_{blocks}_blocks_{log}", _med(daemon, phase), "ms", _med(base, phase),
                     puts=puts, spread_ms=_spread(daemon, phase), baseline_spread_ms=_spread(base, phase), **extra)
