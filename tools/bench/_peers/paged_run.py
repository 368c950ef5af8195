"""The drivers of the paged peer bench (``tools/bench/_peers/paged.py`` holds the stores and
the cache): each store opened, warmed up and timed at every prefix length, one store after another
or all together in turn (``paired``), and the rows with their same-run baselines."""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tools.bench._common import result
from tools.bench._peers.base import PeerUnavailable
from tools.bench._peers.paged import (
    BLOCK,
    GOALS,
    PEERS,
    SAVE_TRIALS,
    SIZES,
    SLAB,
    WARM_TOKENS,
    Cache,
    KvstoreConnector,
    KvstoreConnectorHnd,
    KvstoreConnectorLayerwise,
    KvstorePaged,
    LmcacheNhd,
    LmcachePaged,
    label,
    page_spec,
    sync,
)

STORES: dict[str, Callable[[], Any]] = {"kvstore-connector": KvstoreConnector,
                                        "kvstore-connector-hnd": KvstoreConnectorHnd,
                                        "kvstore-connector-lw": KvstoreConnectorLayerwise,
                                        "kvstore": KvstorePaged, "lmcache": LmcachePaged, "lmcache-nhd": LmcacheNhd}


def _warm(s: Any, cache: Cache, tokens: int) -> None:
    """One untimed save and restore of a short prefix of its own, once a store is open: what
    runs the first time (kernels loaded, streams and events made, pools touched) stays out of the
    one timed save of each size. Its blocks stay cached, apart from every timed prefix."""
    src, dst = cache.blocks(tokens)
    # (an odd seed: a timed prefix's is its length, a multiple of the block)
    prompt = np.random.default_rng(tokens + 1).integers(0, 128_000, tokens, dtype=np.int64)
    s.save(prompt, src)
    s.restore(prompt, dst)
    sync(cache.device)
    if hasattr(s, "phases"):
        s.phases = {}


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def _failure(metric: str, peer: str, tokens: int, e: BaseException) -> dict[str, Any]:
    status = "unavailable" if isinstance(e, PeerUnavailable) else "failed"
    return {"bench": "peers", "metric": f"{metric}_{status}", "peer": peer, "tokens": tokens, "device": "",
            "status": status, "error": f"{type(e).__name__}: {e}",
            **({} if status == "unavailable" else {"traceback": traceback.format_exc()[-2000:]})}


def save_trials(tokens: int) -> int:
    """Saves timed per store at ``tokens`` (each of another prompt: a second save of a cached
    prefix stores nothing): ``SAVE_TRIALS`` up to 8K tokens, one past it."""
    return SAVE_TRIALS if tokens <= 8192 else 1


def run(device: str = "cuda", sizes: tuple[int, ...] = SIZES, layers: int = 32, trials: int = 0,
        only: tuple[str, ...] = PEERS, scratch: str = ".", log: Callable[[str], None] = print,
        copy_threads: int = 0, paired: bool = False, piece_bytes: int = 0,
        page_kernel: bool = False) -> Iterator[dict[str, Any]]:
    """Every row of the paged bench; a store that cannot open or fails gives a status row and
    the others go on. One store after another (each opened, run at every size and closed before
    the next, so no two pools are held at once), or with ``paired`` all open at once and driven
    in turn, save by save and restore by restore (each round in another order), so that every
    store sees the same moments of the machine. ``copy_threads``: kvstore's DRAM tier's (0: its
    default). ``piece_bytes``: kvstore's rows' restore tile and save piece (0: the connector's
    default)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("peers --device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                         "use --device cpu for the smoke path")
    spec = page_spec(layers)
    tb = spec.block_bytes // BLOCK  # bytes a token
    held = sum(t * (save_trials(t) + 1) for t in sizes) + WARM_TOKENS  # (+1: each size's untimed save)
    capacity = -(-(held * tb + 2 * SLAB) // SLAB) * SLAB
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    caches: dict[str, Cache] = {}
    figures: dict[tuple[str, int, str], float] = {}

    def opened(name: str) -> Any:
        s = STORES[name]()
        if hasattr(s, "copy_threads"):
            s.copy_threads = copy_threads
        if piece_bytes and hasattr(s, "piece_bytes"):
            s.piece_bytes = piece_bytes
        if hasattr(s, "page_kernel"):
            s.page_kernel = page_kernel
        t0 = time.perf_counter()
        if s.layout not in caches:
            caches[s.layout] = Cache(spec, max(sizes), dev, layout=s.layout, one_launch=page_kernel)
        s.open(caches[s.layout], capacity, scratch)
        s.prepare(max(sizes))
        _warm(s, caches[s.layout], min(WARM_TOKENS, *sizes))
        log(f"{name}: open and warm-up in {time.perf_counter() - t0:.2f} s")
        return s

    def k(tokens: int) -> int:
        return trials or (5 if tokens <= 8192 else 3)

    stores: list[Any] = []
    try:
        for name in only:
            try:
                s = opened(name)
            except Exception as e:  # noqa: BLE001 - reported as the peer's row, the others go on
                yield {**_failure(f"{name}_paged_open", name, 0, e), "device": where}
                continue
            if paired:
                stores.append(s)
                continue
            try:
                for tokens in sizes:
                    yield from _SizeRun(s, caches[s.layout], tokens, k(tokens), where).run(figures, log)
            finally:
                with contextlib.suppress(Exception):
                    s.close()
        if paired and stores:
            log(f"every store open: free memory by NUMA node {_numa_free_gib()} GiB")
            for tokens in sizes:
                yield from _paired([_SizeRun(s, caches[s.layout], tokens, k(tokens), where, paired=True)
                                    for s in stores], figures, log)
    finally:
        for s in stores:
            with contextlib.suppress(Exception):
                s.close()
        _BASELINE.clear()
    connectors = ("kvstore-connector", "kvstore-connector-hnd", "kvstore-connector-lw")
    for tokens in sizes:
        for conn in connectors:  # the connector against the bench's own store path, same run
            for op in ("restore", "save"):
                a, b = figures.get((conn, tokens, op)), figures.get(("kvstore", tokens, op))
                if a and b:
                    yield result("peers", f"{conn}_vs_kvstore_paged_{label(tokens)}_{op}", a, "GB/s", b,
                                 goal_ratio=0.95 if conn != "kvstore-connector-lw" else None, tokens=tokens,
                                 device=where, paired=paired)
        for kv in (*connectors, "kvstore"):
            for peer in ("lmcache", "lmcache-nhd"):
                for op, goal in (("restore", GOALS["lmcache"]), ("save", 1.0)):
                    a, b = figures.get((kv, tokens, op)), figures.get((peer, tokens, op))
                    if a and b:
                        yield result("peers", f"{kv}_vs_{peer}_paged_{label(tokens)}_{op}", a, "GB/s", b,
                                     goal_ratio=(1.2 if op == "save" else goal) if kv == "kvstore-connector" else (goal if kv == "kvstore" else None), tokens=tokens, device=where,
                                     paired=paired)


def _paired(runs: list[_SizeRun], figures: dict[tuple[str, int, str], float],
            log: Callable[[str], None]) -> Iterator[dict[str, Any]]:
    """Every store's saves, then its restores, in turn: round ``i`` starts at store ``i`` (mod
    the stores), so that no store is always first after the others' work."""
    live = [r for r in runs if r.start(log)]
    order = lambda i: live[i % len(live):] + live[: i % len(live)]  # noqa: E731
    for j in range(max((r.saves for r in live), default=0)):
        for r in order(j):
            r.save_once(j, log)
    for i in range(max((r.trials for r in live), default=0) + 1):
        for r in order(i):
            r.restore_once(i, log)
    for r in runs:
        yield from r.rows(figures, log)


def _numa_free_gib() -> dict[str, float]:
    """Free memory of each NUMA node (``/sys/devices/system/node``): whether the stores' pinned
    pools all fit on one node (a pool on the far node reads slower over the link)."""
    out: dict[str, float] = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        with contextlib.suppress(OSError):
            for line in (node / "meminfo").read_text().splitlines():
                if "MemFree:" in line:
                    out[node.name] = round(int(line.split()[-2]) / 2**20, 1)
    return out


_BASELINE: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
"""The baseline copy's pinned host and device buffers of each size, shared by the stores (with
``paired`` all are open at once: a buffer each was 4 GiB of pinned memory per store at 32K)."""


def _baseline_buffers(nbytes: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (nbytes, str(dev))
    if key not in _BASELINE:
        _BASELINE[key] = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda"),
                          torch.empty(nbytes, dtype=torch.uint8, device=dev))
    return _BASELINE[key]


class _SizeRun:
    """One store at one prefix length: one untimed save, then ``saves`` timed saves (each of its
    own prompt, from the same source pages), then ``trials`` timed restores of the first prompt
    (after one untimed), each beside a pinned copy of the same bytes; rows with the medians. A
    failure in any step makes the store's rows at this size one failure row."""

    def __init__(self, s: Any, cache: Cache, tokens: int, trials: int, where: str, paired: bool = False) -> None:
        self.s, self.cache, self.tokens, self.trials, self.where, self.paired = s, cache, tokens, trials, where, paired
        self.saves = save_trials(tokens)
        self.nbytes = tokens // BLOCK * cache.spec.block_bytes
        self.src, self.dst = cache.blocks(tokens)
        rng = np.random.default_rng(tokens)
        self.prompts = [rng.integers(0, 128_000, tokens, dtype=np.int64) for _ in range(self.saves)]
        self.warm_prompt = rng.integers(0, 128_000, tokens, dtype=np.int64)
        self.save_t: list[float] = []
        self.save_base: list[float] = []
        self.rest_t: list[float] = []
        self.h2d_t: list[float] = []
        self.got: list[int] = []
        self.wrong = 0
        self.differs: dict[str, float] = {}
        self.error: tuple[BaseException, str] | None = None

    def run(self, figures: dict[tuple[str, int, str], float], log: Callable[[str], None]) -> Iterator[dict[str, Any]]:
        if self.start(log):
            for j in range(self.saves):
                self.save_once(j, log)
            for i in range(self.trials + 1):
                self.restore_once(i, log)
        yield from self.rows(figures, log)

    def _guard(self, fn: Callable[[], None], log: Callable[[str], None]) -> bool:
        if self.error is not None:
            return False
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001 - reported as the peer's row, the others go on
            log(f"{self.s.name} {label(self.tokens)}: {type(e).__name__}: {e}")
            self.error = (e, traceback.format_exc()[-2000:])
            return False

    def start(self, log: Callable[[str], None]) -> bool:
        def go() -> None:
            dev = self.cache.device
            self.host, self.dev_buf = _baseline_buffers(self.nbytes, dev)
            self.s.prepare(self.tokens)
            _timed(self._d2h, dev)
            # One untimed save of this size first (a prompt of its own): a store's first save of
            # a size pays once for what later ones reuse (the connector's device staging and the
            # daemon's opening of its CUDA IPC handle; LMCache's pool is allocated at open).
            _timed(lambda: self.s.save(self.warm_prompt, self.src), dev)
            self._after("after_save")  # (a peer's account of the timed saves leaves this one out)

        return self._guard(go, log)

    def _after(self, hook: str) -> None:
        """A peer's untimed hook after a save or a restore (``after_save``, ``after_restore``), if it has one."""
        if (after := getattr(self.s, hook, None)) is not None:
            after()

    def _h2d(self) -> None:
        self.dev_buf.copy_(self.host, non_blocking=True)

    def _d2h(self) -> None:
        self.host.copy_(self.dev_buf, non_blocking=True)

    def save_once(self, j: int, log: Callable[[str], None]) -> None:
        def go() -> None:
            dev, prompt = self.cache.device, self.prompts[j]
            self.save_t.append(_timed(lambda: self.s.save(prompt, self.src), dev)[0])
            self._after("after_save")  # untimed: a peer's own account of the save
            self.save_base.append(_timed(self._d2h, dev)[0])

        self._guard(go, log)

    def restore_once(self, i: int, log: Callable[[str], None]) -> None:
        """Restore ``i`` (0 warms up; the last is verified page by page)."""
        if i > self.trials:
            return

        def go() -> None:
            dev, cache = self.cache.device, self.cache
            cache.zero(self.dst)
            b, _ = _timed(self._h2d, dev)
            if (before := getattr(self.s, "before_restore", None)) is not None:
                before(self.prompts[0], self.dst)  # untimed: a connector's scheduler lookup
            dt, n = _timed(lambda: self.s.restore(self.prompts[0], self.dst), dev)
            self._after("after_restore")  # untimed: a peer's own reference (the layer-wise row's compute alone)
            if i == self.trials:
                m = n // BLOCK
                self.wrong = cache.wrong_pages(self.src[:m], self.dst[:m])
                self.differs = cache.what_differs(self.src[:m], self.dst[:m]) if self.wrong else {}
            self.got.append(n)
            if i:
                self.rest_t.append(dt)
                self.h2d_t.append(b)

        self._guard(go, log)

    def rows(self, figures: dict[tuple[str, int, str], float], log: Callable[[str], None]) -> Iterator[dict[str, Any]]:
        name, size, nbytes, tokens = self.s.name, label(self.tokens), self.nbytes, self.tokens
        if self.error is not None or not self.rest_t or not self.save_t:
            e, tb = self.error or (RuntimeError("no timed restore or save"), "")
            row = {**_failure(f"{name}_paged_{size}", name, tokens, e), "device": self.where}
            if tb and "traceback" in row:
                row["traceback"] = tb
            yield row
            return
        med, base = statistics.median(self.rest_t), statistics.median(self.h2d_t)
        save_s, save_base = statistics.median(self.save_t), statistics.median(self.save_base)
        verified = self.wrong == 0 and min(self.got) == tokens
        extra = {"tokens": tokens, "bytes": nbytes, "device": self.where, "block_tokens": BLOCK,
                 "trials": self.trials, "layout": self.cache.layout, "peer": name, "paired": self.paired,
                 "verified": verified, "wrong_pages": self.wrong, "missing_tokens": tokens - min(self.got),
                 **self.s.info(), **({"differs": self.differs} if self.differs else {})}
        figures[(name, tokens, "restore")] = nbytes / 1e9 / med if verified else 0.0
        figures[(name, tokens, "save")] = nbytes / 1e9 / save_s if verified else 0.0
        log(f"{name} {size}: restore {med * 1e3:.2f} ms ({nbytes / 1e9 / med:.2f} GB/s), pinned copy "
            f"{base * 1e3:.2f} ms; save {save_s * 1e3:.1f} ms (median of {len(self.save_t)}); verified {verified}")
        yield result("peers", f"{name}_paged_{size}_restore", nbytes / 1e9 / med, "GB/s", nbytes / 1e9 / base,
                     ms=round(med * 1e3, 3), ms_min=round(min(self.rest_t) * 1e3, 3), baseline_ms=round(base * 1e3, 3),
                     baseline_what="torch pinned host->device copy", **extra)
        yield result("peers", f"{name}_paged_{size}_save", nbytes / 1e9 / save_s, "GB/s", nbytes / 1e9 / save_base,
                     ms=round(save_s * 1e3, 3), ms_each=[round(t * 1e3, 3) for t in self.save_t],
                     save_trials=len(self.save_t), baseline_ms=round(save_base * 1e3, 3),
                     baseline_what="torch device->pinned host copy", **extra)
