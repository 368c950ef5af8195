"""A reference engine on Hugging Face ``transformers``: a causal LM that skips cached prefill.

For a prompt, :class:`CachedLM` hashes the full blocks, loads the leading cached ones from the
store, places their KV in a ``DynamicCache`` and runs the model on the uncached suffix only; the
new full blocks go back to the store in the background. At least one prompt token is always
computed (its logits start generation), so at most ``(len - 1) // block_tokens`` blocks load.

On CUDA the load is layer-wise: blocks are copied host-to-device in layer groups on a side
stream, each layer is unpacked there and marks an event, and the model's attention for layer i
waits (on the device, not the host) for layer i's event only, so layer i+1's copy runs while
layer i computes.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

from engine.client import EngineCache
from engine.gpu import ArenaBlocks, HostBlocks
from engine.kvlayout import KVShape, pack, unpack_layer, unpack_layer_into
from kvstore.errors import UsageError


def layer_types_and_windows(cfg: Any) -> tuple[list[str], list[int]]:
    """Each decoder layer's kind (``full_attention``, ``sliding_attention``, ...) and sliding
    window (0 for other kinds) of a Hugging Face text config. transformers' helper returns the
    per-layer arguments as a list of dicts in recent releases and as one dict for every layer in
    earlier 5.x ones; a sliding layer whose arguments name no window takes the config's."""
    types, kwargs = get_layer_types_and_kwargs(cfg)
    types = list(types)
    per = [kwargs] * len(types) if isinstance(kwargs, dict) else list(kwargs or [{}] * len(types))
    default = int(getattr(cfg, "sliding_window", None) or 0)
    windows = [int((kw or {}).get("sliding_window") or default) if t == "sliding_attention" else 0
               for t, kw in zip(types, per, strict=True)]
    return types, windows


def _cache_kw(model: Any) -> str:
    """transformers 5.2x renamed ``past_key_values`` to ``cache``; accept both generations."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def out_cache(out: Any) -> DynamicCache:
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


class PrefixCache(DynamicCache):
    """A DynamicCache whose leading tokens were loaded from the store; each layer's first
    update waits for that layer's load event."""

    def __init__(self, config: Any, events: list[torch.cuda.Event | None]) -> None:
        super().__init__(config=config)
        self._events = events

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        if layer_idx < len(self._events) and self._events[layer_idx] is not None:
            torch.cuda.current_stream(key_states.device).wait_event(self._events[layer_idx])
            self._events[layer_idx] = None
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _set_layer(cache: DynamicCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    while len(cache.layers) <= layer:  # caches built without a config grow on demand
        cache.layers.append(cache.layer_class_to_replicate())
    lay = cache.layers[layer]
    lay.lazy_initialization(k, v)
    lay.keys, lay.values = k, v  # no copy: the tensors the loader fills


@dataclass(frozen=True, slots=True)
class Prefill:
    logits: torch.Tensor
    """Next-token logits after the prompt, float32, ``[vocab]``."""
    cache: DynamicCache
    hit_tokens: int
    computed_tokens: int
    seconds: float


def refuse_non_full_attention(config: Any) -> None:
    """UsageError for a model with any layer that is not full attention (sliding windows,
    chunked attention, linear attention, convolutions): :class:`CachedLM` stores and loads
    every layer's K/V for every token, which such a layer does not keep."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types, _ = layer_types_and_windows(cfg)
    other = sorted({t for t in types if t != "full_attention"})
    if other:
        name = getattr(cfg, "model_type", type(cfg).__name__)
        raise UsageError(
            f"CachedLM serves full-attention models only; this {name} model has "
            f"{', '.join(other)} layers ({sum(t != 'full_attention' for t in types)} of {len(types)}). "
            "Use engine.reference.hybrid.HybridLM, which stores a full part, checkpoint windows and state "
            "(docs/hybrid.md)"
        )


class CachedLM:
    """Wraps a causal LM so that cached prompt prefixes are loaded instead of computed.
    Full-attention models only: a sliding-window, hybrid or recurrent model is refused here
    (:class:`engine.reference.hybrid.HybridLM` serves those)."""

    def __init__(self, model: Any, cache: EngineCache | None, *, layer_groups: int = 4) -> None:
        refuse_non_full_attention(model.config)
        self.model = model.eval()
        self.cache = cache
        self.device = next(model.parameters()).device
        self.layer_groups = max(1, layer_groups)
        self._kw = _cache_kw(model)
        # Logits of the last position only: a 32K-token prompt's full logits are gigabytes.
        params = inspect.signature(model.forward).parameters
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def forward_kwargs(self, kv_cache: Any) -> dict[str, Any]:
        """The keyword arguments of a forward pass over ``kv_cache`` as this wrapper makes it
        (the model's cache argument; last-position logits only where the model takes that)."""
        return {**self._extra, self._kw: kv_cache}

    @property
    def shape(self) -> KVShape:
        assert self.cache is not None
        return self.cache.shape

    @torch.no_grad()
    def prefill(self, input_ids: Any, *, use_cache: bool = True, store: bool = True) -> Prefill:
        t0 = time.perf_counter()
        ids = torch.as_tensor(input_ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ValueError("the prompt is empty")
        kv_cache: DynamicCache = DynamicCache(config=self.model.config)
        hashes: list[bytes] = []
        hit = 0
        loaded: ArenaBlocks | HostBlocks | None = None
        if self.cache is not None and use_cache:
            bt = self.shape.block_tokens
            hashes = self.cache.hashes(ids)
            loaded = self.cache.load(hashes, (ids.numel() - 1) // bt)
            if loaded.num_blocks:
                kv_cache = self._install(loaded)
                hit = loaded.num_blocks * bt
        try:
            return self._run(ids, hit, hashes if store else [], kv_cache, t0)
        finally:
            if loaded is not None:
                # _run synchronised the device: the copies out of the arena are complete.
                loaded.release()

    def _run(self, ids: torch.Tensor, hit: int, hashes: list[bytes], kv_cache: DynamicCache, t0: float) -> Prefill:
        out = self.model(input_ids=ids[hit:].unsqueeze(0).to(self.device), use_cache=True, **self._extra, **{self._kw: kv_cache})
        kv_cache = out_cache(out)
        if self.cache is not None and hashes:
            full = len(hashes)
            start = hit // self.shape.block_tokens
            if full > start:
                keys = [lay.keys for lay in kv_cache.layers]
                values = [lay.values for lay in kv_cache.layers]
                bt = self.shape.block_tokens
                self.cache.store_async(hashes, pack(keys, values, self.shape, start, full), start,
                                       tokens=ids[start * bt:full * bt].numpy())
        logits = out.logits[0, -1].float()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return Prefill(logits, kv_cache, hit, ids.numel() - hit, time.perf_counter() - t0)

    def _install(self, src: ArenaBlocks | HostBlocks) -> DynamicCache:
        """Loaded host blocks -> a cache on the model's device."""
        shape = self.shape
        n_layers = shape.num_layers
        staging = torch.empty((src.num_blocks, shape.block_bytes), dtype=torch.uint8, device=self.device)
        if self.device.type != "cuda":
            cache = DynamicCache(config=self.model.config)
            src.copy_range(staging, 0, shape.block_bytes)
            blocks = staging
            for layer in range(n_layers):
                k, v = unpack_layer(blocks, shape, layer)
                _set_layer(cache, layer, k, v)
            return cache
        events: list[torch.cuda.Event | None] = [None] * n_layers
        cache = PrefixCache(self.model.config, events)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        lb = shape.layer_bytes
        per_group = -(-n_layers // self.layer_groups)
        # K/V are allocated on the compute stream that will read them (the side stream waited for
        # it above), so the caching allocator never hands their memory to the side stream early.
        tokens = src.num_blocks * shape.block_tokens
        kv = [
            tuple(torch.empty((1, shape.kv_heads, tokens, shape.head_dim), dtype=shape.dtype, device=self.device) for _ in range(2))
            for _ in range(n_layers)
        ]
        with torch.cuda.stream(stream):
            for g0 in range(0, n_layers, per_group):
                g1 = min(n_layers, g0 + per_group)
                src.copy_range(staging, g0 * lb, g1 * lb)  # one DMA per run of blocks and group
                for layer in range(g0, g1):
                    k, v = kv[layer]
                    unpack_layer_into(staging, shape, layer, k, v)
                    _set_layer(cache, layer, k, v)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events[layer] = ev
        staging.record_stream(stream)
        return cache

    @torch.no_grad()
    def generate(self, input_ids: Any, max_new_tokens: int, *, use_cache: bool = True) -> tuple[list[int], Prefill]:
        """Greedy decoding; returns the new tokens and the prefill record (TTFT = its seconds)."""
        pre = self.prefill(input_ids, use_cache=use_cache)
        tokens: list[int] = []
        nxt = int(pre.logits.argmax())
        kv_cache = pre.cache
        for _ in range(max_new_tokens):
            tokens.append(nxt)
            if len(tokens) == max_new_tokens:
                break
            out = self.model(input_ids=torch.tensor([[nxt]], device=self.device), use_cache=True, **{self._kw: kv_cache})
            kv_cache = out_cache(out)
            nxt = int(out.logits[0, -1].argmax())
        return tokens, pre
