"""vLLM pages <-> kvstore blocks: a round trip through the block format for any memory order,
the namespace that records the page, and the strided reads from an arena."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.vllm.pages import PagedKV, PageSpec, layer_rows, page_spec
from kvstore.config import StoreConfig, TierSpec
from kvstore.errors import UsageError
from kvstore.store import KVStore

SPEC = PageSpec(("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"), 32, 2, 64, torch.bfloat16, "LBHNC")


def _caches(num_blocks: int, permute: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for i, name in enumerate(SPEC.layer_names):
        shape = (num_blocks, SPEC.num_kv_heads, SPEC.block_size, SPEC.content)
        if permute is None:
            t = torch.randn(shape).to(torch.bfloat16)
        else:  # another memory order of the same logical [B, H, N, C] view
            phys = torch.randn([shape[p] for p in permute]).to(torch.bfloat16)
            t = phys.permute(*[permute.index(d) for d in range(4)])
        out[name] = t + i
    return out


@pytest.mark.parametrize("permute", [None, (1, 0, 2, 3), (0, 2, 1, 3)])
def test_gather_then_scatter_round_trips_pages(permute: tuple[int, ...] | None) -> None:
    src, dst = PagedKV(SPEC, _caches(10, permute)), PagedKV(SPEC, {k: torch.zeros_like(v) for k, v in _caches(10, permute).items()})
    ids = [7, 2, 5]
    buf = torch.empty((3, SPEC.block_bytes), dtype=torch.uint8)
    src.gather(ids, buf)
    # Layer-major: layer 1 of block 0 is page 7 of layer 1, in logical order.
    pb = SPEC.page_bytes
    assert torch.equal(buf[0, pb : 2 * pb].view(torch.bfloat16).view(2, 32, 128), src.layers[1][7])
    targets = dst.block_ids([1, 3, 9])
    for layer in range(3):
        dst.scatter_layer(layer, targets, buf[:, layer * pb : (layer + 1) * pb])
    for layer in range(3):
        assert torch.equal(dst.layers[layer][[1, 3, 9]], src.layers[layer][ids])
        assert not dst.layers[layer][0].any()  # nothing else written


def test_namespace_records_the_page() -> None:
    ns = SPEC.namespace("org/model", "main", 1, 4)
    assert ns.block_bytes == SPEC.block_bytes == 3 * 2 * 32 * 128 * 2
    assert (ns.rank, ns.world_size) == (1, 4) and ns.model_revision == "main+vllm-HNC1"  # the block format
    lay = ns.layout
    assert (lay.dtype, lay.block_tokens, lay.num_layers) == ("bfloat16", 32, 3)
    assert [(g.kv_heads, g.head_dim) for g in lay.groups] == [(2, 64)]
    assert SPEC.namespace("org/model", "main", 0, 4).root != ns.root  # each TP rank its own
    for other in (replace(SPEC, block_size=64), replace(SPEC, dtype=torch.float16), replace(SPEC, num_kv_heads=1),
                  replace(SPEC, head_size=128), replace(SPEC, layer_names=SPEC.layer_names[:2])):
        changed = other.namespace("org/model", "main", 1, 4)
        assert changed.root != ns.root  # another page is another namespace...
        assert changed.model_key() == ns.model_key()  # ...of the same deployment: the daemon reports it
    # vLLM's memory order is not part of the key: a block holds the same bytes whatever it is
    # (test_gather_then_scatter_round_trips_pages).
    assert replace(SPEC, layout="LBNHC").namespace("org/model", "main", 1, 4).root == ns.root


def test_layer_rows_strided_and_gathered() -> None:
    arena = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    even = layer_rows(arena, [256, 768, 1280], 1, 64)
    assert even.shape == (3, 64) and even.data_ptr() == arena[256 + 64 :].data_ptr()  # a view
    odd = layer_rows(arena, [256, 1536, 768], 1, 64)
    assert torch.equal(odd[1], arena[1536 + 64 : 1536 + 128]) and torch.equal(odd[2], arena[768 + 64 : 768 + 128])


def _kv_config(**spec_kw: object) -> SimpleNamespace:
    spec = SimpleNamespace(num_kv_heads=2, head_size=64, dtype=torch.bfloat16, block_size=32, **spec_kw)
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l.10", "l.2", "l.1"])])


def test_page_spec_orders_layers_and_refuses_what_it_cannot_store() -> None:
    assert page_spec(_kv_config(), "LBHNC").layer_names == ("l.1", "l.2", "l.10")
    with pytest.raises(UsageError, match="dense K/V"):
        page_spec(_kv_config(head_size_v=128), "LBHNC")
    two = _kv_config()
    two.kv_cache_groups.append(two.kv_cache_groups[0])
    with pytest.raises(UsageError, match="a layer is in several of this model's 2 KV cache groups"):
        page_spec(two, "LBHNC")
    with pytest.raises(UsageError, match="expects"):
        PagedKV(SPEC, {n: torch.zeros(4, 2, 32, 64, dtype=torch.bfloat16) for n in SPEC.layer_names})


def test_scatter_into_pages_on_another_device_moves_strided_host_rows_there() -> None:
    """The GPU path: rows in host memory (a strided view of the daemon's arena) written into pages
    on another device, with block ids made on that device. A CPU box has no second device with
    data, so this runs the same code on the meta device (shapes, dtypes, strides, devices: the
    values a GPU would hold are not checked here; see docs/vllm.md)."""
    caches = {n: torch.empty(10, 2, 32, 128, dtype=torch.bfloat16, device="meta") for n in SPEC.layer_names}
    kv = PagedKV(SPEC, caches)
    bb = SPEC.block_bytes
    arena = torch.zeros(8 * bb, dtype=torch.uint8)
    rows = layer_rows(arena, [0, 2 * bb, 4 * bb], 1, SPEC.page_bytes)  # evenly spaced: a strided view
    assert rows.device.type == "cpu" and not rows.is_contiguous()
    ids = kv.block_ids([1, 3, 9])
    assert ids.device == kv.device == torch.device("meta")
    kv.scatter_layer(1, ids, rows)
    assert kv.layers[1].shape == (10, 2, 32, 128) and kv.layers[1].device.type == "meta"
    with pytest.raises(RuntimeError):  # rows of the wrong size fail loudly, not silently
        kv.scatter_layer(1, ids, rows[:, : SPEC.page_bytes // 2])


def test_a_staged_gather_in_pieces_gives_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path of a gather into host memory from device pages (a staging buffer, one copy out per
    piece), here on the CPU with pieces of 3 blocks: the bytes of a plain gather."""
    import engine.vllm.pages as pages

    kv = PagedKV(SPEC, _caches(8))
    ids = [5, 0, 7, 2, 3, 6, 1]
    want = torch.zeros(len(ids), SPEC.block_bytes, dtype=torch.uint8)
    kv.gather(ids, want)
    monkeypatch.setattr(pages, "GATHER_STAGE_BYTES", 3 * SPEC.block_bytes)
    got = torch.full_like(want, 0xA5)
    kv._gather_staged(ids, lambda a, b, staged: got[a:b].copy_(staged))
    assert torch.equal(got, want)


def test_gather_to_slots_stores_the_bytes_of_a_plain_gather(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The save straight into the arena (a store reservation's slots, ``ArenaSlots``), in pieces
    of 3 blocks on the CPU: the committed blocks load as the bytes of a plain gather."""
    import engine.vllm.pages as pages
    from engine.gpu import ArenaSlots, release_arenas

    kv = PagedKV(SPEC, _caches(8))
    ids = [5, 0, 7, 2, 3, 6, 1]
    want = torch.zeros(len(ids), SPEC.block_bytes, dtype=torch.uint8)
    kv.gather(ids, want)
    monkeypatch.setattr(pages, "GATHER_STAGE_BYTES", 3 * SPEC.block_bytes)
    bb = SPEC.block_bytes
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": 16 * bb, "slab_bytes": 4 * -(-bb // 4096) * 4096}),)
    ns = SPEC.namespace("test/pages", "rev", 0, 1)
    with KVStore(StoreConfig(root=tmp_path, tiers=tiers, persist_on_close=False)) as store:
        store.register_namespace(ns)
        chain = [bytes([i]) * 16 for i in range(1, len(ids) + 1)]
        slots = ArenaSlots(store.reserve(ns, chain))
        try:
            kv.gather_to_slots(ids, slots)
            assert slots.commit() == len(ids)
        finally:
            slots.abort()  # (a no-op after the commit)
            del slots
            release_arenas()
        got = torch.zeros_like(want)
        assert store.get_into(ns, chain, got.numpy()) == len(ids)
    assert torch.equal(got, want)


def test_the_stores_own_block_format_is_the_reference_engines() -> None:
    """``block_format = kvstore`` on vLLM's CPU ``vec`` kernel (``cpu-vec``: per head a K plane
    stored transposed, ``[D][N]``, then a V plane ``[N][D]``): a block is what
    ``engine.kvlayout.pack`` makes of the same K and V (the reference engines'
    ``[layers][K, V][H][N][D]``), its namespace has no page-format tag (the reference engine's for
    the same model and revision), and it loads back into vLLM's pages unchanged."""
    from engine.kvlayout import KVShape, pack
    from engine.vllm.pages import kv_order_of

    spec = replace(SPEC, block_format="kvstore", kv_order="cpu-vec")
    h, n, d, blocks = spec.num_kv_heads, spec.block_size, spec.head_size, 6
    k = {name: torch.randn(blocks, h, n, d).to(torch.bfloat16) for name in spec.layer_names}
    v = {name: torch.randn(blocks, h, n, d).to(torch.bfloat16) for name in spec.layer_names}
    caches = {name: torch.cat([k[name].transpose(2, 3).reshape(blocks, h, -1), v[name].reshape(blocks, h, -1)],
                              dim=2).view(blocks, h, n, 2 * d) for name in spec.layer_names}
    kv = PagedKV(spec, caches)
    ids = [4, 1]
    rows = torch.empty((2, spec.block_bytes), dtype=torch.uint8)
    kv.gather(ids, rows)

    def seq(t: torch.Tensor) -> torch.Tensor:  # blocks ids of [B, H, N, D] as one [1, H, 2N, D] sequence
        return t[ids].permute(1, 0, 2, 3).reshape(1, h, 2 * n, d)

    shape = KVShape(3, h, d, torch.bfloat16, n)
    names = spec.layer_names
    assert torch.equal(rows, pack([seq(k[x]) for x in names], [seq(v[x]) for x in names], shape, 0, 2))
    assert spec.namespace("org/m", "main", 0, 1) == shape.namespace("org/m", "main")
    assert SPEC.namespace("org/m", "main", 0, 1).model_revision == "main+vllm-HNC1"
    back = PagedKV(spec, {x: torch.zeros_like(t) for x, t in caches.items()})
    idx = back.block_ids([0, 5])
    for layer in range(spec.num_layers):
        back.scatter_layer(layer, idx, rows[:, layer * spec.page_bytes : (layer + 1) * spec.page_bytes])
    for i, x in enumerate(names):
        assert torch.equal(back.layers[i][[0, 5]], caches[x][ids])
    with pytest.raises(UsageError, match="dense bf16/fp16/fp32"):
        replace(SPEC, block_format="kvstore", kv_cache_dtype="fp8", dtype=torch.uint8)
    # Only a verified kernel order: vLLM's CPU vec kernel in float32.
    assert kv_order_of([SimpleNamespace(isa="vec")] * 2, torch.float32) == "cpu-vec"
    with pytest.raises(UsageError, match=r"kernel \['amx'\] with torch.bfloat16"):
        kv_order_of([SimpleNamespace(isa="amx")], torch.bfloat16)
    with pytest.raises(UsageError, match="a GPU attention backend"):
        kv_order_of([object()], torch.float32)
    with pytest.raises(UsageError, match="verified page order"):
        PagedKV(replace(SPEC, block_format="kvstore"), caches)
