"""A reference engine for sliding-window and hybrid models: full part + window, bounded replay.

:class:`HybridLM` wraps a ``transformers`` causal LM whose layers are full attention and/or
sliding-window attention (Gemma 2/3, gpt-oss, Mistral with ``sliding_window``). A prefill:

1. hashes the prompt's full blocks (:class:`kvstore.hybrid.HybridNamespaces`);
2. asks how far the full part is cached and finds the nearest checkpoint ``c`` at or before
   that (:func:`kvstore.hybrid.find_checkpoint`);
3. loads the full part of blocks ``0..c`` and checkpoint ``c``'s window into a ``DynamicCache``
   (full layers: every token; sliding layers: the last ``window - 1`` tokens, as
   ``DynamicSlidingWindowLayer`` keeps them);
4. runs the model on every token after the checkpoint: the replay of cached blocks after ``c``
   (at most ``every_blocks - 1`` of them with periodic checkpoints cached) and the new suffix.
   The result equals the uncached prefill: the same KV, computed from the same inputs;
5. stores the full part of the computed blocks and a window at each new checkpoint (the
   prompt's last full block and every ``every_blocks``-th block).

With ``everything=True`` it is the store-everything baseline instead: one namespace with every
layer of every block (what kvstore stores for any model without this split), no replay.

On CUDA with an in-process store the blocks are leased in the DRAM arena and copied to the
device with one 2-D DMA per run of blocks (``engine.gpu``), then unpacked with one strided copy
per layer; the layer-wise overlap of load and compute of ``engine/hf.py`` is not repeated here
(both paths this module compares load the same way).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

from engine.gpu import ArenaBlocks
from engine.hf import _cache_kw, _out_cache
from engine.kvlayout import KVShape, pack, unpack_layer
from kvstore.errors import UsageError
from kvstore.hybrid import CheckpointPolicy, HybridNamespaces, StoreAPI, find_checkpoint
from kvstore.keys import BlockHash, KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.store import KVStore

_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """Which model layers are full attention and which slide, and the KV shape they share."""

    kinds: tuple[str, ...]
    windows: tuple[int, ...]
    """Per layer: the sliding window in tokens (0 for full attention)."""
    kv_heads: int
    head_dim: int

    @property
    def full(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "full"]

    @property
    def sliding(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "sliding"]

    def layout(self, dtype: torch.dtype, block_tokens: int) -> KVLayout:
        """The model's KV layout: a ``full`` group and one ``sliding`` group per window size."""
        groups = []
        if self.full:
            groups.append(LayerGroup("full", len(self.full), self.kv_heads, self.head_dim))
        for w in sorted({w for w in self.windows if w}):
            n = sum(1 for x in self.windows if x == w)
            groups.append(LayerGroup("sliding", n, self.kv_heads, self.head_dim, window=w))
        return KVLayout(str(dtype).removeprefix("torch."), block_tokens, tuple(groups))


def plan_of(config: Any) -> LayerPlan:
    """The layer plan of a Hugging Face decoder config (``layer_types`` or ``sliding_window``)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    _refuse_unsupported(getattr(cfg, "layer_types", None) or ())
    types, kwargs = get_layer_types_and_kwargs(cfg)
    _refuse_unsupported(types)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    windows = tuple(int(kw.get("sliding_window") or 0) if t == "sliding_attention" else 0 for t, kw in zip(types, kwargs, strict=True))
    return LayerPlan(tuple(_KINDS[t] for t in types), windows, kv_heads, head_dim)


def _refuse_unsupported(types: Any) -> None:
    bad = sorted({t for t in types if t not in _KINDS})
    if bad:
        raise UsageError(
            f"layer types {', '.join(bad)} are not supported by the hybrid engine (full_attention "
            "and sliding_attention are); docs/hybrid.md says how recurrent state would fit"
        )


def namespace_of(model: Any, model_id: str, block_tokens: int, **kw: Any) -> Namespace:
    """The model's namespace (every layer group), from its config and parameter dtype."""
    dtype = next(model.parameters()).dtype
    return Namespace(model_id, plan_of(model.config).layout(dtype, block_tokens), **kw)


@dataclass(frozen=True, slots=True)
class HybridPrefill:
    logits: torch.Tensor
    """Next-token logits after the prompt, float32, ``[vocab]``."""
    cache: DynamicCache
    checkpoint: int
    """The block the hit ended on (-1: no hit)."""
    hit_tokens: int
    """Tokens whose KV came from the store."""
    replayed_tokens: int
    """Tokens recomputed although their full part was cached (the bounded replay)."""
    computed_tokens: int
    loaded_bytes: int
    seconds: float
    """Prefill wall time up to the logits (the device synchronised): the TTFT. Stores after it."""
    stored_bytes: int


class HybridLM:
    """A causal LM with sliding-window layers that loads the full part + a window and replays."""

    def __init__(
        self,
        model: Any,
        store: StoreAPI | None,
        ns: Namespace,
        *,
        policy: CheckpointPolicy | None = None,
        everything: bool = False,
    ) -> None:
        self.model = model.eval()
        self.store = store
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.plan = plan_of(model.config)
        if self.plan.layout(self.dtype, ns.block_tokens) != ns.layout:
            raise UsageError(
                f"namespace layout {ns.layout} is not this model's "
                f"{self.plan.layout(self.dtype, ns.block_tokens)}; build it with engine.hybrid.namespace_of"
            )
        self.ns = ns
        self.everything = everything
        self.hyb = HybridNamespaces.of(ns)
        self.policy = policy or CheckpointPolicy()
        self.bt = ns.block_tokens
        self.wn = max(self.plan.windows) - 1 if self.plan.sliding else 0
        self._kw = _cache_kw(model)
        if store is not None:
            if everything:
                store.register_namespace(ns)
            else:
                self.hyb.register(store)

    def _shape(self, layers: int, tokens: int) -> KVShape:
        return KVShape(layers, self.plan.kv_heads, self.plan.head_dim, self.dtype, tokens)

    # ---- loads ----------------------------------------------------------------------------------

    def _fetch(self, ns: Namespace, hashes: list[bytes], held: list[Any]) -> torch.Tensor | None:
        """All of ``hashes``' blocks of ``ns`` on the device as ``[n, block_bytes]`` uint8, or
        None if fewer are cached. On CUDA with an in-process store the blocks are leased in the
        DRAM arena and copied from there with one 2-D DMA per run (``engine.gpu``); the lease
        goes into ``held`` (released once the prefill has synchronised). Otherwise they are
        read into a host buffer (pinned on CUDA) and copied over."""
        store = self.store
        assert store is not None
        n, bb = len(hashes), ns.block_bytes
        if self.device.type == "cuda" and isinstance(store, KVStore):
            try:
                blocks = ArenaBlocks(store, store.acquire(ns, hashes))
            except UsageError:  # no shared-memory tier first: load by copy
                pass
            else:
                held.append(blocks)
                if blocks.num_blocks != n:
                    return None
                dev = torch.empty((n, bb), dtype=torch.uint8, device=self.device)
                blocks.copy_range(dev, 0, bb)
                return dev
        host = torch.empty((n, bb), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        if store.get_into(ns, hashes, host.view(-1).numpy()) != n:
            return None
        return host.to(self.device, non_blocking=True)

    def _load(self, hashes: list[BlockHash], max_hit: int, held: list[Any]) -> tuple[int, torch.Tensor | None, torch.Tensor | None, int]:
        """(checkpoint, full blocks on the device, window on the device, bytes loaded)."""
        hyb, store = self.hyb, self.store
        assert store is not None and hyb.window is not None
        n = store.lookup(hyb.full, hashes[:max_hit]).num_blocks if hyb.full is not None else max_hit
        c = find_checkpoint(store, hyb, hashes, n, self.policy)
        if c < 0:
            return -1, None, None, 0
        # The window first: once it is read, its full part cannot leave before it (its parent),
        # short of expiring in between; a short read of either is a miss, never a wrong hit.
        window = self._fetch(hyb.window, [hyb.window_key(hashes[c])], held)
        if window is None:
            return -1, None, None, 0
        full = None
        if hyb.full is not None:
            full = self._fetch(hyb.full, list(hashes[: c + 1]), held)
            if full is None:
                return -1, None, None, 0
        loaded = window.numel() + (full.numel() if full is not None else 0)
        return c, full, window.view(-1), loaded

    def _load_everything(self, hashes: list[BlockHash], max_hit: int, held: list[Any]) -> tuple[int, torch.Tensor | None, int]:
        assert self.store is not None
        n = self.store.lookup(self.ns, hashes[:max_hit]).num_blocks
        blocks = self._fetch(self.ns, list(hashes[:n]), held) if n else None
        if blocks is None:
            return 0, None, 0
        return n, blocks, blocks.numel()

    # ---- the cache ------------------------------------------------------------------------------

    def _install(self, cache: DynamicCache, layer: int, k: torch.Tensor, v: torch.Tensor, tokens: int) -> None:
        lay = cache.layers[layer]
        lay.lazy_initialization(k, v)
        lay.keys, lay.values = k, v
        if self.plan.kinds[layer] == "sliding":
            lay.cumulative_length = tokens

    def _build(self, blocks: torch.Tensor | None, window: torch.Tensor | None, tokens: int) -> DynamicCache:
        """A cache holding ``tokens`` tokens: full layers from ``blocks`` (layer-major blocks of
        the full layers, or of every layer with ``everything``), sliding layers from ``window``
        (or from the last blocks with ``everything``)."""
        cache = DynamicCache(config=self.model.config)
        if not tokens:
            return cache
        keep = min(self.wn, tokens)
        if self.everything:
            assert blocks is not None
            shape = self._shape(len(self.plan.kinds), self.bt)
            for layer, kind in enumerate(self.plan.kinds):
                k, v = unpack_layer(blocks, shape, layer)
                if kind == "sliding":
                    k, v = k[:, :, -keep:].contiguous(), v[:, :, -keep:].contiguous()
                self._install(cache, layer, k, v, tokens)
            return cache
        if blocks is not None:
            shape = self._shape(len(self.plan.full), self.bt)
            for j, layer in enumerate(self.plan.full):
                self._install(cache, layer, *unpack_layer(blocks, shape, j), tokens)
        assert window is not None
        w = window.view(self.dtype).view(len(self.plan.sliding), 2, 1, self.plan.kv_heads, self.wn, self.plan.head_dim)
        for j, layer in enumerate(self.plan.sliding):
            self._install(cache, layer, w[j, 0, :, :, -keep:].contiguous(), w[j, 1, :, :, -keep:].contiguous(), tokens)
        return cache

    # ---- prefill --------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: Any, *, use_cache: bool = True, store: bool = True) -> HybridPrefill:
        t0 = time.perf_counter()
        ids = torch.as_tensor(input_ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ValueError("the prompt is empty")
        bt = self.bt
        cached = use_cache and self.store is not None
        hashes = (self.hyb.hashes(ids) if not self.everything else hash_blocks(self.ns, ids)) if cached or store else []
        max_hit = (ids.numel() - 1) // bt  # one token is always computed: its logits
        c, blocks, window, loaded = -1, None, None, 0
        n_full = 0
        held: list[Any] = []  # leases on the arena, until the device has copied out of it
        try:
            if cached and max_hit:
                if self.everything:
                    n, blocks, loaded = self._load_everything(hashes, max_hit, held)
                    c = n - 1
                    n_full = n
                else:
                    c, blocks, window, loaded = self._load(hashes, max_hit, held)
                    if c >= 0 and self.hyb.full is not None:
                        n_full = self.store.lookup(self.hyb.full, hashes[:max_hit]).num_blocks  # type: ignore[union-attr]
            hit = (c + 1) * bt
            cache = self._build(blocks, window, hit)
            for layer in self.plan.sliding:
                cache.layers[layer].activate_past_recording()  # keep the suffix's window states to store
            out = self.model(input_ids=ids[hit:].unsqueeze(0).to(self.device), use_cache=True, logits_to_keep=1, **{self._kw: cache})
            cache = _out_cache(out)
            logits = out.logits[0, -1].float()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            for lease in held:
                lease.release()
        seconds = time.perf_counter() - t0
        stored = self._store(cache, hashes, c, hit) if store and self.store is not None else 0
        for layer in self.plan.sliding:
            lay = cache.layers[layer]
            lay.record_past = False
            lay.keys, lay.values = lay.keys[:, :, -self.wn :], lay.values[:, :, -self.wn :]
        replayed = max(0, n_full * bt - hit)
        return HybridPrefill(logits, cache, c, hit, replayed, ids.numel() - hit, loaded, seconds, stored)

    def _store(self, cache: DynamicCache, hashes: list[BlockHash], c: int, hit: int) -> int:
        """Put what this prefill computed; returns the payload bytes that were new."""
        store = self.store
        assert store is not None
        n = len(hashes)
        if n <= c + 1:
            return 0
        layers = cache.layers
        # Position of each layer's first cached token: sliding layers start at the loaded window.
        first = {layer: hit - min(self.wn, hit) for layer in self.plan.sliding}
        sel = list(range(len(self.plan.kinds))) if self.everything else self.plan.full
        new_bytes = 0
        if sel:
            t0, t1 = (c + 1) * self.bt, n * self.bt
            keys = [layers[i].keys[:, :, t0 - first.get(i, 0) : t1 - first.get(i, 0)] for i in sel]
            values = [layers[i].values[:, :, t0 - first.get(i, 0) : t1 - first.get(i, 0)] for i in sel]
            blocks = pack(keys, values, self._shape(len(sel), self.bt), 0, n - c - 1).cpu()
            ns = self.ns if self.everything else self.hyb.full
            assert ns is not None
            new_bytes += store.put(ns, hashes, blocks.numpy(), start=c + 1) * ns.block_bytes
        if self.everything:
            return new_bytes
        wns = self.hyb.window
        assert wns is not None
        for p in self.policy.new_checkpoints(c + 1, n - 1):
            payload = self._window(cache, first, (p + 1) * self.bt).cpu()
            chain = self.hyb.window_chain(hashes, p)
            new_bytes += store.put(wns, chain, payload.numpy(), start=len(chain) - 1) * wns.block_bytes
        return new_bytes

    def _window(self, cache: DynamicCache, first: dict[int, int], boundary: int) -> torch.Tensor:
        """The window payload at a block boundary: ``[sliding layers][K, V][heads][wn][dim]``,
        zero-padded in front when fewer than ``wn`` tokens precede the boundary."""
        ls, h, d, wn = len(self.plan.sliding), self.plan.kv_heads, self.plan.head_dim, self.wn
        out = torch.zeros((ls, 2, h, wn, d), dtype=self.dtype, device=self.device)
        lo = max(0, boundary - wn)
        for j, layer in enumerate(self.plan.sliding):
            lay, off = cache.layers[layer], first[layer]
            out[j, 0, :, wn - (boundary - lo) :] = lay.keys[0, :, lo - off : boundary - off]
            out[j, 1, :, wn - (boundary - lo) :] = lay.values[0, :, lo - off : boundary - off]
        return out.view(-1).view(torch.uint8)

    @torch.no_grad()
    def generate(self, input_ids: Any, max_new_tokens: int, *, use_cache: bool = True) -> tuple[list[int], HybridPrefill]:
        """Greedy decoding; returns the new tokens and the prefill record."""
        pre = self.prefill(input_ids, use_cache=use_cache)
        tokens: list[int] = []
        nxt = int(pre.logits.argmax())
        cache = pre.cache
        for _ in range(max_new_tokens):
            tokens.append(nxt)
            if len(tokens) == max_new_tokens:
                break
            out = self.model(input_ids=torch.tensor([[nxt]], device=self.device), use_cache=True, **{self._kw: cache})
            cache = _out_cache(out)
            nxt = int(out.logits[0, -1].argmax())
        return tokens, pre


def window_bytes_per_token(ns: Namespace, context: int, policy: CheckpointPolicy) -> dict[str, float]:
    """Exact payload bytes per cached token of one chain of ``context`` tokens, stored once
    (periodic checkpoints + one at the end) against storing every layer of every block."""
    hyb = HybridNamespaces.of(ns)
    n = context // ns.block_tokens
    ckpts = len(policy.new_checkpoints(0, n - 1)) if n else 0
    full = n * hyb.full.block_bytes if hyb.full is not None else 0
    window = ckpts * hyb.window.block_bytes if hyb.window is not None else 0
    every = n * ns.block_bytes
    tokens = n * ns.block_tokens
    return {
        "checkpoints": float(ckpts),
        "hybrid_bytes_per_token": (full + window) / tokens,
        "everything_bytes_per_token": every / tokens,
        "ratio": (full + window) / every,
    }

