"""``page_spec`` and ``PagedKV`` against vLLM 0.32's own KV spec classes and page views
(``create_kv_cache_views``: the tensors vLLM hands ``register_kv_caches``): fp8 pages, MLA latent
pages in vLLM's MLA memory order, sliding-window layers without the hybrid manager and with it
(several KV cache groups, page ids per group), the recurrent state of a Qwen3-Next-style gated
delta net (``MambaSpec``: its pages, and a Qwen3-Next's KV cache groups as a page with recurrent state), and the loud refusals
of what the connector does not store."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed here: run `make test-vllm`")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from engine.vllm.pages import PagedKV, PagedState, page_spec, state_spec  # noqa: E402
from kvstore.errors import UsageError  # noqa: E402
from kvstore.hybrid import HybridNamespaces  # noqa: E402
from kvstore.keys import KVLayout, LayerGroup, Namespace  # noqa: E402

pytestmark = pytest.mark.vllm

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def _config(spec: object, names: list[str] = NAMES, **groups: object) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=names)], **groups)


def _vllm(cache_dtype: str = "auto", **hf: object) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                           model_config=SimpleNamespace(hf_text_config=SimpleNamespace(**hf)))


def _views(spec: object, layout: KVCacheLayout, num_blocks: int = 6, names: list[str] = NAMES,
           raw: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """vLLM's per-layer page views of one backing tensor (``raw``, else a random one), as its
    model runner builds them."""
    page = spec.page_size_bytes  # type: ignore[attr-defined]
    size = page * num_blocks * len(names)
    if raw is None:
        raw = torch.randint(0, 256, (size,), dtype=torch.uint8).view(torch.int8)
    if layout.is_layer_compact:
        t = KVCacheTensor(size, names, layer_stride=page * num_blocks, block_stride=page)
    else:
        t = KVCacheTensor(size, names, layer_stride=page, block_stride=page * len(names))
    views = create_kv_cache_views(raw, spec, num_blocks, layout, t)  # type: ignore[arg-type]
    return dict(zip(names, views, strict=True))


def _move(a: PagedKV | PagedState, b: PagedKV | PagedState, layer_bytes: int) -> None:
    """Blocks in pages 4 and 1 of ``a`` into pages 0 and 5 of ``b``, through block rows."""
    rows = torch.empty((2, layer_bytes * len(a.layers)), dtype=torch.uint8)
    a.gather([4, 1], rows)
    ids = b.block_ids([0, 5])
    for layer in range(len(b.layers)):
        b.scatter_layer(layer, ids, rows[:, layer * layer_bytes : (layer + 1) * layer_bytes])


def _round_trip(spec: object, layout: KVCacheLayout, vllm_config: SimpleNamespace) -> None:
    ps = page_spec(_config(spec), layout.name, vllm_config)
    src, dst = _views(spec, layout), _views(spec, layout)
    for t in dst.values():
        t.fill_(0)
    _move(PagedKV(ps, src), PagedKV(ps, dst), ps.page_bytes)
    for name in NAMES:
        assert torch.equal(dst[name][[0, 5]].view(torch.uint8), src[name][[4, 1]].view(torch.uint8))


@pytest.mark.parametrize("kv", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_pages_move_as_bytes_and_record_the_format(kv: str) -> None:
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    ps = page_spec(_config(spec), "LBHNC", _vllm(kv))
    assert ps.quantized and ps.page_bytes == 2 * 32 * 128
    ns = ps.namespace("org/m", "main", 0, 1)
    assert ns.layout.dtype == ("float8_e5m2" if kv == "fp8_e5m2" else "float8_e4m3fn")
    _round_trip(spec, KVCacheLayout.LBHNC, _vllm(kv))


def test_mla_latent_pages_in_vllms_mla_memory_order() -> None:
    """vLLM's MLA page (one latent of 576 a token, no heads, ``head_size_v`` 0; the CPU build's
    resolved layout is ``LBNHC``) is stored as one latent row per token and layer."""
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1)
    ps = page_spec(_config(spec), "LBNHC", _vllm(qk_rope_head_dim=64, kv_lora_rank=512))
    assert (ps.kind, ps.content, ps.rope_dim, ps.page_bytes) == ("mla", 576, 64, 16 * 576 * 2)
    (group,) = ps.namespace("org/m", "main", 0, 8).layout.groups
    assert (group.kind, group.latent_dim, group.rope_dim) == ("mla", 512, 64)
    for layout in (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC):
        _round_trip(spec, layout, _vllm(qk_rope_head_dim=64))


def test_sliding_layers_without_the_hybrid_manager() -> None:
    """With the hybrid manager off, vLLM merges full and sliding layers into one group whose spec
    carries the window; which layers slide comes from the config's ``layer_types``."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64)
    types = ["sliding_attention", "full_attention"] * 2
    ps = page_spec(_config(spec), "LBHNC", _vllm(layer_types=types))
    assert ps.sliding == (NAMES[0], NAMES[2]) and ps.window == 64
    assert [g.kind for g in ps.namespace("org/m", "main", 0, 1).layout.groups] == ["full", "sliding"]
    assert page_spec(_config(spec), "LBHNC", _vllm()).sliding == tuple(NAMES)  # no layer_types: every layer
    # Every layer slides (Mistral): one group, vLLM's own sliding one, which keeps only windows.
    sw = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64)
    ps = page_spec(_config(sw), "LBHNC", _vllm())
    assert ps.sliding == tuple(NAMES) and ps.vllm_windows


def _hma(*groups: tuple[object, list[str]]) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=n) for s, n in groups])


def test_sliding_groups_of_the_hybrid_manager() -> None:
    """vLLM's hybrid KV cache manager puts Gemma 3's sliding layers (0, 2) in a sliding-window
    group and its full layers (1, 3) in another, one page shape for both, each layer indexed by
    its group's block ids. The namespace is the one-group mode's (both modes share blocks); a
    block's pages are a tuple (sliding group's id, full group's id)."""
    sw = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64)
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    ps = page_spec(_hma((sw, [NAMES[0], NAMES[2]]), (full, [NAMES[1], NAMES[3]])), "LBHNC", _vllm())
    assert ps.layer_names == tuple(NAMES) and ps.groups == (0, 1, 0, 1) and ps.num_groups == 2
    assert ps.sliding == (NAMES[0], NAMES[2]) and ps.window == 64 and ps.vllm_windows
    one = page_spec(_config(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                              sliding_window=64)),
                    "LBHNC", _vllm(layer_types=["sliding_attention", "full_attention"] * 2))
    assert ps.namespace("org/m", "main", 0, 1) == one.namespace("org/m", "main", 0, 1)
    assert ps.part(True).groups == (0, 0) and ps.part(False).groups == (1, 1)
    src, dst = _views(full, KVCacheLayout.LBHNC), _views(full, KVCacheLayout.LBHNC)
    for t in dst.values():
        t.fill_(0)
    a, b = PagedKV(ps, src), PagedKV(ps, dst)
    rows = torch.empty((2, ps.block_bytes), dtype=torch.uint8)
    a.gather([(4, 1), (0, 5)], rows)  # block 0: sliding page 4, full page 1; block 1: 0 and 5
    ids = b.block_ids([(2, 3), (1, 0)])
    for layer in range(ps.num_layers):
        b.scatter_layer(layer, ids, rows[:, layer * ps.page_bytes : (layer + 1) * ps.page_bytes])
    for name, (got, want) in zip(NAMES, [([2, 1], [4, 0]), ([3, 0], [1, 5])] * 2, strict=True):
        assert torch.equal(dst[name][got].view(torch.uint8), src[name][want].view(torch.uint8))


def test_what_the_connector_does_not_store_is_refused_with_what_it_does() -> None:
    sw = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64)
    sw2 = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=128)
    wide = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=64, dtype=torch.float32)
    with pytest.raises(UsageError, match="2 KV cache groups of different pages"):
        page_spec(_hma((sw, NAMES[:2]), (wide, NAMES[2:])), "LBHNC", _vllm())
    with pytest.raises(UsageError, match=r"windows \[64, 128\]"):
        page_spec(_hma((sw, NAMES[:2]), (sw2, NAMES[2:])), "LBHNC", _vllm())
    per_token = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                                  kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)
    with pytest.raises(UsageError, match="fp8_e5m2 with per-tensor scales"):
        page_spec(_config(per_token), "LBHNC", _vllm("fp8_per_token_head"))
    mamba = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(UsageError, match="recurrent layers only.*MambaSpec"):  # Mamba2: no attention to key it
        page_spec(_config(mamba), "LBHNC", _vllm())
    full = FullAttentionSpec(block_size=544, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(UsageError, match="mamba_cache_mode 'align'"):  # vLLM's prefix cache off: no states kept
        page_spec(_hma((_gdn_spec("none"), NAMES[0::2]), (full, NAMES[1::2])), "LBHNC", _vllm())
    with pytest.raises(UsageError, match="'linear_attention' layer"):
        page_spec(_config(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                            sliding_window=64)), "LBHNC",
                  _vllm(layer_types=["sliding_attention", "linear_attention"] * 2))


def test_the_sliding_mode_follows_vllms_prefix_cache() -> None:
    """Mixed full and sliding layers: windows only with vLLM's prefix cache off (its cache would
    keep pages whose sliding layers hold only a checkpoint's window); every layer slides: windows
    always (vLLM's own sliding group keeps only windows)."""
    from engine.vllm.config import ConnectorConfig
    from engine.vllm.connector import sliding_mode

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64)
    mixed = page_spec(_config(spec), "LBHNC", _vllm(layer_types=["sliding_attention", "full_attention"] * 2))
    auto, window, every = (ConnectorConfig(sliding=m) for m in ("auto", "window", "every_layer"))
    assert sliding_mode(mixed, auto, prefix_caching=False) == mixed
    assert not sliding_mode(mixed, auto, prefix_caching=True).hybrid  # every layer, as dense
    assert not sliding_mode(mixed, every, prefix_caching=False).hybrid
    with pytest.raises(UsageError, match="--no-enable-prefix-caching"):
        sliding_mode(mixed, window, prefix_caching=True)
    sw = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64)
    all_sliding = page_spec(_config(sw), "LBHNC", _vllm())
    assert sliding_mode(all_sliding, auto, prefix_caching=True) == all_sliding
    with pytest.raises(UsageError, match="only windows can be stored"):
        sliding_mode(all_sliding, every, prefix_caching=False)
    # The hybrid manager on: its sliding groups keep only windows, which its prefix cache tracks.
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    hma = page_spec(_hma((sw, [NAMES[0], NAMES[2]]), (full, [NAMES[1], NAMES[3]])), "LBHNC", _vllm())
    assert sliding_mode(hma, auto, prefix_caching=True) == hma
    assert sliding_mode(hma, window, prefix_caching=True) == hma
    with pytest.raises(UsageError, match="--disable-hybrid-kv-cache-manager"):
        sliding_mode(hma, every, prefix_caching=True)


def _gdn_spec(mode: str = "align") -> MambaSpec:
    """The ``MambaSpec`` vLLM 0.32's CPU build gives the gated delta net layers of a tiny
    Qwen3-Next (2 key heads and 4 value heads of 128, conv kernel 4, bf16 model; the recurrent
    state in fp32), its page padded to the full-attention page of 544-token blocks (2 KV heads of
    64, bf16: 278,528 bytes), as read off a running engine."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 2, 4, 128, 128, 4)
    return MambaSpec(block_size=544, shapes=tuple(shapes), dtypes=(torch.bfloat16, torch.float32),
                     page_size_padded=2 * 544 * 2 * 64 * 2, mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                     mamba_cache_mode=mode)


class _Layer:
    """A recurrent layer's state tensors as vLLM binds them (``MambaBase.bind_kv_cache``)."""

    def __init__(self, spec: MambaSpec) -> None:
        self.spec = spec
        self.kv_cache: tuple[torch.Tensor, ...] = ()

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.spec.shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.spec.dtypes


def test_recurrent_state_pages_against_vllms_mamba_spec() -> None:
    """vLLM hands a connector each recurrent layer as an int8 view ``[B, 1, 1, state_bytes]`` over
    pages padded to the attention page (``create_kv_cache_views``), in which the layer binds its
    conv and recurrent state tensors (``MambaBase.bind_kv_cache``). ``PagedState`` moves a state
    of every layer between those pages and a block: the layer's own state tensors arrive equal,
    nothing else (other pages, the padding) is written. The namespace's ``recurrent`` group is
    the state part ``kvstore.hybrid`` keys a checkpoint's state under."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    spec = _gdn_spec()
    assert spec.shapes == ((3, 1024), (4, 128, 128))  # conv state (kernel - 1 taps), recurrent state
    names = NAMES[0::2]
    st = state_spec(SimpleNamespace(kv_cache_spec=spec, layer_names=names))
    assert (st.state_bytes, st.num_layers, st.mamba_type) == (3 * 1024 * 2 + 4 * 128 * 128 * 4, 2, "GDN_ATTN")

    def pages(seed: int, blocks: int = 6) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[_Layer]]:
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (spec.page_size_bytes * blocks * 2,), dtype=torch.uint8, generator=g)
        views = _views(spec, KVCacheLayout.LBHNC, blocks, names, raw.view(torch.int8))
        layers = [_Layer(spec) for _ in names]
        for layer, name in zip(layers, names, strict=True):
            MambaBase.bind_kv_cache(layer, views[name])  # type: ignore[arg-type]
        return raw, views, layers

    _, src_views, src = pages(1)
    assert tuple(src_views[names[0]].shape) == (6, 1, 1, st.state_bytes)
    raw, dst_views, dst = pages(2)
    before = raw.clone()
    _move(PagedState(st, src_views), PagedState(st, dst_views), st.state_bytes)
    for s_layer, d_layer in zip(src, dst, strict=True):
        for s_state, d_state in zip(s_layer.kv_cache, d_layer.kv_cache, strict=True):
            assert torch.equal(d_state[[0, 5]].view(torch.uint8), s_state[[4, 1]].view(torch.uint8))
    written = torch.zeros_like(raw, dtype=torch.bool)
    for layer in range(2):
        for block in (0, 5):
            start = layer * 6 * spec.page_size_bytes + block * spec.page_size_bytes
            written[start : start + st.state_bytes] = True
    assert torch.equal(raw[~written], before[~written])  # other pages and the padding untouched
    full = LayerGroup("full", 2, 2, 64)
    ns = Namespace("org/qwen3-next-tiny", KVLayout("bfloat16", 544, (full, st.layer_group("bfloat16"))))
    hyb = HybridNamespaces.of(ns)
    assert hyb.state is not None and hyb.state.block_bytes == st.block_bytes
    assert hyb.full is not None and hyb.full.block_bytes == 2 * 544 * 2 * 2 * 64 * 2
    with pytest.raises(UsageError, match="mamba_cache_mode 'align'"):
        state_spec(SimpleNamespace(kv_cache_spec=_gdn_spec("none"), layer_names=names))


def test_a_qwen3_next_page_records_its_recurrent_state() -> None:
    """vLLM's KV cache groups of the tiny Qwen3-Next (a ``MambaSpec`` group of the gated delta net
    layers, a full-attention group): the attention layers are the full part, the recurrent ones
    the state part (``PageSpec.state``, each layer read from its group's pages); the namespace's
    layout records the state's size (a change is a reported layout conflict) and its revision
    the state's tensor shapes and dtypes (another arrangement of the same bytes is another
    namespace, never a wrong hit)."""
    full = FullAttentionSpec(block_size=544, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    spec = page_spec(_hma((_gdn_spec(), NAMES[0::2]), (full, NAMES[1::2])), "LBHNC", _vllm())
    assert spec.layer_names == tuple(NAMES[1::2]) and spec.groups == (1, 1) and spec.num_groups == 2
    assert spec.state is not None and spec.state.layer_names == tuple(NAMES[0::2]) and spec.state.groups == (0, 0)
    assert spec.hybrid and not spec.sliding
    ns = spec.namespace("org/qwen3-next-tiny", "main", 0, 1)
    hyb = HybridNamespaces.of(ns)
    assert hyb.window is None and hyb.full is not None and hyb.state is not None
    assert hyb.full.block_bytes == spec.block_bytes == 2 * 544 * 2 * 2 * 64 * 2
    assert hyb.state.block_bytes == spec.state.block_bytes == 2 * (3 * 1024 * 2 + 4 * 128 * 128 * 4)
    assert ns.model_revision == f"main+vllm-HNC1+{spec.state.tag()}"
    other = replace(spec, state=replace(spec.state, shapes=((1024, 3), (4, 128, 128))))  # the conv state's DS layout
    assert other.namespace("org/qwen3-next-tiny", "main", 0, 1).root != ns.root
    # Pages of several recurrent groups: each layer reads its own group's id of a block's tuple.
    st = replace(spec.state, groups=(0, 2))
    g = torch.Generator().manual_seed(3)
    views = {n: torch.randint(-128, 127, (4, 1, 1, st.state_bytes), dtype=torch.int8, generator=g) for n in st.layer_names}
    out = torch.empty((1, st.block_bytes), dtype=torch.uint8)
    PagedState(st, views).gather([(1, 9, 3)], out)
    assert torch.equal(out.view(2, -1)[0], views[st.layer_names[0]][1].view(torch.uint8).flatten())
    assert torch.equal(out.view(2, -1)[1], views[st.layer_names[1]][3].view(torch.uint8).flatten())
