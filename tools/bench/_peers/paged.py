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

* ``kvstore``: ``KVStore`` with one DRAM tier (its shared-memory arena, registered with CUDA:
  pinned), a block = one vLLM page of every layer (``engine.vllm.pages.PagedKV``), opened and
  timed once the arena is faulted in (LMCache allocates its pool in its open). A save hashes the
  prompt, reserves arena slots for the new blocks (``KVStore.reserve``), gathers the pages into
  device staging in ranges of ``D2H_PIECE_BYTES`` and copies each range straight into its slots
  on a copy stream as soon as it is gathered (``engine.gpu.ArenaSlots``: one 2-D DMA per run of
  slots into the registered arena), waits, and commits: one device-to-host copy per byte and no
  host copy, as LMCache's save. A restore hashes the head of the prefix (``HEAD_BLOCKS``, or
  1/``HEAD_SHARE`` of it), peeks at where the arena holds it (``KVStore.peek_arena``: no lease)
  and queues its copy to a device staging buffer at once, then hashes the rest (going on from
  the head's last hash: each block hashed once), leases the whole prefix, keeps the head's copy
  where the lease confirms it (``KVStore.confirm_peek``; copied again from the lease otherwise,
  ``head_reread``), and copies the rest on a copy stream (``engine.gpu.ArenaBlocks``: one DMA
  per run of blocks in the arena) as whole blocks in ``BODY_RANGES`` ranges, each scattered into
  the pages (``PagedKV.scatter_layer``) as soon as it lands, and a small tail by layer groups
  (8 layers, the last 2 apart: ``layer_groups``), so that little scatter is left when the link
  is done. (The first H200 run, 2026-12-01
  20:26, copied all layers before scattering and saved as ``kvstore-rows`` does; the pipelined
  restore and the device-staged save came after it; the pieced save and ``kvstore-blocks`` in
  the fifth session; the head, the small last group, the warm-up and the copy-thread pieces
  in the sixth; the reserved save in the seventh; the peeked head and the whole-block ranges in
  the eighth.) Its rows carry ``phases_ms``: the host's time to hash, peek at and queue the head
  (``head``, and its steps ``head_hash``, ``head_lease``, ``head_queue``), hash the rest, take
  the lease and queue the copies,
  medians of the trials, and ``save_phases_ms``: the save's time to hash and reserve, to queue
  the gathers and copies, to prepare the commit's records (while the copies are in flight), to
  wait for the last copy, to commit, and its pieces.
* ``kvstore-nohead``: the same without the head (the whole prefix hashed and leased before the
  first copy): what the head gains;
* ``kvstore-leasehead``: the head leased (a lease of its own) before its copy is queued, instead
  of peeked (the seventh session's head): what the peek gains;
* ``kvstore-head32``: a larger head (32 blocks at 4K, 1/8 of the prefix at 32K);
* ``kvstore-groups``: the rest copied by layer groups of every block (2-D DMAs with a row pitch)
  instead of whole-block ranges (the fifth to seventh sessions' restore); ``kvstore-g16``: the
  same with groups of 16 layers;
* ``kvstore-head4``: a smaller head (4 blocks at 4K, 1/64 of the prefix at 32K, instead of 16 and
  1/16): whether less leased before the first copy gains more than the link idle it may leave;
* ``kvstore-put``: the same, saved as in the sixth session: each range copied to a pinned host
  buffer and put (the put copies it into the arena with ``copy_threads`` threads, under the next
  range's copy; ranges of ``save_pieces``); ``save_phases_ms``: queue, wait, put, pieces;
* ``kvstore-blocks``: the same, pipelined by blocks only (no head, no layer-grouped tail):
  ``BODY_RANGES`` ranges of whole blocks, each one DMA of back-to-back rows (no 2-D pitch),
  every layer of a range scattered as soon as it lands;
* ``kvstore-whole``: the same, every layer copied before any is scattered (no overlap);
* ``kvstore-rows``: the same store used as ``engine/vllm/connector.py`` does today over shared
  memory: restored with each layer's rows of the arena handed to ``scatter_layer`` as a host
  view, saved with ``PagedKV.gather`` straight into the pinned host buffer;
* ``lmcache``: LMCache 0.5.3's ``LMCacheEngine`` with its local CPU backend (its pinned pool of
  the same capacity, its defaults otherwise) and its vLLM GPU connector from
  ``CreateGPUConnector`` (``VLLMPagedMemGPUConnectorV2`` with LMCache's default GPU staging
  buffer; layout hint ``HND``), 256-token chunks, ``store`` / ``retrieve`` with the slot mapping
  of the blocks, as its vLLM adapter calls them.
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

from engine.gpu import ArenaBlocks, ArenaSlots, PeekedBlocks, release_arenas
from engine.vllm.pages import PagedKV, PageSpec, layer_rows
from kvstore.buffers import default_piece_bytes
from kvstore.config import StoreConfig, TierSpec
from kvstore.errors import UsageError
from kvstore.keys import hash_blocks
from kvstore.store import KVStore
from tools.bench._peers.base import PeerUnavailable

SIZES = (4096, 32768)
BLOCK = 16
CHUNK = 256  # LMCache's default chunk
SLAB = 64 << 20
LAYER_GROUP = 8  # layers a restore copies to the device at a time (kvstore's pipelined restore)
LAST_GROUP = 2  # layers in the last group: its scatter, after the last copy, is the restore's tail
HEAD_BLOCKS = 16  # leading blocks kvstore leases and copies first (at least; 1/HEAD_SHARE of the prefix)...
HEAD_SHARE = 16  # ...so the link is busy while the rest is hashed and leased (~2.5 ms for 2,048 blocks)
BODY_RANGES = 4  # kvstore's restore: whole-block ranges between the head and the tail, each scattered as it lands
TAIL_BLOCKS = 16  # kvstore's restore: the last blocks, copied by layer groups (at least; 1/TAIL_SHARE of the prefix)
TAIL_SHARE = 64
MAX_SAVE_PIECES = 16  # block ranges a save copies to the host and puts in turn (the D2H of one under the put of the last)
D2H_PIECE_BYTES = 128 << 20  # a reserved save's ranges: gathered, then copied into their arena slots in turn
SAVE_TRIALS = 3  # saves timed per store up to 8K tokens, each of its own prompt (the median is the figure)
WARM_TOKENS = 256  # the untimed save and restore every store makes once it is open (one LMCache chunk)
GiB = float(1 << 30)
PEERS = ("kvstore-connector", "kvstore-connector-hnd", "kvstore-connector-lw", "kvstore", "kvstore-nohead", "kvstore-leasehead", "kvstore-head4", "kvstore-head32", "kvstore-groups", "kvstore-g16", "kvstore-put", "kvstore-blocks", "kvstore-whole", "kvstore-rows", "lmcache", "lmcache-nhd")
GOALS = {"lmcache": 1.2}  # the restore's; the save's: at least LMCache's (1x)
SETTLE_TIMEOUT_S = 30.0
CLOSE_WAIT_S = 20.0  # issue 20: kvstore >= 1.2x LMCache


def label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _cuts(n: int, k: int) -> list[tuple[int, int]]:
    """``n`` blocks cut into ``k`` ranges ``(a, b)`` as even as can be (fewer when ``n < k``)."""
    cuts = [i * n // k for i in range(k + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def layer_groups(num_layers: int, size: int = LAYER_GROUP, last: int = LAST_GROUP) -> list[tuple[int, int]]:
    """``(first, end)`` layer ranges of ``size`` layers, the last one cut so that its final
    ``last`` layers are a group of their own."""
    groups = [(g, min(g + size, num_layers)) for g in range(0, num_layers, size)]
    lo, hi = groups[-1]
    if hi - lo > last:
        groups[-1:] = [(lo, hi - last), (hi - last, hi)]
    return groups


def page_spec(layers: int = 32, kv_heads: int = 8, head_dim: int = 128) -> PageSpec:
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    return PageSpec(names, BLOCK, kv_heads, head_dim, torch.bfloat16, "HND")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Cache:
    """The paged cache the stores restore into, with the blocks of one prefix: ``src`` (where
    it is saved from, random bits) and ``dst`` (where it is restored, zeroed first), two disjoint
    shuffled sets of blocks.

    ``layout``: ``HND``, vLLM's fused ``[blocks, KV heads, block_size, 2 * head_dim]`` page per
    layer (kvstore's ``PagedKV``; LMCache's ``NL_X_NB_NH_BS_CS``), or ``NHD``, the flash-attention
    ``[2, blocks, block_size, KV heads, head_dim]`` of vLLM's CUDA default (LMCache's
    ``NL_X_TWO_NB_BS_NH_HS``; kvstore's ``PagedKV`` does not take it)."""

    def __init__(self, spec: PageSpec, max_tokens: int, device: torch.device, seed: int = 0,
                 layout: str = "HND") -> None:
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
        self.kv = (PagedKV(spec, dict(zip(spec.layer_names, self.layers, strict=True)))
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

    def open(self, cache: Cache, capacity: int, scratch: str) -> None:
        assert cache.kv is not None, "kvstore restores into the HND (PagedKV) cache"
        self.cache, self.spec, self.pages = cache, cache.spec, cache.kv
        self._root = Path(tempfile.mkdtemp(prefix="peers-paged-", dir=scratch))
        opts = {"capacity_bytes": capacity, "slab_bytes": SLAB, "copy_threads": self.copy_threads}
        tiers = (TierSpec("dram", "dram", opts),)
        self.kv = KVStore(StoreConfig(root=self._root, tiers=tiers, persist_on_close=False, policy="lru"))
        # The arena's pages are faulted in by a background thread from open on; an engine opens
        # its store long before its first save, and LMCache allocates its pinned pool inside its
        # open: the figures start once the arena is ready (the fifth session's first 4K save,
        # 513-626 ms against 88-99 for a store opened later, wrote into it while it was faulted in).
        self.kv.tiers[0].prefault.done.wait()
        self._copy_threads = int(self.kv.tiers[0].describe()["copy_threads"])
        self.ns = self.spec.namespace("bench/peers-llama-8b", "paged", 0, 1)
        self.kv.register_namespace(self.ns)
        self._host: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None
        self._stream: Any = None
        self._head: tuple[int, Any] | None = None  # (blocks, landed event) of the restore's head copy
        self._head_event: Any = None
        self.phases: dict[str, list[float]] = {}
        """Host seconds of each restore's steps (``restore``), read and cleared per size."""
        self.save_phases: dict[str, float] = {}
        """Host seconds of the last save's steps (``save``)."""

    def prepare(self, tokens: int) -> None:
        """Buffers for a ``tokens``-long prefix, allocated once (untimed), as an engine does: the
        device staging, and the pinned host buffer of a save by ``put`` (a reserved save has
        none: it copies into the arena)."""
        n, bb = tokens // BLOCK, self.spec.block_bytes
        if self.save_by == "put":
            self._host_buffer(n)
        if self._staging is None or self._staging.shape[0] < n:
            self._staging = None
            self._staging = torch.empty((n, bb), dtype=torch.uint8, device=self.cache.device)

    def _host_buffer(self, n: int) -> torch.Tensor:
        """The pinned host buffer of a save by ``put``, of ``n`` blocks at least (allocated here
        only by :meth:`prepare`, or in a save whose store refused the reserve)."""
        if self._host is None or self._host.shape[0] < n:
            self._host = None
            pin = self.cache.device.type == "cuda"
            self._host = torch.empty((n, self.spec.block_bytes), dtype=torch.uint8, pin_memory=pin)
        return self._host[:n]

    def save_pieces(self, n: int) -> list[tuple[int, int]]:
        """The block ranges a save of ``n`` blocks copies to the host and puts in turn: each at
        least ``copy_threads`` x the copy pool's piece (``default_piece_bytes``: 32 MiB, or glibc's
        non-temporal threshold), so that every copy thread of the put has a piece of it (a smaller
        put is copied by fewer threads), and at least two, so that the put of the first runs
        under the device-to-host copy of the second."""
        nbytes = n * self.spec.block_bytes
        k = max(2, min(MAX_SAVE_PIECES, nbytes // (self._copy_threads * default_piece_bytes())))
        return _cuts(n, k)

    save_by = "reserve"
    """How a save reaches the store: ``reserve`` (the pages' one device-to-host copy lands in
    arena slots that ``KVStore.reserve`` handed out, then one commit) or ``put`` (the sixth
    session's: into a pinned host buffer, then a put per range copies it into the arena)."""

    def save(self, tokens: np.ndarray, ids: list[int]) -> None:
        """Hash, then :meth:`_save_reserved` (or :meth:`_save_put` with ``save_by = "put"``, or
        where the store cannot reserve)."""
        t0 = time.perf_counter()
        hashes = hash_blocks(self.ns, tokens)
        res = None
        if self.save_by == "reserve":
            try:
                res = self.kv.reserve(self.ns, hashes)
            except UsageError:  # no shared-memory arena first: the put path
                res = None
        if res is None:
            self._save_put(t0, hashes, ids)
        else:
            self._save_reserved(t0, res, ids)

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

    def _save_put(self, t0: float, hashes: list[Any], ids: list[int]) -> None:
        """The sixth session's save, in block ranges (:meth:`save_pieces`): gather a range's
        pages into device staging, copy it to the pinned host buffer on the copy stream as soon
        as it is gathered, and put each range once it has landed, so the put's copy into the
        arena runs under the next range's DMA: one device-to-host copy and one host copy (the
        put's) per byte. (Gathering straight into the pinned buffer, as ``KvstoreRows`` and the
        connector do, is a strided device-to-host copy per layer: on the H200 it ran at 0.8-1.2
        GB/s.)"""
        n = len(ids)
        buf = self._host_buffer(n)
        pieces = self.save_pieces(n)
        landed = self._gather_out(ids, pieces, lambda a, b, staged: buf[a:b].copy_(staged, non_blocking=True))
        t1 = time.perf_counter()
        wait = put = 0.0
        for (a, b), ev in zip(pieces, landed, strict=True):
            w = time.perf_counter()
            if ev is not None:
                ev.synchronize()
            p = time.perf_counter()
            self.kv.put(self.ns, hashes[:b], buf[a:b].view(-1).numpy(), start=a)
            wait, put = wait + p - w, put + time.perf_counter() - p
        self.save_phases = {"queue": t1 - t0, "wait": wait, "put": put, "pieces": len(pieces)}

    def _copy_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.cache.device)
        return self._stream

    head_blocks = HEAD_BLOCKS
    """Leading blocks leased and copied before the whole prefix is hashed and leased (0: none)."""
    head_share = HEAD_SHARE
    """...or ``1/head_share`` of the prefix when that is more."""
    layer_group = LAYER_GROUP
    """Layers the restore copies to the device at a time (the last group: ``LAST_GROUP``)."""
    tail_blocks = TAIL_BLOCKS
    """Last blocks of the prefix copied by layer groups (at least; 0: none)..."""
    tail_share = TAIL_SHARE
    """...or ``1/tail_share`` of the prefix when that is more (0: no share)."""

    head_by = "peek"
    """How the head's copy is queued: ``peek`` (from where :meth:`KVStore.peek_arena` saw its
    blocks, before any lease; kept for the blocks :meth:`KVStore.confirm_peek` confirms once the
    whole prefix is leased, the rest copied again from the lease) or ``lease`` (the head leased
    first, then the whole prefix: two leases; the seventh session's restore)."""

    def restore(self, tokens: np.ndarray, ids: list[int]) -> int:
        """Queue the head's copy to the device at once, so that the link starts moving bytes
        (from a peek at the arena, or a lease of the head: :attr:`head_by`); then hash and lease
        the whole prefix, confirm the head, and queue the rest (:meth:`_scatter`)."""
        t0 = time.perf_counter()
        head: Any = None
        peek: Any = None
        self._head = None
        n_all = len(tokens) // BLOCK
        h = min(max(self.head_blocks, n_all // self.head_share), n_all) if self.head_blocks else 0
        hashes: list[Any] = []
        th = tl = t0
        if h:
            hashes = hash_blocks(self.ns, tokens[: h * BLOCK])
            th = time.perf_counter()
            if self.head_by == "peek":
                peek = self.kv.peek_arena(self.ns, hashes)
                head = PeekedBlocks(peek)
            else:
                head = ArenaBlocks(self.kv, self.kv.acquire(self.ns, hashes))
            tl = time.perf_counter()
            if head.num_blocks:
                self._head = (head.num_blocks, self._queue_head(head, head.num_blocks))
        t1 = time.perf_counter()
        # The rest of the chain goes on from the head's last hash (each block hashed once).
        hashes += hash_blocks(self.ns, tokens[h * BLOCK :], parent=hashes[-1] if hashes else None)
        t2 = time.perf_counter()
        lease = self.kv.acquire(self.ns, hashes)
        blocks = ArenaBlocks(self.kv, lease)
        if peek is not None and self._head is not None:
            hb = min(self._head[0], blocks.num_blocks)
            if self.kv.confirm_peek(peek, lease) < hb:  # a peeked slot changed: copy the head again
                self.reread += 1
                self._head = (hb, self._queue_head(blocks, hb)) if hb else None
        t3 = time.perf_counter()
        try:
            n = blocks.num_blocks
            if n:
                self._scatter(blocks, ids[:n])
            t4 = time.perf_counter()
            sync(self.cache.device)
        finally:
            blocks.release()
            if head is not None:
                head.release()
        steps = (("head", t1 - t0), ("head_hash", th - t0), ("head_lease", tl - th), ("head_queue", t1 - tl)) if h else ()
        for k, v in (*steps, ("hash", t2 - t1), ("lease", t3 - t2), ("queue", t4 - t3)):
            self.phases.setdefault(k, []).append(v)
        return n * BLOCK

    reread = 0
    """Restores whose peeked head was not confirmed and was copied again from the lease."""

    def _queue_head(self, src: Any, count: int) -> Any:
        """Every byte of ``src``'s first ``count`` blocks into the first rows of the staging, on
        the copy stream (after whatever it holds: a head copied again lands after the first
        copy); the event that says it landed (None on the CPU, where it has)."""
        assert self._staging is not None
        dst = self._staging[:count]
        if self.cache.device.type != "cuda":
            src.copy_into(dst, 0, self.spec.block_bytes)
            return None
        # No wait for the staging's last readers (a wait_stream is an event made, recorded and
        # waited on before the first DMA): every restore ends with a device synchronize. The
        # event is made once and recorded again in each restore.
        # Queued on the copy stream without making it current (no stream switch before the
        # restore's first DMA).
        copy, ev = self._copy_stream(), self._head_landed()
        src.copy_into(dst, 0, self.spec.block_bytes, stream=copy)
        ev.record(copy)
        return ev

    def _head_landed(self) -> Any:
        if self._head_event is None:
            self._head_event = torch.cuda.Event()
        return self._head_event

    def _scatter(self, blocks: ArenaBlocks, ids: list[int]) -> None:
        """The blocks past the head (:meth:`restore`) copied to the device on a copy stream as
        whole blocks (one 1-D DMA per run of the lease) in ``BODY_RANGES`` block ranges, each
        range's every layer scattered into the pages (``PagedKV.scatter_layer``) as soon as it
        lands, and the last ``1/tail_share`` of the prefix (``tail_blocks`` at least) copied by
        layer groups (:func:`layer_groups`, ``ArenaBlocks.copy_into`` with a row pitch), so that
        little scatter is left once the link is done. (A 2-D copy by layer groups of the whole
        rest, ``kvstore-groups``, moved 512 MiB in 9.81-10.10 ms on the H100 against 9.76-9.96 for
        whole blocks.)"""
        assert self._staging is not None
        n, pb, kv, bb = len(ids), self.spec.page_bytes, self.pages, self.spec.block_bytes
        h, head_ev = self._head if self._head is not None else (0, None)
        h = min(h, n)
        staging = self._staging[:n]
        tail = min(n - h, max(self.tail_blocks, n // self.tail_share if self.tail_share else 0))
        t0 = n - tail
        body = [(h + a, h + b) for a, b in _cuts(t0 - h, BODY_RANGES)]
        groups = layer_groups(kv.num_layers, self.layer_group) if tail else []
        cuda = self.cache.device.type == "cuda"  # (on the CPU every copy is done when it returns)
        main = torch.cuda.current_stream(self.cache.device) if cuda else None
        copy = self._copy_stream() if cuda else None

        def landed() -> Any:
            if copy is None:
                return None
            ev = torch.cuda.Event()
            ev.record(copy)
            return ev

        def wait(ev: Any) -> None:
            if ev is not None and main is not None:
                main.wait_event(ev)

        if copy is not None:
            copy.wait_stream(main)  # the staging's last readers are done
        with torch.cuda.stream(copy) if copy is not None else contextlib.nullcontext():
            body_landed = []
            for a, b in body:
                blocks.copy_into(staging[a:b], 0, bb, first=a)
                body_landed.append(landed())
            tail_landed = []
            for lo, hi in groups:
                blocks.copy_into(staging[t0:, lo * pb : hi * pb], lo * pb, hi * pb, first=t0)
                tail_landed.append(landed())
        idx_all = kv.block_ids(ids)
        layers = range(kv.num_layers)
        if h:
            wait(head_ev)
            self._scatter_rows(idx_all[:h], staging[:h], layers)
        for (a, b), ev in zip(body, body_landed, strict=True):
            wait(ev)
            self._scatter_rows(idx_all[a:b], staging[a:b], layers)
        for (lo, hi), ev in zip(groups, tail_landed, strict=True):
            wait(ev)
            self._scatter_rows(idx_all[t0:], staging[t0:], range(lo, hi))

    def _scatter_rows(self, idx: torch.Tensor, rows: torch.Tensor, layers: range) -> None:
        """Layers ``layers`` of staged blocks ``rows`` into the pages ``idx``."""
        pb = self.spec.page_bytes
        for layer in layers:
            self.pages.scatter_layer(layer, idx, rows[:, layer * pb : (layer + 1) * pb])

    def info(self) -> dict[str, Any]:
        phases = {k: round(statistics.median(v) * 1e3, 3) for k, v in self.phases.items() if v}
        self.phases = {}
        save = {k: (v if k == "pieces" else round(v * 1e3, 3)) for k, v in self.save_phases.items()}
        reread, self.reread = self.reread, 0
        return {"block_tokens": BLOCK, "block_bytes": self.spec.block_bytes, "copy_threads": self._copy_threads,
                "head_by": self.head_by if self.head_blocks else None, "head_reread": reread,
                **({"phases_ms": phases} if phases else {}), **({"save_phases_ms": save} if save else {})}

    def close(self) -> None:
        self._host = self._staging = None
        release_arenas()  # no lease is held: unregister and unmap before the store goes
        self.kv.close()
        shutil.rmtree(self._root, ignore_errors=True)


class KvstoreNohead(KvstorePaged):
    """The same restore without the head: the whole prefix hashed and leased before the first
    copy (the fifth session's ``kvstore``, with its small last group): what the head gains."""

    name = "kvstore-nohead"
    head_blocks = 0


class KvstoreLeaseHead(KvstorePaged):
    """The seventh session's head: leased (a second lease, of the head alone) before its copy is
    queued, instead of peeked: what the peek gains."""

    name = "kvstore-leasehead"
    head_by = "lease"


class KvstoreHead4(KvstorePaged):
    """A smaller head: 4 blocks at 4K (1/64 of the prefix: 32 blocks at 32K) instead of 16 and
    128, so that less is hashed and leased before the first copy; what it gains or loses
    against ``kvstore`` (a head whose copy ends before the rest is leased leaves the link idle)."""

    name = "kvstore-head4"
    head_blocks = 4
    head_share = 64


class KvstoreHead32(KvstorePaged):
    """A larger head: 32 blocks at 4K (1/8 of the prefix: 256 at 32K) instead of 16 and 128, so
    that the head's copy, now queued from a peek, still covers the rest's hash and lease."""

    name = "kvstore-head32"
    head_blocks = 32
    head_share = 8


class KvstoreGroups(KvstorePaged):
    """The same head, then the whole rest copied by layer groups (``LAYER_GROUP`` layers of
    every block per 2-D DMA, the last ``LAST_GROUP`` apart) and each group scattered as soon as it
    lands: the restore of the fifth to seventh sessions, before whole-block ranges."""

    name = "kvstore-groups"

    def _scatter(self, blocks: ArenaBlocks, ids: list[int]) -> None:
        """The blocks past the head (:meth:`restore`) copied to the device by layer groups on a
        copy stream (:func:`layer_groups`), the head's pages scattered once it has landed, and
        each group scattered into the pages as soon as it lands, so the scatter hides under the
        copy (the engine's layer-wise pattern, ``ArenaBlocks.copy_into``); the last group is
        small, so little scatter is left once the link is done."""
        assert self._staging is not None
        n, pb, kv, bb = len(ids), self.spec.page_bytes, self.pages, self.spec.block_bytes
        h, head_ev = self._head if self._head is not None else (0, None)
        h = min(h, n)
        staging = self._staging[:n]
        groups = layer_groups(kv.num_layers, self.layer_group)
        dev = self.cache.device
        if dev.type != "cuda":
            if h < n:
                blocks.copy_into(staging[h:], 0, bb, first=h)
            idx = kv.block_ids(ids)
            for layer in range(kv.num_layers):
                kv.scatter_layer(layer, idx, staging[:, layer * pb : (layer + 1) * pb])
            return
        main = torch.cuda.current_stream(dev)
        copy = self._copy_stream()
        copy.wait_stream(main)  # the staging's last readers are done
        landed = []
        with torch.cuda.stream(copy):
            for lo, hi in groups:
                if h < n:
                    blocks.copy_into(staging[h:, lo * pb : hi * pb], lo * pb, hi * pb, first=h)
                ev = torch.cuda.Event()
                ev.record(copy)
                landed.append(ev)
        # Block ids go to the device in one small copy, after the DMAs are queued and before any
        # wait (from pageable memory, torch's copy waits for the current stream).
        idx_all = kv.block_ids(ids)
        if h:
            main.wait_event(head_ev)
            self._scatter_rows(idx_all[:h], staging[:h], range(kv.num_layers))
        if h == n:
            return
        for (lo, hi), ev in zip(groups, landed, strict=True):
            main.wait_event(ev)
            self._scatter_rows(idx_all[h:], staging[h:], range(lo, hi))


class KvstoreG16(KvstoreGroups):
    """``kvstore-groups`` with layer groups of 16 (16, 14, 2 layers) instead of 8: fewer, wider
    rows per 2-D copy (1 MiB instead of 512 KiB), more scatter left after each group lands."""

    name = "kvstore-g16"
    layer_group = 16


class KvstorePut(KvstorePaged):
    """The same store and restore, saved as in the sixth session (``save_by = "put"``: a pinned
    host buffer, then a put per range): beside ``kvstore``, what the reserved save gains."""

    name = "kvstore-put"
    save_by = "put"


class KvstoreBlocks(KvstorePaged):
    """The same store, pipelined by blocks only: no head and no layer-grouped tail, the whole
    prefix in ``BODY_RANGES`` ranges of whole blocks (one DMA per run of the lease, no 2-D
    pitch), every layer of a range scattered as soon as that range lands."""

    name = "kvstore-blocks"
    head_blocks = 0
    tail_blocks = 0
    tail_share = 0


class KvstoreWhole(KvstorePaged):
    """The same store, every layer copied to the device before any is scattered (the first H200
    run's ``kvstore``): beside the pipelined restore, what the overlap gains."""

    name = "kvstore-whole"
    head_blocks = 0

    def _scatter(self, blocks: ArenaBlocks, ids: list[int]) -> None:
        assert self._staging is not None
        n, pb, kv = len(ids), self.spec.page_bytes, self.pages
        staging = self._staging[:n]
        blocks.copy_range(staging, 0, self.spec.block_bytes)
        idx = kv.block_ids(ids)
        for layer in range(kv.num_layers):
            kv.scatter_layer(layer, idx, staging[:, layer * pb : (layer + 1) * pb])


class KvstoreRows(KvstorePaged):
    """The same store, restored as the vLLM connector does over shared memory today: each
    layer's rows of the arena (a strided host view) straight into ``scatter_layer``."""

    name = "kvstore-rows"
    head_blocks = 0
    save_by = "put"

    def save(self, tokens: np.ndarray, ids: list[int]) -> None:
        """As the connector saves: the pages gathered straight into the pinned host buffer."""
        n = len(ids)
        buf = self._host_buffer(n)
        self.pages.gather(ids, buf)
        sync(self.cache.device)
        self.kv.put(self.ns, hash_blocks(self.ns, tokens), buf.view(-1).numpy())

    def _scatter(self, blocks: ArenaBlocks, ids: list[int]) -> None:
        kv, pb = self.pages, self.spec.page_bytes
        offsets = [off for off, _ in blocks.lease.locations]
        idx = kv.block_ids(ids)
        for layer in range(kv.num_layers):
            kv.scatter_layer(layer, idx, layer_rows(blocks.host, offsets, layer, pb))


class KvstoreConnector:
    """The vLLM connector's worker side (``engine/vllm/worker.py``) driven as vLLM drives it
    (``engine.vllm.harness.WorkerDriver``: ``register_kv_caches``, ``start_load_kv``,
    ``wait_for_layer_load``, ``wait_for_save``, ``get_finished``) against a real daemon over
    shared memory, on pages in vLLM 0.32's CUDA default layout (``LBNHC``: the logical
    ``[B, H, N, C]`` view over NHD memory): what a vLLM user runs. A save is one step that saves
    the prompt's blocks, timed until the daemon holds them; a restore an async load, timed until
    ``get_finished`` reports it."""

    name = "kvstore-connector"
    layout = "LBNHC"
    load_mode = "async"

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
                                   lookup_timeout_s=60.0, load_timeout_s=60.0, save_timeout_s=120.0)

    def prepare(self, tokens: int) -> None:
        pass

    def save(self, tokens: np.ndarray, ids: list[int]) -> None:
        self.driver.save(tokens, ids)

    def restore(self, tokens: np.ndarray, ids: list[int]) -> int:
        return self.driver.load(tokens, ids) * BLOCK

    def info(self) -> dict[str, Any]:
        w = self.driver.worker
        return {"plane": w.load_link.client.plane if w.load_link.client else None, "load_mode": self.load_mode,
                "piece_bytes": w.cfg.piece_bytes, "stage_bytes": w.cfg.stage_bytes}

    def close(self) -> None:
        self.driver.close()
        release_arenas()
        self.daemon.stop()
        shutil.rmtree(self._root, ignore_errors=True)


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
        n = self.driver.load(tokens, ids, layerwise=True, compute=self._compute) * BLOCK
        sync(self.cache.device)
        t0 = time.perf_counter()  # the same forward pass with nothing to load
        for layer in range(self.cache.spec.num_layers):
            self._compute(layer)
        sync(self.cache.device)
        self.compute_s.append(time.perf_counter() - t0)
        return n

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
