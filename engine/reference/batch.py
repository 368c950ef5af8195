"""Batched prefill: many requests, each with its own cached prefix and new suffix, in one pass.

:class:`BatchedLM` is what a serving engine's chunked prefill does with a prefix cache. For each
request it finds the leading cached blocks (first in the :class:`engine.reference.hbm_cache.HbmCache` when
there is one, then in the store's DRAM arena), then runs the model *once* over the concatenated
new tokens of all requests. Every linear layer sees the whole batch (thousands of rows: the GPU
runs near its matrix rate even when each request adds only a few hundred tokens); attention is
variable-length: each request's new tokens attend to its own prefix and, causally, to its own
new tokens.

KV layout: per layer, token-major rows ``[rows, kv_heads, head_dim]`` holding every request's
prompt one after another, each starting at a multiple of ``block_tokens`` (so that a cached block
is one ``block_tokens``-row slot: all DRAM blocks of a layer are scattered into place with one
``index_copy_``, and the HBM pages, which hold blocks in this same layout, are gathered with one
``index_select`` per request). The cached rows are filled by the loader, the new rows by the
model's cache ``update``; attention reads them in place. Index kernels run on 8-byte views of the
bytes (:func:`engine.kvlayout.wide`).

Attention backends (``attention=``):

- ``"varlen"`` (CUDA): one FlashAttention-2 variable-length call per layer for the whole batch
  (``aten._flash_attention_forward`` with ``cu_seqlens`` and ``seqused_k``; causal masks align
  bottom-right per request, which is what a cached prefix needs).
- ``"loop"``: one SDPA call per request with a lower-right causal bias (flash on CUDA, an exact
  masked SDPA on the CPU). The reference; the CPU tests run it.

Loads overlap compute as in :class:`engine.reference.hf.CachedLM`: on CUDA a side stream copies the DRAM
blocks of *all* requests layer group by layer group (one 2-D DMA per run of equally spaced
blocks and group), scatters each layer into the rows, gathers the HBM-resident blocks of that
layer from the page pool (device to device, no host transfer), promotes the DRAM blocks into HBM
pages, and records one event per layer; the model's layer i waits on the device for event i.
The host issues that work group by group, ``load_ahead`` groups in front of the layer the model's
forward is issuing (:class:`Loads`), so the model's first kernels start at once rather than
after thousands of gather launches. A request whose leading blocks are resident in HBM leases from the store only the blocks after
them. The batch's new blocks are packed once, copied to the host in one copy into a ring allocated
once (:class:`engine.gpu.HostRing`, pinned on CUDA) and stored from there in the background.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, DynamicCache

from engine.client import EngineCache
from engine.gpu import ArenaBlocks, HostBlocks, HostRing
from engine.kvlayout import KVShape, block_rows, layer_rows, pack_rows, shape_of, wide
from engine.reference.hbm_cache import HbmCache, Reservation
from engine.reference.hf import _cache_kw
from kvstore.keys import BlockHash

_ATTN = "kvstore_batched"


@dataclass(slots=True)
class _Layout:
    """Where each request of a batch lives: its new tokens in the packed query, its prompt in
    the KV rows."""

    q_starts: list[int]
    k_starts: list[int]
    k_lens: list[int]
    varlen: bool
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    used_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0


_BATCH: ContextVar[_Layout | None] = ContextVar("kvstore_batch", default=None)


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query`` ``[1, Hq, S, D]`` (packed new tokens), ``key``
    and ``value`` the KV rows as ``[1, Hkv, rows, D]`` views; returns ``[1, S, Hq, D]``."""
    lay = _BATCH.get()
    if lay is None:
        raise RuntimeError(f"attention implementation {_ATTN!r} runs only inside BatchedLM.prefill")
    if lay.varlen:
        q = query[0].transpose(0, 1)  # [S, Hq, D]
        out = torch.ops.aten._flash_attention_forward(
            q, key[0].transpose(0, 1), value[0].transpose(0, 1), lay.cu_q, lay.cu_k, lay.max_q, lay.max_k,
            0.0, True, False, scale=scaling, seqused_k=lay.used_k,
        )[0]
        return out.unsqueeze(0), None
    s_total, hq, d = query.shape[2], query.shape[1], query.shape[3]
    out = query.new_empty((1, s_total, hq, d))
    gqa = hq != key.shape[1]
    for i, k0 in enumerate(lay.k_starts):
        q0, q1 = lay.q_starts[i], lay.q_starts[i + 1]
        n = lay.k_lens[i]
        qi = query[:, :, q0:q1]
        ki, vi = key[:, :, k0 : k0 + n], value[:, :, k0 : k0 + n]
        oi = torch.nn.functional.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=causal_lower_right(q1 - q0, n), scale=scaling, enable_gqa=gqa
        )
        out[0, q0:q1] = oi[0].transpose(0, 1)
    return out, None


AttentionInterface.register(_ATTN, _attention)


class Loads:
    """The load work of one batch, issued layer group by layer group: the groups that cover the
    first ``ahead`` layers before the forward, each later one when the model's cache ``update``
    reaches ``ahead`` layers before it. So the compute stream gets the model's first kernels at
    once instead of after the host has issued every layer's copies and gathers (thousands of
    launches for a batch of HBM hits), and the load stream still runs ``ahead`` layers in front
    of the compute. ``events[layer]``: the load stream's event after that layer (None: nothing to
    wait for)."""

    def __init__(self, n_layers: int, per_group: int, issue: Callable[[int, int], None] | None, ahead: int,
                 on_layer: Callable[[int], None] | None = None) -> None:
        self.events: list[Any] = [None] * n_layers
        self.on_layer = on_layer
        """Work for a layer on the compute stream, after its load event (``hbm_gather="compute"``)."""
        self._n = n_layers
        self._per_group = max(1, per_group)
        self._issue = issue
        self._ahead = max(0, ahead)
        self._next = 0
        """First layer whose group is not issued yet."""

    def until(self, layer: int) -> None:
        """Issue every group up to the one holding ``layer + ahead``."""
        if self._issue is None:
            return
        last = min(self._n - 1, layer + self._ahead)
        while self._next <= last:
            g0 = self._next
            g1 = min(self._n, g0 + self._per_group)
            self._issue(g0, g1)
            self._next = g1

    def finish(self) -> None:
        self.until(self._n - 1)


class _RowsCache(DynamicCache):
    """The model's cache for one batch: ``update`` issues the loads ahead of this layer, writes the
    new K/V into the rows (after the layer's load event) and hands back the whole rows of that
    layer."""

    def __init__(self, config: Any, kv: torch.Tensor, new_rows: torch.Tensor, loads: Loads) -> None:
        super().__init__(config=config)
        self._kv = kv  # [layers, 2, rows, H, D]
        self._new = new_rows
        self._loads = loads

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self._loads.until(layer_idx)
        ev = self._loads.events[layer_idx]
        if ev is not None:
            torch.cuda.current_stream(key_states.device).wait_event(ev)
        if self._loads.on_layer is not None:
            self._loads.on_layer(layer_idx)
        k, v = self._kv[layer_idx, 0], self._kv[layer_idx, 1]
        wide(k).index_copy_(0, self._new, wide(key_states[0].transpose(0, 1)))
        wide(v).index_copy_(0, self._new, wide(value_states[0].transpose(0, 1)))
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


@dataclass(slots=True)
class Timings:
    """Seconds the engine thread spent in each phase of its batches, summed (``reset()`` between
    runs). On CUDA every phase but ``wait`` only issues work: the device runs it meanwhile."""

    batches: int = 0
    plan: float = 0.0
    """Hashing, HBM matching, store leases."""
    load: float = 0.0
    """Issuing the copies and gathers of the cached blocks."""
    forward: float = 0.0
    """Issuing the model's kernels (the host runs ahead of the device until it must wait)."""
    store: float = 0.0
    """Packing the new blocks, HBM admission, staging and submitting the stores."""
    wait: float = 0.0
    """Waiting for the device at the end of the batch."""
    device: float = 0.0
    """CUDA: the compute stream's time from the first load to the last kernel of the batch
    (events), i.e. the batch's device time without the host's planning before it."""

    def reset(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0 if name == "batches" else 0.0)

    def as_dict(self) -> dict[str, float]:
        return {name: round(float(getattr(self, name)), 4) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class BatchResult:
    logits: torch.Tensor
    """Next-token logits after the prompt, float32, ``[vocab]``."""
    hit_tokens: int
    hbm_tokens: int
    """Of the hit tokens, those served from HBM (no host transfer)."""
    computed_tokens: int


@dataclass(slots=True, eq=False)
class Plan:
    ids: torch.Tensor
    hashes: list[BlockHash] = field(default_factory=list)
    n_hbm: int = 0
    hbm_keys: list[BlockHash] = field(default_factory=list)
    hbm_slots: torch.Tensor | None = None
    dram: ArenaBlocks | HostBlocks | None = None
    """Blocks ``n_hbm .. n_hbm + n_dram - 1`` of the prompt (the lease's block 0 is block ``n_hbm``)."""
    n_dram: int = 0
    """Blocks loaded from the store, after the HBM-resident ones."""
    promote: Reservation | None = None

    @property
    def hit_blocks(self) -> int:
        return self.n_hbm + self.n_dram


def batches(requests: Sequence[tuple[int, int]], max_tokens: int, max_rows: int, block_tokens: int = 64) -> list[list[int]]:
    """Greedy FIFO batching of ``(computed tokens, prompt tokens)`` requests: consecutive
    requests (by index) while the batch's computed tokens stay within ``max_tokens`` and its KV
    rows (prompts rounded up to blocks) within ``max_rows``; a request over a limit runs alone."""
    out: list[list[int]] = []
    cur: list[int] = []
    tok = rows = 0
    for i, (c, n) in enumerate(requests):
        p = -(-n // block_tokens) * block_tokens
        if cur and (tok + c > max_tokens or rows + p > max_rows):
            out.append(cur)
            cur, tok, rows = [], 0, 0
        cur.append(i)
        tok += c
        rows += p
    if cur:
        out.append(cur)
    return out


class BatchedLM:
    """A causal LM that prefills many prompts per forward pass, skipping their cached prefixes."""

    def __init__(self, model: Any, cache: EngineCache | None, *, hbm: HbmCache | None = None,
                 layer_groups: int = 16, attention: str = "auto", block_tokens: int = 64,
                 store_ring_bytes: int | None = None, load_ahead: int = 2, hbm_gather: str = "load") -> None:
        self.model = model.eval()
        self.cache = cache
        self.hbm = hbm
        if hbm is not None and cache is None:
            raise ValueError("an HbmCache needs the EngineCache it writes through to")
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.shape: KVShape = cache.shape if cache is not None else shape_of(model.config, dtype, block_tokens)
        if attention == "auto":
            attention = "varlen" if self.device.type == "cuda" else "loop"
        if attention not in ("varlen", "loop"):
            raise ValueError(f"attention must be 'auto', 'varlen' or 'loop', not {attention!r}")
        if attention == "varlen" and self.device.type != "cuda":
            raise ValueError("attention='varlen' needs a CUDA model (FlashAttention-2); use 'loop' on the CPU")
        self.attention = attention
        self.layer_groups = max(1, layer_groups)
        self.load_ahead = max(1, load_ahead)
        """Layer groups whose loads are issued before the model reaches them (:class:`Loads`)."""
        if hbm_gather not in ("load", "compute"):
            raise ValueError(f"hbm_gather must be 'load' or 'compute', not {hbm_gather!r}")
        self.hbm_gather = hbm_gather
        """Where HBM hits are gathered into the rows: on the load stream, under the compute of
        earlier layers (``"load"``), or on the compute stream just before the layer runs
        (``"compute"``: serial, but never competing with the model's kernels)."""
        self._kw = _cache_kw(model)
        self._base = model.base_model
        self._head = model.get_output_embeddings()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._rows_buf = torch.empty(0, dtype=self.shape.dtype, device=self.device)
        self._staging_buf = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.store_ring_bytes = store_ring_bytes or ((2 << 30) if self.device.type == "cuda" else (64 << 20))
        """Host staging for the background stores (pinned on CUDA), allocated at the first store."""
        self._ring: HostRing | None = None
        self._d2h: torch.cuda.Stream | None = None
        self.timings = Timings()

    @property
    def ring_waits(self) -> int:
        """Stores that waited for room in the host staging ring (0 before the first store)."""
        return self._ring.waits if self._ring is not None else 0

    # ---- the batch --------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Any], *, use_cache: bool = True, store: bool = True) -> list[BatchResult]:
        """One forward pass over all ``prompts``; results in order. Each equals running the
        prompt alone (:class:`engine.reference.hf.CachedLM`) up to float rounding."""
        ids = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
        if not ids:
            return []
        if any(x.numel() == 0 for x in ids):
            raise ValueError("a prompt is empty")
        t0 = time.perf_counter()
        plans = [self.plan(x, use_cache) for x in ids]
        self.timings.plan += time.perf_counter() - t0
        self.timings.batches += 1
        try:
            return self._run(plans, store)
        finally:
            # _run synchronised the compute stream, which waited for every load: the copies out of
            # the arena and the pages are done.
            for p in plans:
                if p.dram is not None:
                    p.dram.release()
                if self.hbm is not None:
                    self.hbm.release(p.hbm_keys)
                    if p.promote is not None:
                        self.hbm.release(p.promote.keys)

    # ---- extension points: where a batch's cached rows come from ------------------------------
    # A subclass may override :meth:`plan`, :meth:`load` and :meth:`rows_allocated` (and only
    # these) to model another cache; tools/bench/throughput.py's HBM-resident ideal does.

    def plan(self, ids: torch.Tensor, use_cache: bool) -> Plan:
        """Where each cached block of one prompt comes from: the HBM cache's resident run, then
        a lease on the store's copies of the blocks after it (leases and HBM pages are released
        by :meth:`prefill` once the batch is done). At most ``(len - 1) // block_tokens`` blocks:
        one token is always computed."""
        p = Plan(ids)
        if self.cache is None or not use_cache:
            return p
        p.hashes = self.cache.hashes(ids)
        limit = min(len(p.hashes), (ids.numel() - 1) // self.shape.block_tokens)
        if self.hbm is not None:
            p.n_hbm = self.hbm.match(p.hashes, limit)
            if p.n_hbm:
                p.hbm_keys = list(p.hashes[: p.n_hbm])
                p.hbm_slots = self.hbm.acquire(p.hbm_keys)
        if p.n_hbm < limit:
            # Only the blocks after the resident run: a chained hash names its whole prefix, so
            # the store matches the tail chain as it is (no lease on blocks HBM already serves).
            loaded = self.cache.load(p.hashes[p.n_hbm : limit], limit - p.n_hbm)
            if loaded.num_blocks:
                p.dram, p.n_dram = loaded, loaded.num_blocks
                if self.hbm is not None:
                    p.promote = self.hbm.reserve(p.hashes, p.n_hbm, p.n_dram, promoted=True)
            else:
                loaded.release()
        return p

    def _run(self, plans: list[Plan], store: bool) -> list[BatchResult]:
        dev, bt = self.device, self.shape.block_tokens
        q_starts, k_starts, k_lens = [0], [], []
        rows = 0
        for p in plans:
            n = p.ids.numel()
            k_starts.append(rows)
            k_lens.append(n)
            q_starts.append(q_starts[-1] + n - p.hit_blocks * bt)
            rows += -(-n // bt) * bt
        tm = self.timings
        t0 = time.perf_counter()
        marks = None
        if dev.type == "cuda":
            marks = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            marks[0].record()
        kv = self._rows(rows)
        loads = self.load(plans, kv, k_starts)
        loads.until(0)
        t1 = time.perf_counter()
        tm.load += t1 - t0
        hits = [p.hit_blocks * bt for p in plans]
        new_rows = torch.cat([torch.arange(k + h, k + n) for k, h, n in zip(k_starts, hits, k_lens, strict=True)])
        positions = torch.cat([torch.arange(h, n) for h, n in zip(hits, k_lens, strict=True)])
        tokens = torch.cat([p.ids[h:] for p, h in zip(plans, hits, strict=True)])
        lay = _Layout(q_starts, k_starts, k_lens, self.attention == "varlen")
        if lay.varlen:
            lay.cu_q = torch.tensor(q_starts, dtype=torch.int32).to(dev, non_blocking=True)
            lay.cu_k = torch.tensor([*k_starts, rows], dtype=torch.int32).to(dev, non_blocking=True)
            lay.used_k = torch.tensor(k_lens, dtype=torch.int32).to(dev, non_blocking=True)
            lay.max_q = max(b - a for a, b in zip(q_starts, q_starts[1:], strict=False))
            lay.max_k = max(k_lens)
        kv_cache = _RowsCache(self.model.config, kv, new_rows.to(dev, non_blocking=True), loads)
        with self._batched(lay):
            out = self._base(
                input_ids=tokens.unsqueeze(0).to(dev, non_blocking=True),
                position_ids=positions.unsqueeze(0).to(dev, non_blocking=True),
                use_cache=True, **{self._kw: kv_cache},
            )
        last = torch.tensor(q_starts[1:], dtype=torch.long) - 1
        logits = self._head(out.last_hidden_state[0].index_select(0, last.to(dev, non_blocking=True))).float()
        loads.finish()  # every layer was updated, so this is a no-op unless the model skipped one
        t2 = time.perf_counter()
        tm.forward += t2 - t1
        if store and self.cache is not None:
            self._store_new(plans, kv, k_starts)
        t3 = time.perf_counter()
        tm.store += t3 - t2
        if marks is not None:
            marks[1].record()
            # The compute stream only: it waited for every layer's load, so the leases and pages
            # are free to go; the stores' device-to-host copies carry on on their own stream.
            torch.cuda.current_stream(dev).synchronize()
            tm.device += marks[0].elapsed_time(marks[1]) / 1e3
        tm.wait += time.perf_counter() - t3
        return [
            BatchResult(logits[i], h, p.n_hbm * bt, n - h)
            for i, (p, h, n) in enumerate(zip(plans, hits, k_lens, strict=True))
        ]

    @contextmanager
    def _batched(self, lay: _Layout) -> Iterator[None]:
        cfg = self.model.config
        prev = cfg._attn_implementation
        token = _BATCH.set(lay)
        cfg._attn_implementation = _ATTN
        try:
            yield
        finally:
            cfg._attn_implementation = prev
            _BATCH.reset(token)

    # ---- loads ------------------------------------------------------------------------------

    def _rows(self, rows: int) -> torch.Tensor:
        """``[layers, 2, rows, H, D]`` KV rows, reused across batches (grown when short)."""
        s = self.shape
        need = s.num_layers * 2 * rows * s.kv_heads * s.head_dim
        if self._rows_buf.numel() < need:
            self._rows_buf = torch.empty(0, dtype=s.dtype, device=self.device)  # free before growing
            self._rows_buf = torch.empty(need, dtype=s.dtype, device=self.device)
            self.rows_allocated(self._rows_buf)
        return self._rows_buf[:need].view(s.num_layers, 2, rows, s.kv_heads, s.head_dim)

    def _staging(self, n: int, width: int) -> torch.Tensor:
        if self._staging_buf.numel() < n * width:
            self._staging_buf = torch.empty(0, dtype=torch.uint8, device=self.device)
            self._staging_buf = torch.empty(n * width, dtype=torch.uint8, device=self.device)
        return self._staging_buf[: n * width].view(n, width)

    def reserve_rows(self, rows: int) -> None:
        """Allocate the KV rows for batches of up to ``rows`` rows now (a benchmark does before
        its timed batches), rather than at the first batch that needs them."""
        self._rows(rows)

    def rows_allocated(self, buf: torch.Tensor) -> None:
        """Called with the whole KV row buffer each time it is (re)allocated, before any row is
        written: by default nothing (every row a batch reads is loaded or computed first)."""

    def load(self, plans: list[Plan], kv: torch.Tensor, k_starts: list[int]) -> Loads:
        """The loads of the cached rows of every request, to be issued group by group
        (:class:`Loads`); on the CPU each group is done when issued, so a layer's rows are
        filled before its ``update`` returns."""
        shape, dev = self.shape, self.device
        bt, n_layers, lb = shape.block_tokens, shape.num_layers, shape.layer_bytes
        per_group = -(-n_layers // self.layer_groups)
        dram = [p for p in plans if p.n_dram]
        hbm = [p for p in plans if p.n_hbm]
        if not dram and not hbm:
            return Loads(n_layers, per_group, None, 0)

        starts = {id(p): k // bt for p, k in zip(plans, k_starts, strict=True)}
        # HBM hits: per request its pages and the row blocks they fill (a contiguous run).
        hbm_runs = [(p.hbm_slots, starts[id(p)], p.n_hbm) for p in hbm if p.hbm_slots is not None]
        dram_dst = torch.cat([torch.arange(starts[id(p)] + p.n_hbm, starts[id(p)] + p.hit_blocks) for p in dram]).to(
            dev, non_blocking=True) if dram else None
        promo_slots, promo_dst = self._promotions(dram, starts)
        n_dram = sum(p.n_dram for p in dram)
        staging = self._staging(n_dram, per_group * lb) if dram else None
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(dev))
            for t in (dram_dst, promo_slots, promo_dst):
                if t is not None:  # made on the compute stream, read on this one: not reused early
                    t.record_stream(stream)
        loads: Loads
        gather_on_compute = self.hbm_gather == "compute"
        load_hbm = [] if gather_on_compute else hbm_runs

        def issue(g0: int, g1: int) -> None:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                if staging is not None:
                    r = 0
                    for p in dram:
                        assert p.dram is not None
                        p.dram.copy_into(staging[r : r + p.n_dram, : (g1 - g0) * lb], g0 * lb, g1 * lb)
                        r += p.n_dram
                for layer in range(g0, g1):
                    for j in (0, 1):
                        self._fill_layer(kv, layer, j, g0, staging, dram_dst, load_hbm, promo_slots, promo_dst)
                    if stream is not None:
                        ev = torch.cuda.Event()
                        ev.record(stream)
                        loads.events[layer] = ev

        def gather(layer: int) -> None:
            for j in (0, 1):
                self._gather_hbm(kv[layer, j], layer, j, hbm_runs)

        loads = Loads(n_layers, per_group, issue, self.load_ahead * per_group,
                       gather if gather_on_compute and hbm_runs else None)
        return loads

    def _fill_layer(self, kv: torch.Tensor, layer: int, j: int, g0: int, staging: torch.Tensor | None,
                    dram_dst: torch.Tensor | None, hbm_runs: list[tuple[torch.Tensor, int, int]],
                    promo_slots: torch.Tensor | None, promo_dst: torch.Tensor | None) -> None:
        """K (j=0) or V of one layer: DRAM blocks scattered from the staging (the store's layout
        transposed to token-major rows), then promoted from those rows into their pages; HBM
        blocks gathered from their pages (already token-major) straight into the rows."""
        shape = self.shape
        rows = kv[layer, j]
        if staging is not None and dram_dst is not None:
            src = layer_rows(staging, shape, layer - g0)[j]
            wide(rows.view(-1, shape.block_tokens, shape.kv_heads, shape.head_dim)).index_copy_(0, dram_dst, wide(src))
        if self.hbm is None:
            return
        if promo_slots is not None and promo_dst is not None:
            blocks = block_rows(rows, shape)
            self.hbm.part(layer, j).index_copy_(0, promo_slots, blocks.index_select(0, promo_dst))
        self._gather_hbm(rows, layer, j, hbm_runs)

    def _gather_hbm(self, rows: torch.Tensor, layer: int, j: int, hbm_runs: list[tuple[torch.Tensor, int, int]]) -> None:
        """The HBM-resident blocks of every request: K (j=0) or V of layer ``layer``, gathered from
        their pages straight into ``rows`` (one ``index_select`` per request)."""
        if self.hbm is None or not hbm_runs:
            return
        pages, blocks = self.hbm.part(layer, j), block_rows(rows, self.shape)
        for slots, b0, n in hbm_runs:
            torch.index_select(pages, 0, slots, out=blocks[b0 : b0 + n])

    def _promotions(self, dram: list[Plan], starts: dict[int, int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Pages of the DRAM blocks being promoted, and the row blocks they are copied from."""
        slots, dst = [], []
        for p in dram:
            if p.promote is not None:
                k = len(p.promote.keys)
                slots.append(p.promote.slots)
                lo = starts[id(p)] + p.n_hbm
                dst.append(torch.arange(lo, lo + k))
        if not slots:
            return None, None
        return torch.cat(slots), torch.cat(dst).to(self.device, non_blocking=True)

    # ---- stores -----------------------------------------------------------------------------

    def _store_new(self, plans: list[Plan], kv: torch.Tensor, k_starts: list[int]) -> None:
        """The new full blocks of every request: packed once for the batch, admitted into HBM
        (device to device) and stored in the background."""
        assert self.cache is not None
        bt = self.shape.block_tokens
        spans = []
        for i, p in enumerate(plans):
            full = len(p.hashes)
            if full > p.hit_blocks:
                spans.append((i, p.hit_blocks, full))
        if not spans:
            return
        idx = torch.cat([torch.arange(k_starts[i] // bt + a, k_starts[i] // bt + b) for i, a, b in spans])
        packed = pack_rows(list(kv[:, 0]), list(kv[:, 1]), self.shape, idx.to(self.device, non_blocking=True))
        host, ready, done = self._stage(packed, len(spans))
        r = 0
        slots, src = [], []
        for i, a, b in spans:
            p = plans[i]
            blocks = (host if host is not None else packed)[r : r + b - a]
            r += b - a
            if self.hbm is not None:
                res = self.hbm.reserve(p.hashes, a, b - a, promoted=False)
                if res is not None:
                    slots.append(res.slots)
                    src.append(torch.arange(k_starts[i] // bt + a, k_starts[i] // bt + a + len(res.keys)))
                    self.hbm.release(res.keys)  # filled below, on this stream, before any read
            if host is not None:
                self.cache.store_async(p.hashes, blocks, a, ready=ready, done=done)
            else:
                self.cache.store_async(p.hashes, blocks, a)
        if self.hbm is not None and slots:
            dst, rows = torch.cat(slots), torch.cat(src).to(self.device, non_blocking=True)
            for layer in range(self.shape.num_layers):
                for j in (0, 1):
                    self.hbm.part(layer, j).index_copy_(0, dst, block_rows(kv[layer, j], self.shape).index_select(0, rows))

    def _stage(self, packed: torch.Tensor, stores: int) -> tuple[torch.Tensor | None, Any, Callable[[], None] | None]:
        """The batch's new blocks copied (one copy) into the staging ring, for the store thread:
        ``(host [m, block_bytes], the copy's event or True, a callback each store calls when
        done)``; the ring's space is given back when every store of the batch is done. ``(None,
        None, None)`` when the batch is larger than the ring (each store then stages its own)."""
        m, bb = packed.shape
        if self._ring is None:
            self._ring = HostRing(max(self.store_ring_bytes, bb), pin=self.device.type == "cuda")
        got = self._ring.take(m * bb)
        if got is None:
            return None, None, None
        view, ticket = got
        host = view.view(m, bb)
        ready: Any = True
        if self.device.type == "cuda":
            if self._d2h is None:
                self._d2h = torch.cuda.Stream(self.device)
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._d2h):
                host.copy_(packed, non_blocking=True)
                packed.record_stream(self._d2h)
                ready = torch.cuda.Event()
                ready.record(self._d2h)
        else:
            host.copy_(packed)
        ring = self._ring
        left = [stores]
        lock = threading.Lock()

        def done() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                ring.give(ticket)

        return host, ready, done
