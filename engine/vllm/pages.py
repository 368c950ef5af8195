"""vLLM's paged KV as kvstore blocks.

vLLM hands a connector one tensor per attention layer, a logical ``[B, H, N, C]`` view (B pages,
H KV heads of this rank, N = block_size tokens, C = 2 x head size: K then V of a token in the
view's terms, though a kernel may keep them otherwise, :data:`KV_ORDERS`) whose memory order is the engine's resolved ``KVCacheLayout`` (``LBHNC`` on CPU). A kvstore
block is one vLLM page of every layer, layer-major: ``[layer][H][N][C]`` in logical order, so a
block is the same bytes whatever the memory order, and one layer of one block is one contiguous
run (the loader writes layer i before layer i+1 is needed).

The namespace records the page: dtype, block size, layers, KV heads, head size (its
``KVLayout``) and, in ``model_revision``, the block format (``PAGE_FORMAT``: the per-layer order
above). An engine with another page gets a different namespace and never reads these blocks; as
it is the same model deployment (model, revision, rank, LoRA) with another layout, the daemon
reports the registration as a layout conflict (a warning in both logs, ``kvctl namespaces``),
so a changed ``--block-size`` or ``--dtype`` is loud, not a silent zero hit rate. vLLM's memory
order (``KVCacheLayout``) is not part of the key: a block holds the same bytes whatever it is.

Families (``docs/vllm.md``, "Model families"): an fp8 cache's pages are 1-byte elements, its
namespace holds the fp8 format and a digest of the layers' scales; an MLA page is ``[B, 1, N,
latent]``, one namespace (rank 0's) for every TP rank; a page with sliding-window layers is
stored as the parts of ``kvstore.hybrid`` (:meth:`PageSpec.part`: the full layers per block, the
sliding layers as window pieces at checkpoints). vLLM's recurrent state groups (``MambaSpec`` in
its ``align`` mode: gated delta net linear attention as in Qwen3-Next, Mamba2, short convolutions)
are described by :class:`StateSpec` (:attr:`PageSpec.state`) and moved by :class:`PagedState`:
every recurrent layer's state at a checkpoint is the state part of ``kvstore.hybrid``.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import xxhash

from engine.gpu import arena_layer_rows
from engine.pagecopy import page_copier
from engine.transfer import scatter_each_layer
from kvstore.errors import UsageError
from kvstore.keys import DTYPE_BYTES, KVLayout, LayerGroup, Namespace

GATHER_STAGE_BYTES = 128 << 20
"""The device staging a gather into host memory uses at most (what a layer's ``index_select`` of
2,048 blocks of Llama-8B takes anyway)."""

PAGE_FORMAT = "vllm-HNC1"
"""Version of the block format above; part of every namespace (a change is a new namespace)."""

BLOCK_FORMATS = ("vllm", "kvstore")
"""``vllm``: each layer as vLLM's page, ``[H][N][K then V]`` (:data:`PAGE_FORMAT`, in the
namespace's revision); ``kvstore``: the store's own per-layer format, ``[K, V][H][N][D]``
(``engine.kvlayout``), the reference engines' (``engine.reference.hf``, ``engine.reference.hybrid``): no tag, so the
namespace is theirs for the same model id and revision and the blocks are shared."""


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


KV_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
"""vLLM's ``--kv-cache-dtype`` values kvstore stores (vLLM: ``fp8`` = ``fp8_e4m3``) and the
namespace's element type for each: the pages are 1-byte elements (``torch.uint8`` views in vLLM)."""

PAGE_KINDS = ("full", "mla")

SUPPORTED = (
    "kvstore's vLLM connector supports attention layers with dense K/V (bf16, fp16, fp32, or "
    "--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2 with per-tensor scales), MLA latent pages "
    "(DeepSeek-V2/V3) and sliding-window layers: in one KV cache group, or with vLLM's hybrid KV "
    "cache manager in full-attention and sliding-window groups of one page shape and one window, and "
    "recurrent-state groups (MambaSpec, vLLM's prefix cache on) beside them"
)


@dataclass(frozen=True, slots=True)
class PageSpec:
    """What one vLLM page holds, per rank."""

    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    """The element type of vLLM's page views (``torch.uint8`` for an fp8 KV cache)."""
    layout: str
    """vLLM's resolved KV cache layout name (``LBHNC``...)."""
    kind: str = "full"
    """``full``: K then V of ``num_kv_heads`` heads per token; ``mla``: one latent vector of
    ``head_size`` (``kv_lora_rank + qk_rope_head_dim``) per token, the same on every TP rank."""
    kv_cache_dtype: str = "auto"
    """vLLM's ``--kv-cache-dtype`` (``auto``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``)."""
    scales: str = ""
    """A digest of every layer's K/V quantisation scales (fp8 caches; :func:`scales_digest`):
    part of the namespace, so blocks quantised with other scales are other blocks."""
    rope_dim: int = 0
    """``mla``: the rope part of ``head_size`` (recorded in the namespace's layer group)."""
    sliding: tuple[str, ...] = ()
    """The layers (of ``layer_names``) that attend over a sliding window of ``window`` tokens:
    stored as window pieces at checkpoints (``kvstore.hybrid``; ``docs/vllm.md``, model families)."""
    window: int = 0
    vllm_windows: bool = False
    """vLLM itself keeps only the window's pages: the sliding layers are in ``SlidingWindowSpec``
    groups (every layer slides, so vLLM's single group is a sliding one even without its hybrid
    manager; or the hybrid manager is on)."""
    groups: tuple[int, ...] = ()
    """vLLM's hybrid KV cache manager: the KV cache group of each layer of ``layer_names`` (its
    pages are that group's block ids). Empty: one group."""
    block_format: str = "vllm"
    """How a layer's page is laid out in a stored block (:data:`BLOCK_FORMATS`)."""
    kv_order: str = ""
    """``block_format = kvstore``: where vLLM's attention kernel keeps K and V in a page, which
    the conversion to K/V planes needs (:data:`KV_ORDERS`; set by the worker from its attention
    layers, :func:`kv_order_of`)."""
    state: StateSpec | None = None
    """vLLM's recurrent-state groups (``MambaSpec``, ``align`` mode), stored at checkpoints as
    the state part of ``kvstore.hybrid``; their pages are those groups' (``StateSpec.groups``)."""

    def __post_init__(self) -> None:
        if self.kind not in PAGE_KINDS:
            raise UsageError(f"page kind {self.kind!r} is not one of {', '.join(PAGE_KINDS)}")
        if set(self.sliding) - set(self.layer_names) or (self.sliding and self.window <= 0):
            raise UsageError(f"sliding layers {self.sliding} need a window > 0 and must be among {self.layer_names}")
        if self.groups and len(self.groups) != len(self.layer_names):
            raise UsageError(f"{len(self.groups)} KV cache groups given for {len(self.layer_names)} layers")
        if self.block_format not in BLOCK_FORMATS:
            raise UsageError(f"block format {self.block_format!r} is not one of {', '.join(BLOCK_FORMATS)}")
        if self.state is not None and (self.kind != "full" or self.quantized or self.block_format != "vllm"):
            raise UsageError("recurrent state is stored beside dense bf16/fp16/fp32 attention pages in vLLM's "
                             "block format only")
        if self.block_format == "kvstore" and (self.kind != "full" or self.quantized):
            raise UsageError(
                "kv_connector_extra_config.block_format = 'kvstore' (the reference engines' K/V planes) is for "
                "dense bf16/fp16/fp32 K/V pages; MLA and fp8 pages are stored as vLLM's ('vllm')"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def content(self) -> int:
        """C: elements per token and head (K then V; MLA: the latent vector)."""
        return self.head_size if self.kind == "mla" else 2 * self.head_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer of one block."""
        return self.num_kv_heads * self.block_size * self.content * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.page_bytes

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype in KV_FP8

    @property
    def hybrid(self) -> bool:
        """Some layers slide or hold a recurrent state: a block is stored as a full part, and
        window pieces and states at checkpoints (``kvstore.hybrid``)."""
        return bool(self.sliding) or self.state is not None

    @property
    def shared_by_ranks(self) -> bool:
        """MLA: every tensor-parallel rank holds the same latent cache, stored once."""
        return self.kind == "mla"

    @property
    def num_groups(self) -> int:
        """vLLM's KV cache groups these layers are in (1 without the hybrid manager)."""
        return max((*self.groups, *(self.state.groups if self.state is not None else ())), default=0) + 1

    def part(self, sliding: bool) -> PageSpec:
        """The spec of the full-attention layers (``sliding=False``) or of the sliding ones."""
        keep = [i for i, n in enumerate(self.layer_names) if (n in self.sliding) == sliding]
        names = tuple(self.layer_names[i] for i in keep)
        groups = tuple(self.groups[i] for i in keep) if self.groups else ()
        return replace(self, layer_names=names, sliding=names if sliding else (), window=self.window if sliding else 0,
                       groups=groups, state=None)

    def _dtype_name(self) -> str:
        return KV_FP8.get(self.kv_cache_dtype) or str(self.dtype).removeprefix("torch.")

    def namespace(self, model_id: str, revision: str, rank: int, world_size: int, lora_id: str = "") -> Namespace:
        """The namespace of this page (for a hybrid page the model's, whose parts are
        ``kvstore.hybrid.HybridNamespaces.of`` it). MLA: the caller passes rank 0 on every rank."""
        full = len(self.layer_names) - len(self.sliding)
        groups: list[LayerGroup] = []
        if self.kind == "mla":
            groups.append(LayerGroup("mla", full, latent_dim=self.head_size - self.rope_dim, rope_dim=self.rope_dim))
        elif full:
            groups.append(LayerGroup("full", full, self.num_kv_heads, self.head_size))
        if self.sliding:
            groups.append(LayerGroup("sliding", len(self.sliding), self.num_kv_heads, self.head_size, window=self.window))
        state = 0
        if self.state is not None:
            groups.append(self.state.layer_group(self._dtype_name()))
            state = self.state.block_bytes
        layout = KVLayout(self._dtype_name(), self.block_size, tuple(groups))
        tag = self.tag()
        ns = Namespace(model_id, layout, model_revision=f"{revision}+{tag}" if tag else revision, rank=rank,
                       world_size=world_size, lora_id=lora_id)
        if ns.block_bytes != self.block_bytes + state:  # a bug: the two descriptions disagree
            raise AssertionError(f"namespace blocks are {ns.block_bytes} bytes, vLLM pages {self.block_bytes}")
        return ns

    def tag(self) -> str:
        """The block format in the revision string: a new format is a new deployment; a new
        block size, dtype or head count is a layout conflict within this one (reported). An fp8
        cache adds its scales' digest: blocks quantised with other scales are other blocks. The
        store's own format (``block_format = kvstore``) has none: the reference engines' blocks."""
        if self.block_format == "kvstore":
            return ""
        tag = f"{PAGE_FORMAT}+kvscales-{self.scales or 'unknown'}" if self.quantized else PAGE_FORMAT
        return f"{tag}+{self.state.tag()}" if self.state is not None else tag

    def describe(self) -> str:
        extra = f" kv_cache_dtype={self.kv_cache_dtype} scales={self.scales}" if self.quantized else ""
        if self.kind == "mla":
            extra += f" mla(latent={self.head_size - self.rope_dim} rope={self.rope_dim}, one copy for every TP rank)"
        if self.sliding:
            extra += f" sliding_layers={len(self.sliding)} window={self.window}"
        if self.state is not None:
            st = self.state
            extra += (f" recurrent_layers={st.num_layers} state={st.mamba_type or 'mamba'}"
                      f"{list(map(list, st.shapes))} {st.state_bytes} B/layer")
        if self.groups:
            extra += f" kv_cache_groups={self.num_groups}"
        if self.block_format != "vllm":
            extra += f" block_format={self.block_format}"
        return (
            f"block_size={self.block_size} dtype={self._dtype_name()} "
            f"layers={self.num_layers} kv_heads={self.num_kv_heads} head_size={self.head_size} "
            f"layout={self.layout}{extra}"
        )


KV_ORDERS = ("cpu-vec",)
"""Page arrangements of vLLM attention kernels that the ``kvstore`` block format converts, each
verified against the reference engine's K and V: ``cpu-vec``: vLLM's CPU backend (``cpu_attn``)
with its ``vec`` kernel, float32, views a page ``[H, N, 2D]`` as ``[H, 2N, D]`` and splits it in
two (``kv_cache.view(B, H, 2 * N, -1).chunk(2, dim=2)``): per head a K plane then a V plane; its
reshape-and-cache kernel writes the K plane transposed, ``[D][N]``, and the V plane as ``[N][D]``.
Other kernels (the CPU build's ``amx``, ``neon``, ``vec16``...; the GPU backends) are not
verified and are refused."""


def kv_order_of(layers: Sequence[Any], dtype: torch.dtype) -> str:
    """The :data:`KV_ORDERS` entry of vLLM attention ``layers`` (from its static forward context),
    or a :class:`UsageError` naming what was found."""
    isas = {getattr(layer, "isa", None) for layer in layers}
    if isas == {"vec"} and dtype == torch.float32:
        return "cpu-vec"
    found = f"vLLM's CPU attention kernel {sorted(map(str, isas))}" if isas != {None} else "a GPU attention backend"
    raise UsageError(
        "kv_connector_extra_config.block_format = 'kvstore' converts vLLM's pages to the reference "
        f"engines' K/V planes only where the kernel's page order is verified ({', '.join(KV_ORDERS)}: vLLM's "
        f"CPU backend, its vec kernel, float32); this engine runs {found} with {dtype}. Use block_format 'vllm'"
    )


def scales_digest(layers: Sequence[Any]) -> str:
    """A digest of vLLM attention layers' K and V scales (``_k_scale_float``, ``_v_scale_float``:
    vLLM 0.32's per-tensor fp8 scales, from the checkpoint or 1.0), in layer order."""
    vals = [float(getattr(layer, a, 1.0)) for layer in layers for a in ("_k_scale_float", "_v_scale_float")]
    return xxhash.xxh3_64_hexdigest(struct.pack(f"<{len(vals)}d", *vals))


def _layer_index(name: str) -> int | None:
    m = re.search(r"\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def sliding_layers(names: Sequence[str], hf_config: Any) -> tuple[str, ...]:
    """The layers of ``names`` that slide, per the model config's ``layer_types`` (Gemma 2/3,
    gpt-oss, Qwen2...), else all of them (Mistral: one window on every layer)."""
    types = getattr(hf_config, "layer_types", None) if hf_config is not None else None
    if not types:
        return tuple(names)
    out = []
    for n in names:
        i = _layer_index(n)
        if i is None or i >= len(types):
            raise UsageError(f"kvstore cannot tell whether layer {n} slides (the config's layer_types: {types})")
        if types[i] == "sliding_attention":
            out.append(n)
        elif types[i] != "full_attention":
            raise UsageError(f"layer {n} is a {types[i]!r} layer. {SUPPORTED}")
    return tuple(out)


def _check_spec(spec: Any, cache: Any) -> tuple[bool, str]:
    """(MLA, the ``--kv-cache-dtype`` kvstore records) of one KV cache group's spec, or a
    :class:`UsageError` saying what kvstore's connector supports."""
    missing = [a for a in ("num_kv_heads", "head_size", "dtype", "block_size") if not hasattr(spec, a)]
    if missing:
        raise UsageError(f"this model's KV cache is {type(spec).__name__}. {SUPPORTED}")
    mla = "MLA" in type(spec).__name__
    kv_dtype = str(getattr(spec, "cache_dtype_str", None) or getattr(cache, "cache_dtype", None) or "auto")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    dense = (
        getattr(spec, "head_size_v", spec.head_size) == (0 if mla else spec.head_size)
        and getattr(spec, "page_size_padded", None) is None
        and getattr(spec, "num_head_slots", None) is None
        and getattr(spec, "state_content_bytes", None) is None
        and int(getattr(spec, "tokens_per_state", 1)) == 1
        and getattr(spec, "attention_chunk_size", None) is None
        and (type(spec).__name__ in ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec")
             or not type(spec).__name__.endswith("Spec"))  # (a test's stand-in)
        and (quant == "NONE" or (quant == "FP8_PER_TENSOR" and kv_dtype in KV_FP8))
        and (not mla or int(spec.num_kv_heads) == 1)
    )
    if not dense:
        raise UsageError(f"this model's KV cache is {spec!r}. {SUPPORTED}")
    if quant == "NONE" and kv_dtype != "auto" and kv_dtype not in ("bfloat16", "float16", "float32", "half", "float"):
        raise UsageError(f"--kv-cache-dtype {kv_dtype} is not one kvstore stores. {SUPPORTED}")
    return mla, "auto" if quant == "NONE" else kv_dtype


def _is_sliding_group(spec: Any) -> bool:
    """A group of vLLM's sliding-window pages (it frees a page once it leaves the window)."""
    return type(spec).__name__ == "SlidingWindowSpec"


def page_spec(kv_cache_config: Any, cache_layout: str | None, vllm_config: Any = None) -> PageSpec:
    """The page of a vLLM ``KVCacheConfig``: attention layers with dense K/V (any
    ``--kv-cache-dtype`` kvstore knows, :data:`KV_FP8`), MLA latent pages, or sliding-window
    layers. Without vLLM's hybrid KV cache manager they are one group (sliding layers with
    full-size pages; which layers slide comes from the model config, ``vllm_config``); with it,
    full-attention and sliding-window groups of one page shape (:attr:`PageSpec.groups`), and
    recurrent-state groups beside them (``MambaSpec`` in ``align`` mode: :attr:`PageSpec.state`).
    Anything else is a :class:`UsageError` saying what kvstore's connector supports."""
    every = list(kv_cache_config.kv_cache_groups)
    state_ids = [i for i, g in enumerate(every) if type(g.kv_cache_spec).__name__ == "MambaSpec"]
    ids = [i for i in range(len(every)) if i not in state_ids]
    if not ids:
        raise UsageError(f"this model has recurrent layers only ({every[0].kv_cache_spec!r}): {RECURRENT}. "
                         f"{SUPPORTED}")
    groups = [every[i] for i in ids]
    cache = vllm_config.cache_config if vllm_config is not None else None
    checked = [_check_spec(g.kv_cache_spec, cache) for g in groups]
    spec = groups[0].kv_cache_spec
    mla, kv_dtype = checked[0]
    if len(groups) > 1:
        shape = [(type(g.kv_cache_spec).__name__ == "MLAAttentionSpec", int(g.kv_cache_spec.block_size),
                  int(g.kv_cache_spec.num_kv_heads), int(g.kv_cache_spec.head_size), g.kv_cache_spec.dtype)
                 for g in groups]
        windows = {int(g.kv_cache_spec.sliding_window) for g in groups if _is_sliding_group(g.kv_cache_spec)}
        if len(set(shape)) > 1 or len(set(checked)) > 1 or len(windows) > 1 or any(m for m, _ in checked):
            raise UsageError(
                f"this model has {len(groups)} KV cache groups of different pages "
                f"({', '.join(type(g.kv_cache_spec).__name__ for g in groups)}; windows {sorted(windows)}). "
                f"{SUPPORTED}"
            )
    names_groups = sorted(((n, ids[k]) for k, g in enumerate(groups) for n in g.layer_names),
                          key=lambda x: _natural_key(x[0]))
    names = tuple(n for n, _ in names_groups)
    if len(set(names)) != len(names):
        raise UsageError(f"a layer is in several of this model's {len(groups)} KV cache groups. {SUPPORTED}")
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    rope = int(getattr(hf, "qk_rope_head_dim", 0) or 0) if mla else 0
    if mla and not 0 <= rope < int(spec.head_size):
        rope = 0
    if len(every) > 1:  # the hybrid manager: sliding layers are those of its sliding-window groups
        sliding = tuple(n for n, i in names_groups if _is_sliding_group(every[i].kv_cache_spec))
        window = max((int(g.kv_cache_spec.sliding_window) for g in groups if _is_sliding_group(g.kv_cache_spec)),
                     default=0)
        vllm_windows, layer_groups = bool(sliding), tuple(i for _, i in names_groups)
    else:
        window = int(getattr(spec, "sliding_window", None) or 0)
        vllm_windows, layer_groups = type(spec).__name__ == "SlidingWindowSpec", ()
        sliding = names if vllm_windows else sliding_layers(names, hf) if window else ()
    if mla and sliding:
        raise UsageError(f"sliding-window MLA layers are not supported. {SUPPORTED}")
    state = states_spec([every[i] for i in state_ids], state_ids) if state_ids else None
    if state is not None and state.block_size != int(spec.block_size):
        raise UsageError(f"vLLM keeps this model's recurrent state every {state.block_size} tokens and its attention "
                         f"pages hold {int(spec.block_size)}; kvstore needs a state at each attention block boundary")
    return PageSpec(names, int(spec.block_size), int(spec.num_kv_heads), int(spec.head_size), spec.dtype,
                    cache_layout or "LBHNC", kind="mla" if mla else "full", kv_cache_dtype=kv_dtype,
                    rope_dim=rope, sliding=sliding, window=window, vllm_windows=vllm_windows, groups=layer_groups,
                    state=state)


RECURRENT = (
    "kvstore's vLLM connector stores recurrent state (vLLM's MambaSpec groups: gated delta net linear "
    "attention as in Qwen3-Next, Mamba2, short convolutions) beside attention layers, whose blocks key it; "
    "start vLLM without the kvstore connector for this model"
)


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One KV cache group of vLLM's recurrent state (``MambaSpec``), per rank.

    vLLM keeps a recurrent layer's whole history in a fixed-size state: one page per block of
    ``block_size`` tokens, holding the state after the block's last token (its ``align`` cache
    mode keeps these at block boundaries; ``none`` keeps only the running one). vLLM hands a
    connector each layer as an int8 view ``[B, 1, 1, state_bytes]`` whose pages are padded to
    vLLM's common page size; the layer's tensors (``shapes``, ``dtypes``: e.g. a gated delta net's
    conv state ``[3, 1024]`` bf16 and its recurrent state ``[4, 128, 128]`` fp32) lie back to back
    in a page (``MambaBase.bind_kv_cache``). A stored state is those bytes of every layer,
    layer-major: what ``kvstore.hybrid`` keeps under a checkpoint's state key."""

    layer_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    block_size: int
    """Tokens between two states vLLM keeps (its ``mamba_block_size``: the attention block size)."""
    mamba_type: str = ""
    """vLLM's ``MambaAttentionBackendEnum`` name (``MAMBA2``, ``GDN_ATTN``, ``SHORT_CONV``...)."""
    groups: tuple[int, ...] = ()
    """vLLM's KV cache group of each layer (its pages are that group's block ids; a block's page
    ids are then a tuple indexed by group, as :class:`PagedKV`'s). Empty: one id per block."""

    def __post_init__(self) -> None:
        if not self.layer_names or len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise UsageError(f"a recurrent state needs layers and one dtype per state tensor, got "
                             f"{len(self.layer_names)} layers, shapes {self.shapes}, dtypes {self.dtypes}")
        if self.groups and len(self.groups) != len(self.layer_names):
            raise UsageError(f"{len(self.groups)} KV cache groups given for {len(self.layer_names)} recurrent layers")

    def tag(self) -> str:
        """The state's format in the namespace's revision: the layout records only a state's
        size, so tensors of the same size in another shape or order (vLLM's conv state layout,
        ``VLLM_SSM_CONV_STATE_LAYOUT``) are another namespace, never a wrong hit."""
        desc = f"{self.mamba_type}|{self.shapes}|{[str(d) for d in self.dtypes]}"
        return f"state-{xxhash.xxh3_64_hexdigest(desc.encode())[:8]}"

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def state_bytes(self) -> int:
        """Bytes of one layer's state (without vLLM's page padding)."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(self.shapes, self.dtypes, strict=True))

    @property
    def block_bytes(self) -> int:
        """Bytes of one stored state: every layer's."""
        return self.num_layers * self.state_bytes

    def layer_group(self, dtype: str) -> LayerGroup:
        """The namespace's ``recurrent`` group for a layout of element type ``dtype``: a layer's
        state as ``latent_dim`` elements of it (the reference engines' form: one size per model)."""
        size = DTYPE_BYTES[dtype]
        if self.state_bytes % size:
            raise UsageError(f"a recurrent state of {self.state_bytes} bytes is not a whole number of {dtype} elements")
        return LayerGroup("recurrent", self.num_layers, latent_dim=self.state_bytes // size)


def states_spec(groups: Sequence[Any], ids: Sequence[int]) -> StateSpec:
    """One :class:`StateSpec` for vLLM's recurrent-state groups ``groups`` (KV cache group ids
    ``ids``): their layers in model order, each read from its group's pages."""
    specs = [state_spec(g) for g in groups]
    if len({(s.shapes, s.dtypes, s.block_size, s.mamba_type) for s in specs}) > 1:
        raise UsageError(f"this model's recurrent layers keep states of different shapes ({specs}). {SUPPORTED}")
    layers = sorted(((n, i) for s, i in zip(specs, ids, strict=True) for n in s.layer_names),
                    key=lambda x: _natural_key(x[0]))
    return replace(specs[0], layer_names=tuple(n for n, _ in layers), groups=tuple(i for _, i in layers))


def state_spec(group: Any) -> StateSpec:
    """The :class:`StateSpec` of a vLLM ``KVCacheGroupSpec`` whose spec is a ``MambaSpec`` in
    ``align`` mode (the only mode in which vLLM keeps a state at each block boundary), or a
    :class:`UsageError` saying why not."""
    spec = group.kv_cache_spec
    if type(spec).__name__ != "MambaSpec":
        raise UsageError(f"{type(spec).__name__} is not a recurrent state group (MambaSpec)")
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        raise UsageError(f"vLLM keeps this model's recurrent state at block boundaries only with its prefix cache on "
                         f"(mamba_cache_mode 'align', got {mode!r})")
    if int(getattr(spec, "num_speculative_blocks", 0)):
        raise UsageError("recurrent state with speculative decoding's extra state blocks is not supported")
    kind = getattr(spec, "mamba_type", "")
    return StateSpec(tuple(group.layer_names), tuple(tuple(int(d) for d in s) for s in spec.shapes),
                     tuple(spec.dtypes), int(spec.block_size), str(getattr(kind, "name", kind)))


class PagedState:
    """Moves states between vLLM's recurrent-state pages and kvstore blocks: a block is one state
    of every layer (``[layer][state_bytes]``), gathered from and scattered into the pages vLLM's
    Mamba KV cache groups give a request (one page id per block, or with ``spec.groups`` a tuple
    per block indexed by KV cache group). A ``engine.transfer.PagedTarget``: the loader and saver
    move states as they move pages."""

    def __init__(self, spec: StateSpec, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in spec.layer_names if n not in kv_caches]
        if missing:
            raise UsageError(f"vLLM registered no state for layer(s) {', '.join(missing[:4])}")
        self.spec = spec
        self.layers = []
        for name in spec.layer_names:
            t = kv_caches[name]
            if t.dim() != 4 or tuple(t.shape[1:]) != (1, 1, spec.state_bytes) or t.element_size() != 1:
                raise UsageError(f"layer {name}: vLLM's state view is {tuple(t.shape)} {t.dtype}; kvstore expects "
                                 f"[blocks, 1, 1, {spec.state_bytes}] int8")
            self.layers.append(t.view(torch.uint8).squeeze(2).squeeze(1))
        self.device = self.layers[0].device

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def page_bytes(self) -> int:
        return self.spec.state_bytes

    @property
    def block_bytes(self) -> int:
        return self.spec.block_bytes

    def block_ids(self, block_ids: Sequence[Any]) -> torch.Tensor:
        return device_ids(block_ids, self.device)

    def _layer_ids(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        return ids[:, self.spec.groups[layer]] if self.spec.groups else ids

    def gather(self, block_ids: Sequence[Any], out: torch.Tensor) -> None:
        """Copy the states in pages ``block_ids`` of every layer into ``out`` (``[n, block_bytes]`` uint8)."""
        ids, sb = self.block_ids(block_ids), self.spec.state_bytes
        dst = out.view(len(block_ids), self.spec.num_layers, sb)
        for i, t in enumerate(self.layers):
            dst[:, i].copy_(t.index_select(0, self._layer_ids(i, ids)), non_blocking=True)

    def scatter_layer(self, layer: int, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Write layer ``layer``'s state of ``n`` blocks from ``src`` (``[n, state_bytes]`` uint8)."""
        if src.device != self.device:
            src = src.to(self.device, non_blocking=True)
        self.layers[layer].index_copy_(0, self._layer_ids(layer, block_ids), src)


class PagedKV:
    """Moves blocks between vLLM's per-layer page tensors and kvstore block buffers.

    With vLLM's hybrid KV cache manager (``spec.groups``) each layer's pages are its group's: a
    block's page ids are a tuple, one per KV cache group (``block_ids`` a ``[n, groups]``
    tensor), and each layer reads its group's column."""

    def __init__(self, spec: PageSpec, kv_caches: dict[str, torch.Tensor], *, one_launch: bool = False) -> None:
        missing = [n for n in spec.layer_names if n not in kv_caches]
        if missing:
            raise UsageError(f"vLLM registered no KV cache for layer(s) {', '.join(missing[:4])}")
        self.spec = spec
        self.layers = [kv_caches[n] for n in spec.layer_names]
        self.index = {n: i for i, n in enumerate(spec.layer_names)}
        want = (spec.num_kv_heads, spec.block_size, spec.content)
        for name, t in zip(spec.layer_names, self.layers, strict=True):
            if t.dim() != 4 or tuple(t.shape[1:]) != want or t.dtype != spec.dtype:
                raise UsageError(
                    f"layer {name}: vLLM's KV view is {tuple(t.shape)} {t.dtype}; kvstore expects "
                    f"[blocks, {want[0]}, {want[1]}, {want[2]}] {spec.dtype} (an attention backend "
                    "with another page format is not supported yet)"
                )
        self.device = self.layers[0].device
        self._page = (spec.num_kv_heads, spec.block_size, spec.content)
        self._groups = spec.groups
        # The store's own format: a layer's K and V planes, [2, H, N, D] (KV_ORDERS).
        self._planes = spec.block_format == "kvstore"
        if self._planes and spec.kv_order not in KV_ORDERS:
            raise UsageError(f"block format 'kvstore' needs a verified page order ({', '.join(KV_ORDERS)}), "
                             f"got {spec.kv_order!r}")
        self._kv_page = (2, spec.num_kv_heads, spec.block_size, spec.head_size)
        # ``one_launch``: every layer in one kernel launch where it can (a GPU with Triton; the
        # stored page is vLLM's, one page id per block); else a kernel a layer.
        self._copier = page_copier(self.layers) if one_launch and not (self._planes or self._groups) else None

    def _to_planes(self, pages: torch.Tensor) -> torch.Tensor:
        """``cpu-vec`` pages ``[n, H, N, 2D]`` as ``[n, 2, H, N, D]`` K/V planes."""
        n, (h, bt, _), d = pages.shape[0], self._page, self.spec.head_size
        halves = pages.reshape(n, h, 2, bt * d)
        k = halves[:, :, 0].reshape(n, h, d, bt).transpose(2, 3)
        v = halves[:, :, 1].reshape(n, h, bt, d)
        return torch.stack([k, v], dim=1)

    def _from_planes(self, planes: torch.Tensor) -> torch.Tensor:
        """``[n, 2, H, N, D]`` K/V planes as new ``cpu-vec`` pages ``[n, H, N, 2D]``."""
        n, (h, bt, c) = planes.shape[0], self._page
        k = planes[:, 0].transpose(2, 3).reshape(n, h, -1)
        v = planes[:, 1].reshape(n, h, -1)
        return torch.stack([k, v], dim=2).view(n, h, bt, c)

    def _layer_ids(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        return ids[:, self._groups[layer]] if self._groups else ids

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def page_bytes(self) -> int:
        return self.spec.page_bytes

    @property
    def block_bytes(self) -> int:
        return self.spec.block_bytes

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return device_ids(block_ids, self.device)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy pages ``block_ids`` of every layer into ``out`` (``[n, block_bytes]`` uint8), on
        the current stream. An ``out`` off the pages' device (a pinned host buffer) is filled
        from a device staging buffer of at most ``GATHER_STAGE_BYTES``, one contiguous copy per
        piece: a strided device-to-host copy per layer ran at 0.6-1.2 GB/s on the H200."""
        if out.device == self.device:
            self._gather(self._ids(block_ids), out)
        else:
            self._gather_staged(block_ids, lambda a, b, staged: out[a:b].copy_(staged, non_blocking=True))

    def gather_to_slots(self, block_ids: Sequence[int], slots: Any) -> None:
        """Copy pages ``block_ids`` of every layer into the arena slots of a store reservation
        (``engine.gpu.ArenaSlots``, slot ``i`` for block ``block_ids[i]``), on the current
        stream: gathered into device staging as :meth:`gather` does, each piece copied to the
        host by one DMA per run of slots, straight into the memory the store keeps the blocks
        in (no pinned buffer, no host copy). Commit the slots once the stream has synchronized."""
        self._gather_staged(block_ids, lambda a, b, staged: slots.copy_from(staged, first=a))

    def _gather_staged(self, block_ids: Sequence[int], out: Callable[[int, int, torch.Tensor], Any]) -> None:
        """Gather blocks ``a:b`` of ``block_ids`` into a device staging buffer, piece by piece,
        and hand each piece to ``out(a, b, staged)`` to copy off the device."""
        n, bb = len(block_ids), self.spec.block_bytes
        step = max(1, min(n, GATHER_STAGE_BYTES // bb))
        staged = torch.empty((step, bb), dtype=torch.uint8, device=self.device)
        for a in range(0, n, step):  # one stream: a piece's gather waits for the last one's copy out
            b = min(a + step, n)
            self._gather(self._ids(block_ids[a:b]), staged[: b - a])
            out(a, b, staged[: b - a])

    def _gather(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        if self._copier is not None:
            self._copier.gather(ids, out)
            return
        n, pb = ids.shape[0], self.spec.page_bytes
        dst = out.view(n, self.num_layers, pb)
        for i, t in enumerate(self.layers):
            if self._planes:
                pages = t.index_select(0, self._layer_ids(i, ids))
                dst[:, i].view(self.spec.dtype).view(n, *self._kv_page).copy_(self._to_planes(pages))
            else:  # one kernel straight into the strided rows: no temporary, half the device traffic
                torch.index_select(t, 0, self._layer_ids(i, ids), out=dst[:, i].view(self.spec.dtype).view(n, *self._page))

    def scatter_layer(self, layer: int, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Write layer ``layer`` of ``n`` blocks: ``src`` is ``[n, page_bytes]`` uint8 (any row
        stride, e.g. a view of the daemon's arena or of a host buffer of whole blocks)."""
        n = src.shape[0]
        pages = src.view(self.spec.dtype).view(n, *(self._kv_page if self._planes else self._page))
        if pages.device != self.device:
            pages = pages.to(self.device, non_blocking=True)
        if self._planes:
            pages = self._from_planes(pages)
        self.layers[layer].index_copy_(0, self._layer_ids(layer, block_ids), pages)

    def scatter_layers(self, lo: int, hi: int, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Write layers ``lo..hi-1`` of ``n`` blocks: ``src`` is ``[n, (hi - lo) * page_bytes]``
        uint8 (any row stride), on the current stream: one kernel launch where it can."""
        if self._copier is not None and src.device == self.device:
            self._copier.scatter(block_ids, src, lo, hi)
        else:
            scatter_each_layer(self, lo, hi, block_ids, src)

    @property
    def one_launch(self) -> bool:
        """Whether gathers and scatters take one kernel launch for every layer (``engine.pagecopy``)."""
        return self._copier is not None

    def block_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return self._ids(block_ids)


def device_ids(block_ids: Sequence[Any], device: torch.device) -> torch.Tensor:
    """Page ids as a ``long`` tensor on ``device``. On a GPU from pinned memory, in the current
    stream's order: a copy from pageable memory would make the host wait for that stream (a
    loader's copy stream: every DMA queued before it)."""
    ids = torch.tensor(list(block_ids), dtype=torch.long)
    if device.type != "cuda":
        return ids.to(device)
    return ids.pin_memory().to(device, non_blocking=True)


layer_rows = arena_layer_rows
"""Layer ``layer`` of blocks at byte ``offsets`` of a 1-D uint8 buffer as ``[n, page_bytes]``
(:func:`engine.gpu.arena_layer_rows`)."""
