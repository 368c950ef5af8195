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
   prompt's last full block, every ``every_blocks``-th block and, after a replay, the block the
   hit's full part ended on: ``CheckpointPolicy.at_hits``).

With ``everything=True`` it is the store-everything baseline instead: one namespace with every
layer of every block (what kvstore stores for any model without this split), no replay.

On CUDA, from a store with a shared-memory arena, the blocks are leased there and copied to the
device on a load stream, layer group by layer group (one 2-D DMA per run of blocks, ``engine.gpu``),
then unpacked with one strided copy per layer; decoder layer i waits on the device for its own
layers' load only (a forward pre-hook), so loads overlap compute as in ``engine/reference/hf.py``. Both
paths this module compares (the split and store-everything) load the same way; store-everything
loads every layer of every block (``all_layers=True``, as a store-everything connector does) or
only what the model reads. On CUDA the model runs with FlashAttention-2 (``attention="auto"``:
:func:`_flash_window`, the sliding window as FlashAttention's left window). ``HybridPrefill.phases``
splits the TTFT's host time; ``trace=True`` records a per-layer device timeline.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache

from engine.gpu import ArenaBlocks, HostBlocks
from engine.kvlayout import KVShape, pack, unpack_layer, unpack_layer_into
from engine.reference.hf import _cache_kw, layer_types_and_windows, out_cache
from kvstore.errors import MissingPrefixError, UsageError
from kvstore.hybrid import CheckpointPolicy, HybridNamespaces, StoreAPI, lookup
from kvstore.keys import BlockHash, KVLayout, LayerGroup, Namespace, hash_blocks

log = logging.getLogger(__name__)

_KINDS = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "linear_attention": "recurrent",  # gated delta net (Qwen3-Next): conv + recurrent state
    "conv": "recurrent",  # short convolutions (LFM2): conv state
}


_FLASH = "kvstore_flash_window"
_CU: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _cu_seqlens(q: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[0, q]`` and ``[0, k]`` as int32 device tensors, made once per size on the device itself
    (``torch.tensor(..., device=...)`` inside a forward would be a host-to-device copy that
    synchronises the host with the compute stream, every layer)."""
    key = (q, k, str(device))
    hit = _CU.get(key)
    if hit is None:
        if len(_CU) > 256:
            _CU.clear()
        two = torch.arange(2, dtype=torch.int32, device=device)
        hit = _CU[key] = (two * q, two * k)
    return hit


def _flash_window(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface (CUDA): one FlashAttention-2 call for one sequence, causal
    aligned bottom-right (the new tokens after a cached prefix), and for a sliding layer a left
    window of ``sliding_window - 1`` keys (transformers' sliding mask: key j is seen by query i
    when ``i - W < j <= i``). ``query`` ``[1, Hq, S, D]``, ``key``/``value`` ``[1, Hkv, K, D]``;
    returns ``[1, S, Hq, D]``. No mask is built for it (not a mask-interface name)."""
    if query.shape[0] != 1:
        raise UsageError(f"attention {_FLASH!r} takes one sequence, not a batch of {query.shape[0]}")
    s, k = query.shape[2], key.shape[2]
    cu_q, cu_k = _cu_seqlens(s, k, query.device)
    window = sliding_window - 1 if sliding_window else None
    out = torch.ops.aten._flash_attention_forward(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_q, cu_k, s, k, 0.0, True, False,
        scale=scaling, window_size_left=window, window_size_right=0 if window is not None else None,
    )[0]
    return out.unsqueeze(0), None


AttentionInterface.register(_FLASH, _flash_window)

_CUDNN = "kvstore_cudnn_full"
_CUDNN_OK: dict[str, str] = {}  # device -> "gqa" | "expand" | "" (the self-check's verdict)


def _cudnn_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
                expand: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN attention of ``q`` ``[1, Hq, S, D]`` over ``k``/``v`` ``[1, Hkv, T, D]``: the output and
    its log-sum-exp ``[1, Hq, S]`` (``causal``: top-left aligned, for the square part only)."""
    if expand > 1:
        k, v = k.repeat_interleave(expand, 1), v.repeat_interleave(expand, 1)
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q.shape[0], q.shape[1], q.shape[2])


def _cudnn_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, mode: str) -> torch.Tensor:
    """Bottom-right causal attention of ``S`` queries over ``T >= S`` keys with cuDNN, exactly: the
    queries see every key before them (``T - S`` keys, no mask) and their own square block
    causally (where top-left and bottom-right agree); the two parts are merged by their
    log-sum-exp. Returns ``[1, S, Hq, D]``. (cuDNN's own ``is_causal`` aligns top-left: wrong
    for a prefill after a cached prefix; ``python -m tools.lab.probes.hybrid_kernels attention`` checks it.)"""
    s, t = q.shape[2], k.shape[2]
    expand = q.shape[1] // k.shape[1] if mode == "expand" else 1
    o2, l2 = _cudnn_part(q, k[:, :, t - s :], v[:, :, t - s :], True, scale, expand)
    if t == s:
        return o2.transpose(1, 2)
    o1, l1 = _cudnn_part(q, k[:, :, : t - s], v[:, :, : t - s], False, scale, expand)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m).unsqueeze(-1), torch.exp(l2 - m).unsqueeze(-1)
    out = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
    return out.to(q.dtype).transpose(1, 2)


def _cudnn_window(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface (CUDA): full layers with cuDNN (:func:`_cudnn_full`, 1.6-1.9x
    FlashAttention-2's rate over a 32K prefix on the H200), sliding layers with
    :func:`_flash_window`; the same semantics as that one."""
    mode = _CUDNN_OK.get(str(query.device), "")
    if sliding_window or not mode or query.shape[0] != 1:
        return _flash_window(module, query, key, value, attention_mask, scaling, dropout, sliding_window, **kwargs)
    return _cudnn_full(query, key, value, scaling, mode), None


AttentionInterface.register(_CUDNN, _cudnn_window)


def cudnn_check(device: torch.device) -> str:
    """Whether :func:`_cudnn_full` gives FlashAttention-2's answer on ``device`` (once per device,
    before any forward: random inputs of a prefill's layout, 4 query heads per KV head): "gqa"
    (cuDNN takes the KV heads as they are), "expand" (they must be repeated first), or "" (not
    usable here: FlashAttention-2 stays)."""
    key = str(device)
    if key in _CUDNN_OK:
        return _CUDNN_OK[key]
    verdict = ""
    if device.type == "cuda":
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn((1, 200, 8, 64), device=device, dtype=torch.bfloat16, generator=g).transpose(1, 2)
        k = torch.randn((1, 2, 1000, 64), device=device, dtype=torch.bfloat16, generator=g)
        v = torch.randn((1, 2, 1000, 64), device=device, dtype=torch.bfloat16, generator=g)
        ref = _flash_window(None, q, k, v, None, 0.125)[0].float()
        for mode in ("gqa", "expand"):
            try:
                out = _cudnn_full(q, k, v, 0.125, mode).float()
            except RuntimeError as e:  # this torch/cuDNN refuses the call: try the next form
                log.info("cuDNN attention (%s) refused: %s", mode, e)
                continue
            if float((out - ref).norm() / ref.norm()) < 1e-2:
                verdict = mode
                break
    _CUDNN_OK[key] = verdict
    return verdict

_WINDOW = "kvstore_sdpa_window"


def _sdpa_window(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                 scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface (any device): :func:`_flash_window`'s semantics (one
    sequence, causal aligned bottom-right, key j seen by query i when ``i - W < j <= i``) with
    SDPA and a mask built from the shapes alone, never from the model's mask: the dependency
    cone (:func:`cone_starts`) gives each layer fewer queries than the model's mask was made for."""
    s, k = query.shape[2], key.shape[2]
    i = torch.arange(s, device=query.device)[:, None] + (k - s)
    j = torch.arange(k, device=query.device)[None, :]
    mask = j <= i
    if sliding_window:
        mask &= j > i - sliding_window
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(_WINDOW, _sdpa_window)


def cone_starts(kinds: tuple[str, ...] | list[str], window: int, start: int, end: int, kv_from: int) -> list[int]:
    """The dependency cone of a replay: per layer, the first position whose layer input must be
    computed, when positions ``start..end-1`` replay (their full layers' KV cached, the sliding
    layers' KV cached only before ``start``) and every position from ``end`` on is new.

    From the top layer down: a full layer needs its input only where its output is needed (its
    KV before ``end`` is cached); a sliding layer of window ``W`` also needs its input for the
    ``W - 1`` keys before the first query it must output, and for every position from
    ``kv_from`` on (the window pieces this prefill stores); no layer starts before ``start``.
    The top full layers need no replayed position at all."""
    x, out = end, [0] * len(kinds)
    for j in range(len(kinds) - 1, -1, -1):
        if kinds[j] == "sliding":
            x = max(start, min(x - (window - 1), kv_from))
        out[j] = x
    return out


@dataclass(frozen=True, slots=True)
class StateSlot:
    """One tensor of a recurrent layer's cache state (fixed shape, whatever the length)."""

    layer: int
    kind: str
    """``conv`` or ``recurrent`` (the two state dicts of transformers' linear-attention layers)."""
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """Which model layers are full attention, which slide and which are recurrent, the KV shape
    the attention layers share and the recurrent layers' state tensors."""

    kinds: tuple[str, ...]
    windows: tuple[int, ...]
    """Per layer: the sliding window in tokens (0 for other layers)."""
    kv_heads: int
    head_dim: int
    states: tuple[StateSlot, ...] = ()

    @property
    def full(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "full"]

    @property
    def sliding(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "sliding"]

    @property
    def recurrent(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "recurrent"]

    @property
    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.states)

    def layout(self, dtype: torch.dtype, block_tokens: int) -> KVLayout:
        """The model's KV layout: a ``full`` group, one ``sliding`` group per window size and a
        ``recurrent`` group sized by the state tensors."""
        groups = []
        if self.full:
            groups.append(LayerGroup("full", len(self.full), self.kv_heads, self.head_dim))
        for w in sorted({w for w in self.windows if w}):
            n = sum(1 for x in self.windows if x == w)
            groups.append(LayerGroup("sliding", n, self.kv_heads, self.head_dim, window=w))
        if self.recurrent:
            per_layer = {layer: 0 for layer in self.recurrent}
            for slot in self.states:
                per_layer[slot.layer] += slot.nbytes
            sizes = set(per_layer.values())
            if len(sizes) != 1 or 0 in sizes or next(iter(sizes)) % dtype.itemsize:
                raise UsageError(f"recurrent layers with state sizes {sorted(sizes)} bytes: one size per model is supported")
            groups.append(LayerGroup("recurrent", len(self.recurrent), latent_dim=sizes.pop() // dtype.itemsize))
        return KVLayout(str(dtype).removeprefix("torch."), block_tokens, tuple(groups))


def plan_of(config: Any) -> LayerPlan:
    """The layer plan of a Hugging Face decoder config (``layer_types`` or ``sliding_window``),
    without the recurrent layers' state tensors (:func:`model_plan` finds those)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    _refuse_unsupported(getattr(cfg, "layer_types", None) or ())
    types, windows = layer_types_and_windows(cfg)
    _refuse_unsupported(types)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return LayerPlan(tuple(_KINDS[t] for t in types), tuple(windows), kv_heads, head_dim)


def model_plan(model: Any) -> LayerPlan:
    """:func:`plan_of` plus the state tensors of the recurrent layers, read off a one-token run."""
    plan = plan_of(model.config)
    if not plan.recurrent:
        return plan
    device = next(model.parameters()).device
    kw = _cache_kw(model)
    with torch.no_grad():
        out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True, **{kw: DynamicCache(config=model.config)})
    cache = out_cache(out)
    slots = []
    for layer in plan.recurrent:
        lay = cache.layers[layer]
        for i in range(lay.number_of_states):
            for kind, tensors, ready in (("conv", lay.conv_states, lay.is_conv_states_initialized), ("recurrent", lay.recurrent_states, lay.is_recurrent_states_initialized)):
                if ready[i]:
                    slots.append(StateSlot(layer, kind, i, tuple(tensors[i].shape), tensors[i].dtype))
    return replace(plan, states=tuple(slots))


def _refuse_unsupported(types: Any) -> None:
    bad = sorted({t for t in types if t not in _KINDS})
    if bad:
        raise UsageError(
            f"layer types {', '.join(bad)} are not supported by the hybrid engine (full_attention, "
            f"sliding_attention, linear_attention and conv are)"
        )


def namespace_of(model: Any, model_id: str, block_tokens: int, **kw: Any) -> Namespace:
    """The model's namespace (every layer group), from its layers and parameter dtype."""
    dtype = next(model.parameters()).dtype
    return Namespace(model_id, model_plan(model).layout(dtype, block_tokens), **kw)


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
    phases: dict[str, float] = field(default_factory=dict)
    """Host milliseconds per phase of the TTFT: ``hash``, ``lookup`` (finding the checkpoint),
    ``fetch`` (leases or reads), ``issue`` (installing the cache and queueing its loads),
    ``forward`` (issuing the model), ``sync`` (waiting for the device); ``copies``: host-to-device
    copy calls queued; ``moved_bytes``: the bytes they move."""
    cone: tuple[int, ...] = ()
    """With the dependency cone (a replay): positions each decoder layer computed (new tokens
    included); empty when every layer computed every position after the checkpoint."""
    timeline: dict[str, Any] | None = None
    """With ``HybridLM.trace`` on CUDA: per decoder layer, device milliseconds from the prefill's
    start until its load completed (``load_ms``, None: nothing to load), its compute started
    (``start_ms``) and ended (``end_ms``); ``end_ms`` of the last layer is the forward's end."""


@dataclass(slots=True)
class _Loaded:
    """A checkpoint's parts, still where the store holds them (a lease on the arena, or a host
    buffer): :meth:`HybridLM._build` moves them to the device layer group by layer group."""

    checkpoint: int
    cached_blocks: int
    """Leading blocks whose full part is cached (the hit before rounding down to a checkpoint)."""
    full: ArenaBlocks | HostBlocks | None = None
    window: ArenaBlocks | HostBlocks | None = None
    state: ArenaBlocks | HostBlocks | None = None
    nbytes: int = 0

    def tokens(self, block_tokens: int) -> int:
        return (self.checkpoint + 1) * block_tokens


class HybridLM:
    """A causal LM with sliding-window and/or recurrent layers: loads a checkpoint's full part,
    window pieces and state, and replays the blocks after it."""

    def __init__(
        self,
        model: Any,
        store: StoreAPI | None,
        ns: Namespace,
        *,
        policy: CheckpointPolicy | None = None,
        everything: bool = False,
        layer_groups: int = 16,
        all_layers: bool = True,
        attention: str = "auto",
        trace: bool = False,
        cone: bool = True,
    ) -> None:
        """``all_layers`` (with ``everything``): load every layer of every cached block, as a
        store-everything connector does; False: only what the model reads, the full layers of
        every block and the sliding layers' last window (the best a store-everything engine
        can do). ``attention``: ``"model"`` (the model's own), ``"flash"`` (CUDA:
        FlashAttention-2 with bottom-right causal alignment and the sliding window, no mask
        tensor: :func:`_flash_window`), ``"cudnn"`` (CUDA: the full layers with cuDNN, exact
        bottom-right causal by a split and a log-sum-exp merge, :func:`_cudnn_full`; the
        sliding ones with FlashAttention-2), ``"auto"``: cudnn on CUDA for a model it covers (no
        logit soft-capping, no attention sinks) where :func:`cudnn_check` passes, else flash,
        else the model's. ``trace``: record the
        per-layer timeline (CUDA events) in :attr:`HybridPrefill.timeline`. ``cone``: a replay
        computes only its dependency cone (:func:`cone_starts`: each layer the positions the
        layers above and the stored windows need; the full part is loaded up to the hit's end),
        for models whose attention :func:`_flash_window` / :func:`_sdpa_window` cover, with one
        window size and no recurrent layers; otherwise every layer replays every position."""
        self.model = model.eval()
        self.store = store
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.plan = model_plan(model)
        if everything and self.plan.recurrent:
            raise UsageError("recurrent state has no per-block form to store everything with; use the hybrid split")
        if self.plan.layout(self.dtype, ns.block_tokens) != ns.layout:
            raise UsageError(
                f"namespace layout {ns.layout} is not this model's "
                f"{self.plan.layout(self.dtype, ns.block_tokens)}; build it with engine.reference.hybrid.namespace_of"
            )
        self.ns = ns
        self.everything = everything
        self.hyb = HybridNamespaces.of(ns)
        self.policy = policy or CheckpointPolicy()
        self.bt = ns.block_tokens
        self.wn = max(self.plan.windows) - 1 if self.plan.sliding else 0
        self._kw = _cache_kw(model)
        # Leases (zero-copy reads from the store's shared-memory arena) for a CUDA device.
        self._leases = self.device.type == "cuda" and hasattr(store, "acquire")
        self.layer_groups = max(1, layer_groups)
        if attention not in ("auto", "model", "flash", "cudnn"):
            raise UsageError(f"attention must be 'auto', 'model', 'flash' or 'cudnn', not {attention!r}")
        if attention in ("flash", "cudnn"):
            _refuse_flash(model, self.device)
            if attention == "cudnn" and not cudnn_check(self.device):
                raise UsageError("attention='cudnn': cuDNN attention is not usable on this device/torch; use 'flash'")
        elif attention == "auto":
            attention = "flash" if _flash_covers(model, self.device) else "model"
            if attention == "flash" and cudnn_check(self.device):
                attention = "cudnn"
        self.all_layers = all_layers
        self.attention = attention
        self.trace = trace
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._events: list[Any] = []
        self._marks: list[list[Any]] = []
        self._copies = self._moved = 0
        self._hooks = []
        decoder = getattr(model.base_model, "layers", None)
        layered = decoder is not None and len(decoder) == len(self.plan.kinds)
        if self._stream is not None and layered:
            self._hooks = [m.register_forward_pre_hook(partial(self._wait, i)) for i, m in enumerate(decoder)]
            self._hooks += [m.register_forward_hook(partial(self._done, i)) for i, m in enumerate(decoder)]
        self.cone = (cone and layered and not everything and not self.plan.recurrent and bool(self.plan.full)
                     and bool(self.plan.sliding) and len({w for w in self.plan.windows if w}) == 1
                     and _attention_covers(model))
        self._cone: tuple[list[int], int] | None = None  # (first position per layer, prompt length) in a cone forward
        self._cone_rows: list[int] = []
        self._skips: dict[int, int] = {}  # full layer -> positions its cone computes whose KV is loaded
        self._room = 0
        if self.cone:
            self._hooks += [m.register_forward_pre_hook(partial(self._slice, i), with_kwargs=True) for i, m in enumerate(decoder)]
        if store is not None:
            if everything:
                store.register_namespace(ns)
            else:
                self.hyb.register(store)

    def close(self) -> None:
        """Remove the forward pre-hooks this engine put on the model's decoder layers (CUDA):
        they hold the engine, so an engine made for a while over a long-lived model calls this."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _shape(self, layers: int, tokens: int) -> KVShape:
        return KVShape(layers, self.plan.kv_heads, self.plan.head_dim, self.dtype, tokens)

    # ---- loads ----------------------------------------------------------------------------------

    def _fetch(self, ns: Namespace, hashes: list[bytes], held: list[Any], got: _Loaded) -> ArenaBlocks | HostBlocks | None:
        """All of ``hashes``' blocks of ``ns``, where they are, or None if fewer are cached. On
        CUDA, from a store with a shared-memory arena (in process or a same-node daemon), they
        stay in the arena, held by a lease that goes into ``held`` (released once the prefill
        has synchronised), and are copied from there with one 2-D DMA per run and layer group
        (``engine.gpu``). Otherwise they are read into a host buffer (pinned on CUDA)."""
        store = self.store
        assert store is not None
        n, bb = len(hashes), ns.block_bytes
        if self._leases:
            try:
                blocks = ArenaBlocks(store, store.acquire(ns, hashes))
            except UsageError:  # no shared-memory tier first: load by copy from now on
                self._leases = False
            else:
                held.append(blocks)
                if blocks.num_blocks != n:
                    return None
                got.nbytes += n * bb
                return blocks
        host = torch.empty((n, bb), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        if store.get_into(ns, hashes, host.view(-1).numpy()) != n:
            return None
        got.nbytes += n * bb
        return HostBlocks(host)

    def _load(self, hashes: list[BlockHash], max_hit: int, held: list[Any], marks: list[float]) -> _Loaded | None:
        """The nearest checkpoint's parts on the device, or None (no checkpoint is cached)."""
        hyb, store = self.hyb, self.store
        assert store is not None
        where = lookup(store, hyb, hashes[:max_hit], self.policy)
        marks.append(time.perf_counter())
        c = where.checkpoint
        if c < 0:
            return None
        # The parts may leave between the lookup and the reads (eviction, expiry): a short read
        # of any of them is a miss, never a wrong hit.
        got = _Loaded(c, where.full_blocks)
        if hyb.window is not None:
            got.window = self._fetch(hyb.window, [hyb.window_key(hashes[j]) for j in hyb.checkpoint_blocks(c)], held, got)
            if got.window is None:
                return None
        if hyb.state is not None:
            got.state = self._fetch(hyb.state, [hyb.state_key(hashes[c])], held, got)
            if got.state is None:
                return None
        if hyb.full is not None:  # with the cone, through the hit's end: no full layer replays
            n = where.full_blocks if self.cone and not self.everything else c + 1
            got.full = self._fetch(hyb.full, list(hashes[:n]), held, got)
            if got.full is None:
                return None
        return got

    def _load_everything(self, hashes: list[BlockHash], max_hit: int, held: list[Any], marks: list[float]) -> _Loaded | None:
        assert self.store is not None
        n = self.store.lookup(self.ns, hashes[:max_hit]).num_blocks
        marks.append(time.perf_counter())
        got = _Loaded(n - 1, n)
        got.full = self._fetch(self.ns, list(hashes[:n]), held, got) if n else None
        return None if got.full is None else got

    # ---- the cache ------------------------------------------------------------------------------

    def _install(self, cache: DynamicCache, layer: int, k: torch.Tensor, v: torch.Tensor, tokens: int) -> None:
        lay = cache.layers[layer]
        lay.lazy_initialization(k, v)
        lay.keys, lay.values = k, v
        if self.plan.kinds[layer] == "sliding":
            lay.cumulative_length = tokens

    def _build(self, got: _Loaded | None) -> DynamicCache:
        """A cache holding the loaded checkpoint: full layers from the full part (or, with
        ``everything``, every layer from every block), sliding layers the last ``window - 1``
        tokens of the window pieces, recurrent layers their state.

        The K/V tensors are installed at once but filled on the load stream (CUDA), layer group
        by layer group: one copy of the group's bytes of every block (2-D DMAs out of the arena),
        then one strided unpack per layer, then that layer's event in ``self._events``; the
        model's layer i waits on the device for event i only (a forward pre-hook), so the
        loads of later layers run under the compute of earlier ones (as ``engine/reference/hf.py``)."""
        cache = DynamicCache(config=self.model.config)
        self._events = [None] * len(self.plan.kinds)
        if got is None:
            return cache
        tokens = got.tokens(self.bt)
        keep = min(self.wn, tokens)
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.everything:
            assert got.full is not None
            self._fill(cache, got.full, list(range(len(self.plan.kinds))), tokens, keep, stream)
        else:
            # The window first: it is a few blocks, and the first layer may be a sliding one (on
            # one stream, the window behind the whole full part would hold the model back).
            if got.window is not None:  # the pieces of the last blocks: layer-major, like the full part
                self._fill(cache, got.window, self.plan.sliding, tokens, keep, stream)
            if got.full is not None:
                self._fill(cache, got.full, self.plan.full, tokens, keep, stream)
        if got.state is not None:  # one small block: on the compute stream, before the model
            raw = torch.empty((1, got.state.block(0).numel()), dtype=torch.uint8, device=self.device)
            got.state.copy_into(raw, 0, raw.shape[1])
            raw, off = raw.view(-1), 0
            for slot in self.plan.states:
                t = raw[off : off + slot.nbytes].view(slot.dtype).view(slot.shape).clone()
                off += slot.nbytes
                lay = cache.layers[slot.layer]
                if slot.kind == "conv":  # on a fresh layer: initialised, marked as having a past
                    lay.update_conv_state(t, state_idx=slot.index, conv_kernel_size=slot.shape[-1])
                else:
                    lay.update_recurrent_state(t, state_idx=slot.index)
            for layer in self.plan.recurrent:
                _set_linear_length(cache.layers[layer], tokens)
        if stream is not None and not self._hooks:  # no per-layer hooks on this model: wait for all
            torch.cuda.current_stream(self.device).wait_stream(stream)
        return cache

    def _fill(self, cache: DynamicCache, src: ArenaBlocks | HostBlocks, layers: list[int], tokens: int, keep: int,
              stream: torch.cuda.Stream | None) -> None:
        """Layers ``layers`` (model indices, in the part's layer order) of the part ``src`` into
        ``cache``; sliding layers keep their last ``keep`` tokens.

        Layer groups of up to ``len(layers) / layer_groups`` consecutive layers are copied into a
        device buffer (one 2-D DMA per run of blocks: rows of a group's bytes of a block, large
        enough for the link's full rate) and unpacked with one strided copy per layer. A sliding
        layer reads only its last blocks; with ``everything`` and ``all_layers`` its group still
        copies every block, as a connector that loads every layer would."""
        n = src.num_blocks
        shape = self._shape(len(layers), self.bt)
        lb, bt = shape.layer_bytes, self.bt
        kb = min(n, -(-keep // bt))  # blocks that hold a sliding layer's last ``keep`` tokens
        dst = {}
        for layer in layers:
            if self.plan.kinds[layer] == "sliding":
                k = torch.empty((1, shape.kv_heads, keep, shape.head_dim), dtype=self.dtype, device=self.device)
                dst[layer] = (k, torch.empty_like(k))
            else:  # room for this prefill's new tokens: they are written in place, not concatenated
                t = n * bt
                kbuf = torch.empty((1, shape.kv_heads, t + self._room, shape.head_dim), dtype=self.dtype, device=self.device)
                vbuf = torch.empty_like(kbuf)
                dst[layer] = (kbuf[:, :, :t], vbuf[:, :, :t])
                cache.layers[layer].update = partial(_in_place_update, cache.layers[layer], kbuf, vbuf, self._skips, layer)
            self._install(cache, layer, *dst[layer], tokens)
        # Each layer's first block: a group is consecutive layers with the same first block.
        firsts = [n - kb if self.plan.kinds[layer] == "sliding" and not (self.everything and self.all_layers) else 0
                  for layer in layers]
        per_group = -(-len(layers) // self.layer_groups)
        groups: list[tuple[int, int]] = []
        for j in range(len(layers)):
            if groups and j - groups[-1][0] < per_group and firsts[j] == firsts[groups[-1][0]]:
                groups[-1] = (groups[-1][0], j + 1)
            else:
                groups.append((j, j + 1))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for g0, g1 in groups:
                first = firsts[g0]
                staging = torch.empty((n - first, (g1 - g0) * lb), dtype=torch.uint8, device=self.device)
                self._copies += src.copy_into(staging, g0 * lb, g1 * lb, first)
                self._moved += staging.numel()
                for j in range(g0, g1):
                    layer = layers[j]
                    k, v = dst[layer]
                    if self.plan.kinds[layer] == "sliding":
                        kk, vv = unpack_layer(staging[staging.shape[0] - kb :], shape, j - g0)
                        k.copy_(kk[:, :, -keep:])
                        v.copy_(vv[:, :, -keep:])
                    else:
                        unpack_layer_into(staging, shape, j - g0, k, v)
                    self._loaded(layer, stream)

    def _loaded(self, layer: int, stream: torch.cuda.Stream | None) -> None:
        """Layer ``layer``'s load is queued on ``stream``: its event (and, tracing, its mark)."""
        if stream is None:
            return
        ev = torch.cuda.Event(enable_timing=self.trace)
        ev.record(stream)
        self._events[layer] = ev
        if self._marks:
            self._marks[layer][0] = ev

    def _wait(self, layer: int, module: Any, args: Any) -> None:
        """Forward pre-hook of decoder layer ``layer``: the compute stream waits for its load."""
        ev = self._events[layer] if layer < len(self._events) else None
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
            self._events[layer] = None
        if self._marks:
            self._marks[layer][1] = self._mark()

    def _done(self, layer: int, module: Any, args: Any, output: Any) -> None:
        """Forward hook of decoder layer ``layer`` (tracing): the end of its compute."""
        if self._marks:
            self._marks[layer][2] = self._mark()

    def _mark(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _snapshot(self, cache: DynamicCache) -> torch.Tensor:
        """The recurrent layers' state now, as the bytes of a state block (on the device)."""
        parts = []
        for slot in self.plan.states:
            lay = cache.layers[slot.layer]
            t = (lay.conv_states if slot.kind == "conv" else lay.recurrent_states)[slot.index]
            parts.append(t.contiguous().view(-1).view(torch.uint8))
        raw = torch.cat(parts)
        assert self.hyb.state is not None
        pad = self.hyb.state.block_bytes - raw.numel()
        return torch.nn.functional.pad(raw, (0, pad)) if pad else raw

    # ---- prefill --------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: Any, *, use_cache: bool = True, store: bool = True) -> HybridPrefill:
        t0 = time.perf_counter()
        marks = [t0]
        ids = torch.as_tensor(input_ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ValueError("the prompt is empty")
        bt = self.bt
        cached = use_cache and self.store is not None
        start = None
        if self.trace and self.device.type == "cuda":
            start = self._mark()
            self._marks = [[None, None, None] for _ in self.plan.kinds]
        self._copies = self._moved = 0
        hashes = (self.hyb.hashes(ids) if not self.everything else hash_blocks(self.ns, ids)) if cached or store else []
        marks.append(time.perf_counter())
        max_hit = (ids.numel() - 1) // bt  # one token is always computed: its logits
        got: _Loaded | None = None
        held: list[Any] = []  # leases on the arena, until the device has copied out of it
        states: dict[int, torch.Tensor] = {}
        try:
            if cached and max_hit:
                load = self._load_everything if self.everything else self._load
                got = load(hashes, max_hit, held, marks)  # appends the end of the lookup
            while len(marks) < 4:  # the end of the fetch (and of the lookup, if none ran)
                marks.append(time.perf_counter())
            c = got.checkpoint if got is not None else -1
            hit = (c + 1) * bt
            self._room = ids.numel() - hit  # the most tokens a full layer appends in this prefill
            cache = self._build(got)
            for layer in self.plan.sliding:
                cache.layers[layer].activate_past_recording()  # keep the suffix's window states to store
            marks.append(time.perf_counter())
            # Recurrent state exists only at the end of a forward: run up to each new checkpoint.
            want: set[int] = set()
            ckpts = self._checkpoints(c, got, len(hashes))
            if self.plan.states and store and self.store is not None:
                want = {(p + 1) * bt for p in ckpts}
            ends = sorted({e for e in want if hit < e < ids.numel()} | {ids.numel()})
            pos = hit
            m = min(self.wn, hit)
            first = {layer: hit - m for layer in self.plan.sliding}  # each sliding layer's first cached position
            cone = self._cone_plan(got, hit, ids.numel(), ckpts if store and self.store is not None else [])
            extra = {}
            if cone is not None:  # one forward (no recurrent state): each layer its cone
                self._cone = (cone, ids.numel())
                self._cone_rows = [0] * len(self.plan.kinds)
                first = {layer: cone[layer] - m for layer in self.plan.sliding}
                self._skip_cached(cache, cone, got.full.num_blocks * bt if got is not None and got.full is not None else hit)
                extra = {"position_ids": torch.arange(hit, ids.numel(), device=self.device).unsqueeze(0)}
            try:
                with self._attention(cone is not None):
                    for end in ends:
                        chunk = ids[pos:end].unsqueeze(0).to(self.device)
                        out = self.model(input_ids=chunk, use_cache=True, logits_to_keep=1, **extra, **{self._kw: cache})
                        cache = out_cache(out)
                        if end in want:
                            states[end // bt - 1] = self._snapshot(cache)
                        pos = end
            finally:
                for layer in self.plan.full:
                    cache.layers[layer].__dict__.pop("update", None)  # the in-place update of loaded layers
                if cone is not None:
                    self._cone = None
                    self._skips.clear()
                    for layer in self.plan.sliding:  # positions counted by the prompt, not by what was computed
                        cache.layers[layer].cumulative_length = ids.numel()
            logits = out.logits[0, -1].float()
            marks.append(time.perf_counter())
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            marks.append(time.perf_counter())
        finally:
            for lease in held:
                lease.release()
        seconds = time.perf_counter() - t0
        names = ("hash", "lookup", "fetch", "issue", "forward", "sync")
        phases = {k: round((b - a) * 1e3, 3) for k, a, b in zip(names, marks, marks[1:], strict=False)}
        phases["copies"] = self._copies
        phases["moved_bytes"] = self._moved
        timeline = self._timeline(start) if start is not None else None
        stored = 0
        if store and self.store is not None:
            try:
                stored = self._store(cache, hashes, c, first, states, ckpts)
            except MissingPrefixError as e:  # the loaded prefix left the store since: skip this put
                log.info("hybrid store skipped: %s", e)
        for layer in self.plan.sliding:
            lay = cache.layers[layer]
            lay.record_past = False
            lay.keys, lay.values = lay.keys[:, :, -self.wn :], lay.values[:, :, -self.wn :]
        replayed = (got.cached_blocks - c - 1) * bt if got is not None else 0
        loaded = got.nbytes if got is not None else 0
        rows = tuple(self._cone_rows) if cone is not None else ()
        return HybridPrefill(logits, cache, c, hit, replayed, ids.numel() - hit, loaded, seconds, stored, phases, cone=rows,
                             timeline=timeline)

    def _attention(self, cone: bool = False) -> Any:
        """The model runs with :func:`_flash_window` while ``attention == "flash"``; a cone forward
        otherwise with :func:`_sdpa_window` (the model's mask would not fit its layers)."""
        if self.attention in ("flash", "cudnn"):
            return _swap_attention(self.model.config, _FLASH if self.attention == "flash" else _CUDNN)
        return _swap_attention(self.model.config, _WINDOW) if cone else nullcontext()

    def _cone_plan(self, got: _Loaded | None, hit: int, total: int, ckpts: list[int]) -> list[int] | None:
        """Each layer's first computed position (:func:`cone_starts`) when this prefill replays
        and the cone applies, else None. The window pieces it stores inside the replay (new
        checkpoints there) need every sliding layer's KV from their first block on."""
        if not self.cone or got is None or got.full is None:
            return None
        end = got.full.num_blocks * self.bt
        if end <= hit:
            return None
        pieces = [j for p in ckpts for j in self.hyb.checkpoint_blocks(p) if hit <= j * self.bt < end]
        kv_from = min(pieces) * self.bt if pieces else end
        return cone_starts(self.plan.kinds, self.wn + 1, hit, end, kv_from)

    def _skip_cached(self, cache: DynamicCache, cone: list[int], end: int) -> None:
        """A full layer whose cone starts before ``end`` computes K/V for positions whose KV is
        loaded: its ``update`` drops those and appends only the new ones (an instance attribute,
        removed after the forward)."""
        for layer in self.plan.full:
            skip = end - cone[layer]
            if skip > 0:
                if "update" not in cache.layers[layer].__dict__:
                    raise RuntimeError(f"cone: full layer {layer} has no loaded part to skip into")
                self._skips[layer] = skip

    def _slice(self, layer: int, module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Forward pre-hook of decoder layer ``layer`` in a cone forward: its input keeps only the
        positions from its cone's start (the hidden states, rotary embeddings and position ids
        of the earlier positions are cut off; the attention takes its mask from the shapes). The
        model hands every layer the rotary embeddings and position ids of the whole forward."""
        if self._cone is None:
            return None
        starts, total = self._cone
        keep = total - starts[layer]
        self._cone_rows[layer] = keep
        hs = args[0] if args else kwargs["hidden_states"]
        if hs.shape[1] < keep:
            raise RuntimeError(f"cone: layer {layer} needs {keep} positions, the layer below computed {hs.shape[1]}")
        kwargs = dict(kwargs)
        if args:
            args = (hs[:, -keep:], *args[1:])
        else:
            kwargs["hidden_states"] = hs[:, -keep:]
        pe = kwargs.get("position_embeddings")
        if pe is not None:
            kwargs["position_embeddings"] = tuple(t[:, -keep:] for t in pe)
        for name in ("position_ids", "cache_position"):
            t = kwargs.get(name)
            if t is not None:
                kwargs[name] = t[..., -keep:]
        if kwargs.get("attention_mask") is not None:
            raise RuntimeError("cone: the model built an attention mask; the cone runs with a mask-free attention interface")
        return args, kwargs

    def _timeline(self, start: Any) -> dict[str, Any]:
        """Device milliseconds from ``start`` (the device synchronised) of each layer's load
        event, compute start and compute end."""
        def ms(ev: Any) -> float | None:
            return None if ev is None else round(start.elapsed_time(ev), 3)

        marks, self._marks = self._marks, []
        return {"load_ms": [ms(m[0]) for m in marks], "start_ms": [ms(m[1]) for m in marks],
                "end_ms": [ms(m[2]) for m in marks], "kinds": list(self.plan.kinds)}

    def _checkpoints(self, c: int, got: _Loaded | None, n: int) -> list[int]:
        """The checkpoints this prefill stores, among the blocks after ``c`` of ``n`` full ones:
        the policy's, and (``at_hits``) the block a replayed hit's full part ended on."""
        out = set(self.policy.new_checkpoints(c + 1, n - 1))
        if self.policy.at_hits and got is not None and c + 1 < got.cached_blocks <= n:
            out.add(got.cached_blocks - 1)
        return sorted(out)

    def _store(self, cache: DynamicCache, hashes: list[BlockHash], c: int, first: dict[int, int],
               states: dict[int, torch.Tensor], ckpts: list[int]) -> int:
        """Put what this prefill computed; returns the payload bytes that were new."""
        store = self.store
        assert store is not None
        n = len(hashes)
        if n <= c + 1:
            return 0
        layers = cache.layers
        # ``first``: each sliding layer's first cached position (the loaded window's, or with the
        # cone, the window before the layer's first computed position).
        sel = list(range(len(self.plan.kinds))) if self.everything else self.plan.full
        new_bytes = 0
        if sel:
            blocks = self._pack(layers, sel, first, c + 1, n - 1)
            ns = self.ns if self.everything else self.hyb.full
            assert ns is not None
            new_bytes += store.put(ns, hashes, blocks, start=c + 1) * ns.block_bytes
        if self.everything:
            return new_bytes
        sns = self.hyb.state
        for p, raw in states.items():
            assert sns is not None
            chain = self.hyb.state_chain(hashes, p)
            new_bytes += store.put(sns, chain, raw.cpu().numpy(), start=len(chain) - 1) * sns.block_bytes
        wns = self.hyb.window
        if wns is None:
            return new_bytes
        # Pieces of the new checkpoints' windows; those of blocks up to c are cached (c is a
        # checkpoint), so only computed blocks need packing.
        need = sorted({j for p in ckpts for j in self.hyb.checkpoint_blocks(p) if j > c})
        for a, b in _runs(need):
            pieces = self._pack(layers, self.plan.sliding, first, a, b)
            for j in range(a, b + 1):
                chain = self.hyb.window_chain(hashes, j)
                new_bytes += store.put(wns, chain, pieces[j - a], start=len(chain) - 1) * wns.block_bytes
        return new_bytes

    def _pack(self, layers: Any, sel: list[int], first: dict[int, int], a: int, b: int) -> Any:
        """Blocks ``a..b`` of layers ``sel`` as host ``[n, block_bytes]`` uint8 (numpy); a
        layer's cached tokens start at position ``first[layer]`` (0 if absent)."""
        t0, t1 = a * self.bt, (b + 1) * self.bt
        keys = [layers[i].keys[:, :, t0 - first.get(i, 0) : t1 - first.get(i, 0)] for i in sel]
        values = [layers[i].values[:, :, t0 - first.get(i, 0) : t1 - first.get(i, 0)] for i in sel]
        return pack(keys, values, self._shape(len(sel), self.bt), 0, b - a + 1).cpu().numpy()

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
            cache = out_cache(out)
            nxt = int(out.logits[0, -1].argmax())
        return tokens, pre


def _flash_covers(model: Any, device: torch.device) -> bool:
    try:
        _refuse_flash(model, device)
    except UsageError:
        return False
    return True


def _attention_covers(model: Any) -> bool:
    """:func:`_flash_window` and :func:`_sdpa_window` compute this model's attention (no logit
    soft-capping, no attention sinks)."""
    try:
        _refuse_flash(model, None)
    except UsageError:
        return False
    return True


def _refuse_flash(model: Any, device: torch.device | None) -> None:
    """``attention="flash"`` covers causal attention with an optional sliding window, nothing more."""
    if device is not None and device.type != "cuda":
        raise UsageError("attention='flash' needs a CUDA model (FlashAttention-2); use attention='model' on the CPU")
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "attn_logit_softcapping", None):
        raise UsageError("attention='flash' has no logit soft-capping (Gemma-2); use attention='model'")
    if any(hasattr(m, "sinks") for m in model.modules()):
        raise UsageError("attention='flash' has no attention sinks (gpt-oss); use attention='model'")


@contextmanager
def _swap_attention(config: Any, name: str) -> Iterator[None]:
    prev = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = prev


def _in_place_update(lay: Any, kbuf: torch.Tensor, vbuf: torch.Tensor, skips: dict[int, int], layer: int,
                     key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A loaded full layer's ``update`` during a prefill: the new KV is written into the room left
    after the loaded tokens (``kbuf``/``vbuf``), not concatenated (a copy of the whole 32K-token
    cache per layer otherwise); in a cone forward the first ``skips[layer]`` positions' KV is
    loaded already and dropped. Removed after the forward (an instance attribute)."""
    skip = skips.get(layer, 0)
    k, v = key_states[:, :, skip:], value_states[:, :, skip:]
    n0 = lay.keys.shape[2]
    n1 = n0 + k.shape[2]
    if n1 > kbuf.shape[2]:
        return type(lay).update(lay, k, v, *args, **kwargs)
    kbuf[:, :, n0:n1].copy_(k)
    vbuf[:, :, n0:n1].copy_(v)
    lay.keys, lay.values = kbuf[:, :, :n1], vbuf[:, :, :n1]
    return lay.keys, lay.values


def _set_linear_length(lay: Any, tokens: int) -> None:
    """A recurrent layer whose state was loaded counts ``tokens`` tokens seen.

    transformers 5.25 made a linear-attention cache layer count its tokens itself
    (``cumulative_length_linear``: its ``get_seq_length``, which ``DynamicCache.get_seq_length()``
    reports when layer 0 is such a layer, as in Qwen3-Next and LFM2, and the model takes its
    position ids from). Loading the state with ``update_conv_state`` counts the conv state's
    width instead (``conv_kernel_size`` tokens), so the replay's positions would start there.
    Earlier versions have no such count (the cache asked the first attention layer): nothing to do."""
    n = getattr(lay, "cumulative_length_linear", None)
    if isinstance(n, torch.Tensor):
        n.fill_(tokens)


def _runs(sorted_ids: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ids as (first, last)."""
    out: list[tuple[int, int]] = []
    for j in sorted_ids:
        if out and out[-1][1] == j - 1:
            out[-1] = (out[-1][0], j)
        else:
            out.append((j, j))
    return out


def window_bytes_per_token(ns: Namespace, context: int, policy: CheckpointPolicy) -> dict[str, float]:
    """Exact payload bytes per cached token of one chain of ``context`` tokens, stored once
    (the full part, the checkpoints' window pieces and states) against storing every layer of
    every block (with recurrent layers: their state at every block)."""
    hyb = HybridNamespaces.of(ns)
    n = context // ns.block_tokens
    ckpts = policy.new_checkpoints(0, n - 1) if n else []
    pieces = len({j for p in ckpts for j in hyb.checkpoint_blocks(p)})
    total = n * hyb.full.block_bytes if hyb.full is not None else 0
    total += pieces * hyb.window.block_bytes if hyb.window is not None else 0
    total += len(ckpts) * hyb.state.block_bytes if hyb.state is not None else 0
    every = n * ns.block_bytes
    tokens = n * ns.block_tokens
    return {
        "checkpoints": float(len(ckpts)),
        "window_pieces": float(pieces),
        "hybrid_bytes_per_token": total / tokens,
        "everything_bytes_per_token": every / tokens,
        "ratio": total / every,
    }
