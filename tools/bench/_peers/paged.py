"""The peers on the GPU: one prefix restored into a vLLM-layout paged KV cache.

``python -m tools.bench peers --device cuda`` (``--device cpu``: the same code with the paged
cache in host memory, the smoke path tests and a machine without a GPU run).

The paged cache is one tensor per layer, vLLM's ``[blocks, KV heads, block_size, 2 * head_dim]``
view (``HND``: K then V of a head in the last axis), Llama-3-8B geometry (32 layers, 8 KV heads,
head_dim 128, bf16), ``block_size`` 16 tokens. Both stores are handed the same cache: LMCache's
connector keeps the pointers of the first cache it sees for good (as vLLM registers one), so the
prefix is stored from one shuffled set of blocks and restored into another shuffled set of the
same cache, zeroed before every restore, and every restored page is compared with its source
page. Every store makes one untimed save and restore of a short prefix of its own once it is open
(``_warm``). Figures per store and prefix length (4K and 32K tokens):

* ``{peer}_{size}_restore``: GB/s (and ms) of one retrieve of the whole cached prefix into the
  pages (tokens hashed, looked up, copied, scattered, synchronized); baseline: one ``torch``
  copy of the same bytes from a pinned host tensor to the device, in the same trials;
* ``{peer}_{size}_save``: GB/s of storing the prefix from the pages, the median of
  ``SAVE_TRIALS`` saves up to 8K tokens (one past it), each of another prompt (a second save of a
  cached prefix stores nothing); baseline: one ``torch`` copy of the same bytes from the device
  into a pinned host tensor, after each save.

``--paired`` (``paged_run.run(paired=True)``) opens every store at once and drives them in turn,
save by save and restore by restore, each round starting at another store, so that a slow spell
of the host lands on every store alike (one store after another, such a spell fell on one store's
whole block of trials). The drivers are in ``tools/bench/_peers/paged_run.py``.

The stores:

* ``kvstore-connector``: the vLLM connector's worker side (``engine/vllm/worker.py``) driven as
  vLLM drives it (``engine.vllm.harness.WorkerDriver``) against a real daemon over shared memory,
  on pages in vLLM 0.32's CUDA default memory order (``LBNHC``); ``-hnd`` on FlashInfer's and the
  CPU build's (``LBHNC``); ``-lw`` with layer-wise loads under a per-layer matmul (TTFT beside
  the same compute with no load). Restores go through ``engine.transfer.PagedLoader``, saves by
  PUT_DEVICE where the daemon can read GPU memory, else through its staging segment.
* ``kvstore``: the same library path in process: ``KVStore`` with one DRAM tier (its arena
  registered with CUDA), a restore that leases the prefix and hands it to
  ``engine.transfer.PagedLoader``, a save into slots of a ``KVStore.reserve`` (one device gather
  per range of pages, one device-to-host DMA per range straight into its slots,
  ``engine.gpu.ArenaSlots``), then ``commit``. Its rows carry ``phases_ms`` (hash, lease, queue)
  and ``save_phases_ms``.
* ``lmcache``: LMCache 0.5.3's ``LMCacheEngine`` with its local CPU backend (its pinned pool of
  the same capacity, its defaults otherwise) and its vLLM GPU connector from
  ``CreateGPUConnector`` (``VLLMPagedMemGPUConnectorV2`` with LMCache's default GPU staging
  buffer; layout hint ``HND``), 256-token chunks, ``store`` / ``retrieve`` with the slot mapping
  of the blocks, as its vLLM adapter calls them; ``lmcache-nhd`` on vLLM's flash-attention
  layout of LMCache's vLLM versions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.gpu import ArenaBlocks, ArenaSlots, release_arenas
from engine.transfer import PagedLoader
from engine.vllm.pages import PagedKV, PageSpec
from kvstore.config import StoreConfig, TierSpec
from kvstore.keys import hash_blocks
from kvstore.store import KVStore
from tools.bench._peers.base import PeerUnavailable

SIZES = (4096, 32768)
BLOCK = 16
CHUNK = 256  # LMCache's default chunk
SLAB = 64 << 20
MAX_SAVE_PIECES = 16  # block ranges a save copies to the host and puts in turn (the D2H of one under the put of the last)
D2H_PIECE_BYTES = 128 << 20  # a reserved save's ranges: gathered, then copied into their arena slots in turn
SAVE_TRIALS = 3  # saves timed per store up to 8K tokens, each of its own prompt (the median is the figure)
WARM_TOKENS = 256  # the untimed save and restore every store makes once it is open (one LMCache chunk)
GiB = float(1 << 30)
PEERS = ("kvstore-connector", "kvstore-connector-hnd", "kvstore-connector-lw", "kvstore", "lmcache", "lmcache-nhd")
GOALS = {"lmcache": 1.2}  # the restore's; the save's: at least LMCache's (1x)
SETTLE_TIMEOUT_S = 30.0
CLOSE_WAIT_S = 20.0  # issue 20: kvstore >= 1.2x LMCache


def label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _cuts(n: int, k: int) -> list[tuple[int, int]]:
    """``n`` blocks cut into ``k`` ranges ``(a, b)`` as even as can be (fewer when ``n < k``)."""
    cuts = [i * n // k for i in range(k + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def page_spec(layers: int = 32, kv_heads: int = 8, head_dim: int = 128) -> PageSpec:
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    return PageSpec(names, BLOCK, kv_heads, head_dim, torch.bfloat16, "HND")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tile_sizes(piece_bytes: int) -> dict[str, int]:
    """The loader's ``piece_bytes`` and a staging ring of four such tiles (512 MiB at least);
    none for 0 (the defaults)."""
    return {"piece_bytes": piece_bytes, "stage_bytes": max(4 * piece_bytes, 512 << 20)} if piece_bytes else {}


def _tiles_ms(load: Any) -> list[tuple[float, float]]:
    """A landed load's tile timeline (``DeviceLoad.tile_ms``), rounded to microseconds."""
    return [(round(a, 3), round(b, 3)) for a, b in load.tile_ms()]


class Cache:
    """The paged cache the stores restore into, with the blocks of one prefix: ``src`` (where
    it is saved from, random bits) and ``dst`` (where it is restored, zeroed first), two disjoint
    shuffled sets of blocks.

    ``layout``: ``HND``, vLLM's fused ``[blocks, KV heads, block_size, 2 * head_dim]`` page per
    layer (kvstore's ``PagedKV``; LMCache's ``NL_X_NB_NH_BS_CS``), or ``NHD``, the flash-attention
    ``[2, blocks, block_size, KV heads, head_dim]`` of vLLM's CUDA default (LMCache's
    ``NL_X_TWO_NB_BS_NH_HS``; kvstore's ``PagedKV`` does not take it)."""

    def __init__(self, spec: PageSpec, max_tokens: int, device: torch.device, seed: int = 0,
                 layout: str = "HND", one_launch: bool = False) -> None:
        self.spec, self.device, self.layout = spec, device, layout
        n = max_tokens // BLOCK
        self.num_blocks = 2 * n + 8
        if layout == "HND":
            shape: tuple[int, ...] = (self.num_blocks, spec.num_kv_heads, BLOCK, spec.content)
            self.block_dim = 0
        elif layout == "NHD":
            shape = (2, self.num_blocks, BLOCK, spec.num_kv_heads, spec.head_size)
            self.block_dim = 1
        elif layout == "LBNHC":  # vLLM 0.32's logical [B, H, N, C] over NHD memory (its CUDA default)
            shape = (self.num_blocks, BLOCK, spec.num_kv_heads, spec.content)
            self.block_dim = 0
        else:
            raise ValueError(f"paged cache layout {layout!r}: HND, LBNHC or NHD")
        g = torch.Generator(device=device).manual_seed(seed)
        self.layers = []
        for _ in range(spec.num_layers):
            t = torch.empty(shape, dtype=spec.dtype, device=device)
            t.view(torch.int16).random_(generator=g)  # every bit pattern; compared as bytes
            self.layers.append(t.permute(0, 2, 1, 3) if layout == "LBNHC" else t)
        self.kv = (PagedKV(spec, dict(zip(spec.layer_names, self.layers, strict=True)), one_launch=one_launch)
                   if layout in ("HND", "LBNHC") else None)
        self._perm = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()

    def blocks(self, tokens: int) -> tuple[list[int], list[int]]:
        """Source and destination block ids of a ``tokens``-long prefix (disjoint, shuffled)."""
        n = tokens // BLOCK
        half = self.num_blocks // 2
        return self._perm[:n], self._perm[half : half + n]

    def zero(self, ids: list[int]) -> None:
        idx = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        for t in self.layers:
            t.index_fill_(self.block_dim, idx, 0)

    def wrong_pages(self, src: list[int], dst: list[int]) -> int:
        """Layers x blocks whose restored page differs from its source page."""
        s = torch.as_tensor(src, dtype=torch.long, device=self.device)
        d = torch.as_tensor(dst, dtype=torch.long, device=self.device)
        bad = 0
        for t in self.layers:
            a = t.index_select(self.block_dim, s).view(torch.int16).movedim(self.block_dim, 0)
            b = t.index_select(self.block_dim, d).view(torch.int16).movedim(self.block_dim, 0)
            bad += int((a != b).flatten(1).any(1).sum())
        return bad

    def what_differs(self, src: list[int], dst: list[int]) -> dict[str, float]:
        """Where restored pages differ, on layer 0: the share of elements equal to the source
        in the K half and the V half of each head's content (HND), and the share left zero."""
        s = torch.as_tensor(src, dtype=torch.long, device=self.device)
        d = torch.as_tensor(dst, dtype=torch.long, device=self.device)
        t = self.layers[0]
        a = t.index_select(self.block_dim, s).view(torch.int16).float()
        b = t.index_select(self.block_dim, d).view(torch.int16).float()
        half = self.spec.head_size
        if self.layout == "HND":
            k, v = (a[..., :half] == b[..., :half]), (a[..., half:] == b[..., half:])
        else:
            k, v = (a[0] == b[0]), (a[1] == b[1])
        return {"k_equal": round(float(k.float().mean()), 4), "v_equal": round(float(v.float().mean()), 4),
                "zero": round(float((b == 0).float().mean()), 4)}


def slot_mapping(ids: list[int], device: torch.device) -> torch.Tensor:
    """vLLM's slot of every token of blocks ``ids`` (block * block_size + offset)."""
    b = torch.as_tensor(ids, dtype=torch.long)
    return (b[:, None] * BLOCK + torch.arange(BLOCK)).flatten().to(device)


class KvstorePaged:
    """kvstore's DRAM tier and GPU load path (see the module docstring)."""

    name = "kvstore"

    layout = "HND"

    copy_threads = 0
    """The DRAM tier's ``copy_threads`` (0: its default)."""
    piece_bytes = 0
    """The restore's tile (0: ``engine.transfer``'s default)."""

    def open(self, cache: Cache, capacity: int, scratch: str) -> None:
        assert cache.kv is not None, "kvstore restores into the HND (PagedKV) cache"
        self.cache, self.spec, self.pages = cache, cache.spec, cache.kv
        self._root = Path(tempfile.mkdtemp(prefix="peers-paged-", dir=scratch))
        opts = {"capacity_bytes": capacity, "slab_bytes": SLAB, "copy_threads": self.copy_threads}
        tiers = (TierSpec("dram", "dram", opts),)
        self.kv = KVStore(StoreConfig(root=self._root, tiers=tiers, persist_on_close=False, policy="lru"))
        # The arena's pages are faulted in by a background thread from open on; an engine opens
        # its store long before its first save, and LMCache allocates its pinned pool inside its
        # open: the figures start once the arena is ready (a 4K save into an arena still being
        # faulted in took 513-626 ms, against 88-99 ms once it was).
        self.kv.tiers[0].prefault.done.wait()
        self._copy_threads = int(self.kv.tiers[0].describe()["copy_threads"])
        self.ns = self.spec.namespace("bench/peers-llama-8b", "paged", 0, 1)
        self.kv.register_namespace(self.ns)
        self._staging: torch.Tensor | None = None
        self._stream: Any = None
        self.tiles_ms: list[tuple[float, float]] = []
        """The last restore's tiles: (landed, scattered) ms after its first DMA began."""
        self._loader = PagedLoader(cache.device, **_tile_sizes(self.piece_bytes))
        self._loader.timing = cache.device.type == "cuda"
        self.phases: dict[str, list[float]] = {}
        """Host seconds of each restore's steps (``restore``), read and cleared per size."""
        self.save_phases: dict[str, float] = {}
        """Host seconds of the last save's steps (``save``)."""

    def prepare(self, tokens: int) -> None:
        """The save's device staging for a ``tokens``-long prefix, allocated once (untimed), as an
        engine does."""
        n, bb = tokens // BLOCK, self.spec.block_bytes
        if self._staging is None or self._staging.shape[0] < n:
            self._staging = None
            self._staging = torch.empty((n, bb), dtype=torch.uint8, device=self.cache.device)

    def save(self, tokens: np.ndarray, ids: list[int]) -> None:
        """Hash, reserve arena slots for the new blocks, then :meth:`_save_reserved`."""
        t0 = time.perf_counter()
        self._save_reserved(t0, self.kv.reserve(self.ns, hash_blocks(self.ns, tokens)), ids)

    def d2h_pieces(self, n: int) -> list[tuple[int, int]]:
        """The block ranges a reserved save gathers and copies out in turn: ``D2H_PIECE_BYTES``
        each (2 to ``MAX_SAVE_PIECES``), so the first copy to the host starts after a small
        gather and the host queues the rest under it."""
        k = max(2, min(MAX_SAVE_PIECES, n * self.spec.block_bytes // D2H_PIECE_BYTES))
        return _cuts(n, k)

    def _save_reserved(self, t0: float, res: Any, ids: list[int]) -> None:
        """Reserve arena slots for the prefix's new blocks (``KVStore.reserve``), gather each
        range's pages into device staging (:meth:`d2h_pieces`) and copy it straight into its
        slots on the copy stream (``engine.gpu.ArenaSlots``: one 2-D DMA per run of slots into
        the registered arena), wait, and commit: one device-to-host copy per byte, as LMCache's
        save, and no host copy. An error before the commit gives the slots back."""
        slots = ArenaSlots(res)
        try:
            a0, m = slots.first, slots.num_blocks
            pieces = self.d2h_pieces(m) if m else []
            t1 = time.perf_counter()
            landed = self._gather_out(ids[a0 : a0 + m], pieces, lambda a, b, staged: slots.copy_from(staged, first=a))
            t2 = time.perf_counter()
            slots.prepare()  # the commit's records, built while the copies are in flight
            t2p = time.perf_counter()
            if landed and landed[-1] is not None:
                landed[-1].synchronize()  # (one copy stream: the last lands last)
            t3 = time.perf_counter()
            slots.commit()
        finally:
            slots.abort()  # (a no-op after the commit)
        self.save_phases = {"reserve": t1 - t0, "queue": t2 - t1, "prepare": t2p - t2, "wait": t3 - t2p,
                            "commit": time.perf_counter() - t3, "pieces": len(pieces)}

    def _gather_out(self, ids: list[int], pieces: list[tuple[int, int]],
                    out: Callable[[int, int, torch.Tensor], Any]) -> list[Any]:
        """Gather each range ``a:b`` of ``ids``' pages into the device staging on the current
        stream and, as soon as it is gathered, ``out(a, b, staged rows)`` on the copy stream (a
        copy to the host). Returns the event of each range's copy (None on the CPU, where it
        is done)."""
        assert self._staging is not None
        staging = self._staging[: len(ids)]
        dev = self.cache.device
        if dev.type != "cuda":
            for a, b in pieces:
                self.pages.gather(ids[a:b], staging[a:b])
                out(a, b, staging[a:b])
            return [None] * len(pieces)
        main, copy = torch.cuda.current_stream(dev), self._copy_stream()
        landed = []
        for a, b in pieces:  # each piece's D2H starts once its own gather is done
            self.pages.gather(ids[a:b], staging[a:b])
            gathered = torch.cuda.Event()
            gathered.record(main)
            with torch.cuda.stream(copy):
                copy.wait_event(gathered)
                out(a, b, staging[a:b])
                ev = torch.cuda.Event()
                ev.record(copy)
            landed.append(ev)
        return landed

    def _copy_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.cache.device)
        return self._stream

    def restore(self, tokens: np.ndarray, ids: list[int]) -> int:
        """Hash the prefix, lease it, and hand the lease to ``engine.transfer.PagedLoader`` (the
        connector's loader: whole-block DMA tiles into a device staging ring, each scattered into
        the pages as it lands), then wait for the last scatter and give the lease back."""
        t0 = time.perf_counter()
        hashes = hash_blocks(self.ns, tokens)
        t1 = time.perf_counter()
        blocks = ArenaBlocks(self.kv, self.kv.acquire(self.ns, hashes))
        t2 = time.perf_counter()
        try:
            n = blocks.num_blocks
            load = self._loader.load(blocks, self.pages, ids[:n]) if n else None
            t3 = time.perf_counter()
            if load is not None:
                load.synchronize()
                self.tiles_ms = _tiles_ms(load)
        finally:
            blocks.release()
        for k, v in (("hash", t1 - t0), ("lease", t2 - t1), ("queue", t3 - t2)):
            self.phases.setdefault(k, []).append(v)
        return n * BLOCK

    def info(self) -> dict[str, Any]:
        phases = {k: round(statistics.median(v) * 1e3, 3) for k, v in self.phases.items() if v}
        self.phases = {}
        save = {k: (v if k == "pieces" else round(v * 1e3, 3)) for k, v in self.save_phases.items()}
        tiles, self.tiles_ms = self.tiles_ms, []
        return {"block_tokens": BLOCK, "block_bytes": self.spec.block_bytes, "copy_threads": self._copy_threads,
                "page_kernel": self.pages.one_launch, "tail_parts": self._loader.tail_parts,
                **({"tiles_ms": tiles} if tiles else {}),
                **({"phases_ms": phases} if phases else {}), **({"save_phases_ms": save} if save else {})}

    def close(self) -> None:
        self._staging = None
        release_arenas()  # no lease is held: unregister and unmap before the store goes
        self.kv.close()
        shutil.rmtree(self._root, ignore_errors=True)


class KvstoreConnector:
    """The vLLM connector's worker side (``engine/vllm/worker.py``) driven as vLLM drives it
    (``engine.vllm.harness.WorkerDriver``: ``register_kv_caches``, ``start_load_kv``,
    ``wait_for_layer_load``, ``wait_for_save``, ``get_finished``) against a real daemon over
    shared memory, on pages in vLLM 0.32's CUDA default layout (``LBNHC``: the logical
    ``[B, H, N, C]`` view over NHD memory): what a vLLM user runs. A save is one step that saves
    the prompt's blocks, timed until the daemon holds them; a restore an async load, timed until
    ``get_finished`` reports it, after the scheduler's lookup (untimed: :meth:`before_restore`)
    has taken its lease."""

    name = "kvstore-connector"
    layout = "LBNHC"
    load_mode = "async"
    piece_bytes = 0
    """The connector's ``piece_bytes`` (0: its default)."""
    page_kernel = False
    """The connector's ``page_kernel`` (every layer's pages in one kernel launch)."""

    def open(self, cache: Cache, capacity: int, scratch: str) -> None:
        from engine.vllm.harness import WorkerDriver, small_daemon

        assert cache.kv is not None, "the connector restores into vLLM's logical [B, H, N, C] pages"
        self.cache = cache
        self._root = Path(tempfile.mkdtemp(prefix="peers-connector-", dir=scratch))
        self.daemon = small_daemon(self._root, dram=str(capacity))
        # The daemon faults its arena in from its start (a background thread, ~2 GB/s a core):
        # an engine starts long before its first save, and LMCache allocates its pool in its open.
        time.sleep(min(20.0, 1.0 + capacity / 2e9))
        caches = dict(zip(cache.spec.layer_names, cache.layers, strict=True))
        self.driver = WorkerDriver(self.daemon.url, cache.spec, caches, plane="shm", load_mode=self.load_mode,
                                   lookup_timeout_s=60.0, load_timeout_s=60.0, save_timeout_s=120.0,
                                   page_kernel=self.page_kernel, **_tile_sizes(self.piece_bytes))
        if self.driver.worker.loader is not None:
            self.driver.worker.loader.timing = cache.device.type == "cuda"
        self._sums = daemon_sums(self.daemon.url)
        self.save_daemon_ms: dict[str, Any] = {}
        self.restore_daemon_ms: dict[str, Any] = {}

    def prepare(self, tokens: int) -> None:
        pass

    def save(self, tokens: np.ndarray, ids: list[int]) -> None:
        self.driver.save(tokens, ids)

    def before_restore(self, tokens: np.ndarray, ids: list[int]) -> None:
        """Untimed, right before each restore: the scheduler's lookup (with its lease), which vLLM
        makes before the step that loads, as LMCache's scheduler makes its own lookup apart from
        the worker's retrieve that its row times; its time is the row's ``lookup_ms``."""
        self._admitted = self.driver.admit(tokens, len(ids))

    def _take_admitted(self) -> Any:
        admitted, self._admitted = getattr(self, "_admitted", None), None
        return admitted

    def restore(self, tokens: np.ndarray, ids: list[int]) -> int:
        return self.driver.load(tokens, ids, admitted=self._take_admitted()) * BLOCK

    def info(self) -> dict[str, Any]:
        w = self.driver.worker
        c = w.save_link.client
        k = w.counters
        out: dict[str, Any] = {
            "plane": w.load_link.client.plane if w.load_link.client else None, "load_mode": self.load_mode,
            "piece_bytes": w.cfg.piece_bytes, "stage_bytes": w.cfg.stage_bytes,
            "page_kernel": w.kv is not None and w.kv.one_launch,
            "tail_parts": w.loader.tail_parts if w.loader is not None else None,
            "put_device": bool(c and c.info.get("put_device")),
            "device_puts": k.device_puts, "staged_puts": k.staged_puts,
            # the worker's own time in all, over every load and save of the row (warm-up included)
            "worker_ms": {"fetch": round(k.load_fetch_s * 1e3, 3), "copy": round(k.load_copy_s * 1e3, 3),
                          "put": round(k.save_put_s * 1e3, 3), "loaded_blocks": k.loaded_blocks,
                          "saved_blocks": k.saved_blocks, "preleased_blocks": k.preleased_blocks},
            # the last restore's scheduler lookup (before_restore: untimed, made before the step)
            "lease_at_lookup": w.cfg.lease_at_lookup, "lookup_ms": round(self.driver.lookup_s * 1e3, 3),
        }
        if c and not c.info.get("put_device"):
            out["put_device_unavailable"] = c.info.get("put_device_unavailable")
        if w.last_load is not None and w.last_load.tiles:
            out["tiles_ms"] = _tiles_ms(w.last_load)
        # the last load's and save's host timelines (ms since start_load_kv / wait_for_save)
        out["load_marks_ms"] = [(k, round(t * 1e3, 3)) for k, t in w.last_marks]
        out["save_marks_ms"] = [(k, round(t * 1e3, 3)) for k, t in w.last_save_marks]
        # the driver's (the timed call's) own: ms since the call began
        out["driver_marks_ms"] = {k: [(m, round(t * 1e3, 3)) for m, t in v] for k, v in self.driver.marks.items()}
        out["save_daemon_ms"] = self.save_daemon_ms  # the daemon's share of the last save and restore
        out["restore_daemon_ms"] = self.restore_daemon_ms
        return out

    def after_save(self) -> None:
        """Untimed, after each save: what of it was the daemon's (:func:`daemon_delta_ms`)."""
        self.save_daemon_ms = self._daemon_since()

    def after_restore(self) -> None:
        self.restore_daemon_ms = self._daemon_since()

    def _daemon_since(self) -> dict[str, Any]:
        """The daemon's time since the last call (or the open)."""
        before, self._sums = self._sums, daemon_sums(self.daemon.url)
        return daemon_delta_ms(before, self._sums)

    def close(self) -> None:
        self.driver.close()
        release_arenas()
        self.daemon.stop()
        shutil.rmtree(self._root, ignore_errors=True)


def daemon_sums(url: str) -> dict[str, tuple[float, float]]:
    """The daemon's own time so far, from ``/metrics``: ``{"<op>": (seconds, requests)}`` of each
    data-plane op (``kvstore_request_seconds``) and ``{"put_device:<phase>": ...}`` of
    PUT_DEVICE's phases (``kvstore_put_device_seconds``); empty when it cannot be read."""
    import re
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    sums: dict[str, list[float]] = {}
    pat = (r'^kvstore_(?:request_seconds_(sum|count)\{op="(\w+)",plane="(?!http")\w+"\}'
           r'|put_device_seconds_(sum|count)\{phase="(\w+)"\}) (\S+)$')
    for m in re.finditer(pat, text, re.M):
        what, op, pwhat, phase, v = m.groups()
        key, kind = (op, what) if op else (f"put_device:{phase}", pwhat)
        sums.setdefault(key, [0.0, 0.0])[0 if kind == "sum" else 1] = float(v)
    return {k: (sm, n) for k, (sm, n) in sums.items()}


def daemon_delta_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """What the daemon spent between two :func:`daemon_sums`: ms and requests of each op or phase."""
    out: dict[str, Any] = {}
    for k, (sm, n) in after.items():
        s0, n0 = before.get(k, (0.0, 0.0))
        if n > n0:
            out[k] = {"ms": round((sm - s0) * 1e3, 3), "n": int(n - n0)}
    return out


class KvstoreConnectorHnd(KvstoreConnector):
    """The same on FlashInfer's and the CPU build's layout (``LBHNC``: HND memory)."""

    name = "kvstore-connector-hnd"
    layout = "HND"


LAYER_FLOPS_SHAPE = (2048, 4096, 8192)
"""The per-layer compute of the layer-wise row: one bf16 matmul ``[m, k] @ [k, n]`` (~0.2-0.3 ms
on an H100): a suffix's share of a layer's work while the prefix loads."""


class KvstoreConnectorLayerwise(KvstoreConnector):
    """The connector's layer-wise load: one step whose forward pass (a matmul per layer on the
    current stream, :data:`LAYER_FLOPS_SHAPE`) waits at each attention layer for that layer's
    load only; the restore figure is that step's time (TTFT), beside the same compute with no
    load (``compute_ms``) in the same trial."""

    name = "kvstore-connector-lw"
    load_mode = "layerwise"

    def open(self, cache: Cache, capacity: int, scratch: str) -> None:
        super().open(cache, capacity, scratch)
        m, k, n = LAYER_FLOPS_SHAPE if cache.device.type == "cuda" else (64, 64, 64)
        dt = torch.bfloat16 if cache.device.type == "cuda" else torch.float32
        self._x = torch.randn(m, k, device=cache.device, dtype=dt)
        self._w = torch.randn(k, n, device=cache.device, dtype=dt)
        self.compute_s: list[float] = []

    def _compute(self, layer: int) -> None:
        torch.mm(self._x, self._w)

    def restore(self, tokens: np.ndarray, ids: list[int]) -> int:
        return self.driver.load(tokens, ids, layerwise=True, compute=self._compute,
                                admitted=self._take_admitted()) * BLOCK

    def after_restore(self) -> None:
        """The same forward pass with nothing to load (``compute_ms``), outside the timed restore."""
        super().after_restore()
        sync(self.cache.device)
        t0 = time.perf_counter()
        for layer in range(self.cache.spec.num_layers):
            self._compute(layer)
        sync(self.cache.device)
        self.compute_s.append(time.perf_counter() - t0)

    def info(self) -> dict[str, Any]:
        out = super().info()
        if self.compute_s:
            out["compute_ms"] = round(statistics.median(self.compute_s) * 1e3, 3)
            out["compute_what"] = f"{self.cache.spec.num_layers} x mm{LAYER_FLOPS_SHAPE}, no load"
            self.compute_s = []
        return out


class LmcachePaged:
    """LMCache's ``LMCacheEngine`` with its local CPU backend and its vLLM GPU connector."""

    name = "lmcache"
    layout = "HND"

    def open(self, cache: Cache, capacity: int, scratch: str) -> None:
        if cache.device.type != "cuda":
            raise PeerUnavailable("LMCache's vLLM paged-memory connector runs on CUDA only "
                                  "(run with --device cuda on a GPU machine)")
        # No network on a GPU machine here: LMCache's usage telemetry stays off.
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        try:
            import lmcache
            from lmcache.utils import EngineType
            from lmcache.v1.cache_engine import LMCacheEngineBuilder
            from lmcache.v1.config import LMCacheEngineConfig
            from lmcache.v1.gpu_connector import CreateGPUConnector
            from lmcache.v1.metadata import LMCacheMetadata
        except ImportError as e:
            raise PeerUnavailable(f"lmcache is not installed ({e}); on the H200 the bundle's run.sh "
                                  "installs lmcache 0.5.3") from e
        self.cache, self._builder = cache, LMCacheEngineBuilder
        self._version = getattr(lmcache, "__version__", "?")
        spec = cache.spec
        self._id = f"peers-paged-{self.name}"
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=capacity / GiB,
                                                lmcache_instance_id=self._id, save_unfull_chunk=False)
        shape = (spec.num_layers, 2, CHUNK, spec.num_kv_heads, spec.head_size)
        md = LMCacheMetadata(model_name="bench/peers-llama-8b", world_size=1, local_world_size=1, worker_id=0,
                             local_worker_id=cache.device.index or 0, kv_dtype=spec.dtype, kv_shape=shape,
                             role="worker")
        self.connector = CreateGPUConnector(cfg, md, EngineType.VLLM, layout_hints={"kv_layout": self.layout})
        self.engine = LMCacheEngineBuilder.get_or_create(self._id, cfg, md, self.connector,
                                                         lambda t, r: None, lambda o, r: o)
        self.engine.post_init()

    def prepare(self, tokens: int) -> None:
        pass

    def save(self, tokens: np.ndarray, ids: list[int]) -> None:
        """Store, then wait until a lookup finds the whole prefix (the wait is in the figure, as
        kvstore's put returns with its blocks findable)."""
        t = torch.from_numpy(tokens.astype(np.int64))
        self.engine.store(t, kvcaches=self.cache.layers, slot_mapping=slot_mapping(ids, self.cache.device))
        sync(self.cache.device)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while int(self.engine.lookup(t)) < len(t):
            if time.monotonic() > deadline:
                raise RuntimeError(f"LMCache held {int(self.engine.lookup(t))} of {len(t)} tokens "
                                   f"{SETTLE_TIMEOUT_S:.0f} s after the store")
            time.sleep(0.001)

    def restore(self, tokens: np.ndarray, ids: list[int]) -> int:
        t = torch.from_numpy(tokens.astype(np.int64))
        mask = self.engine.retrieve(t, kvcaches=self.cache.layers, slot_mapping=slot_mapping(ids, self.cache.device))
        sync(self.cache.device)
        return int(mask.sum())

    def info(self) -> dict[str, Any]:
        return {"lmcache_version": self._version, "chunk_tokens": CHUNK,
                "connector": type(self.connector).__name__}

    def close(self) -> None:
        # LMCache's close was seen to hang (its Redis backend, tools/bench/_peers/lmcache.py): give
        # it CLOSE_WAIT_S, then go on.
        t = threading.Thread(target=self._destroy, name="lmcache-destroy", daemon=True)
        t.start()
        t.join(CLOSE_WAIT_S)

    def _destroy(self) -> None:
        with contextlib.suppress(Exception):  # LMCache's own shutdown logs its errors
            self._builder.destroy(self._id)


class LmcacheNhd(LmcachePaged):
    """The same, restoring into vLLM's CUDA default flash-attention layout (``NHD``, K and V
    apart): LMCache on the layout its vLLM users mostly have, beside the shared ``HND`` one."""

    name = "lmcache-nhd"
    layout = "NHD"
