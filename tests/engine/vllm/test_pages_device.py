"""vLLM pages <-> kvstore blocks on CUDA: ``PagedKV`` gather and scatter on device pages give the
same bytes as on the CPU, for vLLM's paged memory orders, a shuffled block table, the
cross-device branch (rows of a pinned host arena written into CUDA pages) and the page layouts of
the model families (MLA latent pages, fp8 bytes, sliding and full layers in the KV cache groups of
vLLM's hybrid manager, page ids per group). Skipped without CUDA (CI has none); imports no vLLM
(the GPU machine has none). Last run: one NVIDIA H200, 2026-12-01, torch 2.11: 12 passed
(``docs/results/h200-pages-device-tests.txt``), before the family layouts were added."""

from __future__ import annotations

import pytest
import torch

from engine.vllm.pages import PagedKV, PageSpec, layer_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SPEC = PageSpec(tuple(f"model.layers.{i}.self_attn.attn" for i in range(4)), 16, 4, 64, torch.bfloat16, "LBHNC")
# Memory orders of the logical [B, H, N, C] view: vLLM's HND pages (B H N C), NHD pages (B N H C)
# and a head-major order (H B N C).
ORDERS = [None, (0, 2, 1, 3), (1, 0, 2, 3)]
BLOCKS = 24


def _caches(order: tuple[int, ...] | None, device: str, seed: int) -> dict[str, torch.Tensor]:
    """Random pages in memory order ``order`` (the same values for any device, from the CPU)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    shape = (BLOCKS, SPEC.num_kv_heads, SPEC.block_size, SPEC.content)
    for name in SPEC.layer_names:
        perm = order or (0, 1, 2, 3)
        phys = torch.randn([shape[p] for p in perm], generator=g).to(torch.bfloat16).to(device)
        out[name] = phys.permute(*[perm.index(d) for d in range(4)])
    return out


def _table(seed: int, n: int) -> list[int]:
    """A shuffled block table: ``n`` distinct page ids in random order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(BLOCKS, generator=g)[:n].tolist()


@pytest.mark.parametrize("order", ORDERS)
def test_gather_on_cuda_equals_the_cpu_bytes(order: tuple[int, ...] | None) -> None:
    cpu, gpu = PagedKV(SPEC, _caches(order, "cpu", 1)), PagedKV(SPEC, _caches(order, "cuda", 1))
    ids = _table(2, 9)
    want = torch.full((len(ids), SPEC.block_bytes), 0xA5, dtype=torch.uint8)
    cpu.gather(ids, want)
    on_device = torch.full_like(want, 0x5A, device="cuda")
    gpu.gather(ids, on_device)
    pinned = torch.full_like(want, 0x5A).pin_memory()  # the connector's save path: pages to host
    gpu.gather(ids, pinned)
    torch.cuda.synchronize()
    assert torch.equal(on_device.cpu(), want)
    assert torch.equal(pinned, want)


def test_gather_into_pinned_memory_in_staged_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """More blocks than the device staging holds: pieces of 4 blocks, the bytes of one gather."""
    import engine.vllm.pages as pages

    cpu, gpu = PagedKV(SPEC, _caches(None, "cpu", 3)), PagedKV(SPEC, _caches(None, "cuda", 3))
    ids = _table(4, 11)
    want = torch.zeros((len(ids), SPEC.block_bytes), dtype=torch.uint8)
    cpu.gather(ids, want)
    monkeypatch.setattr(pages, "GATHER_STAGE_BYTES", 4 * SPEC.block_bytes)
    pinned = torch.full_like(want, 0x5A).pin_memory()
    gpu.gather(ids, pinned)
    torch.cuda.synchronize()
    assert torch.equal(pinned, want)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("spacing", ["even", "uneven"])
def test_scatter_from_a_pinned_arena_into_cuda_pages_equals_the_cpu_bytes(order: tuple[int, ...] | None, spacing: str) -> None:
    """The cross-device branch: each layer's rows are a view of a pinned host arena (strided when
    the blocks are evenly spaced, gathered otherwise), written into pages of a shuffled table."""
    bb, pb = SPEC.block_bytes, SPEC.page_bytes
    n = 7
    g = torch.Generator().manual_seed(3)
    arena = torch.randint(0, 256, (16 * bb,), dtype=torch.uint8, generator=g).pin_memory()
    offsets = [2 * i * bb for i in range(n)] if spacing == "even" else [o * bb for o in (9, 1, 14, 4, 0, 11, 6)]
    targets = _table(4, n)
    cpu = PagedKV(SPEC, _caches(order, "cpu", 5))
    gpu = PagedKV(SPEC, _caches(order, "cuda", 5))
    host_arena = arena.clone()  # unpinned twin for the CPU reference
    for layer in range(SPEC.num_layers):
        cpu.scatter_layer(layer, cpu.block_ids(targets), layer_rows(host_arena, offsets, layer, pb))
        rows = layer_rows(arena, offsets, layer, pb)
        assert rows.device.type == "cpu"
        gpu.scatter_layer(layer, gpu.block_ids(targets), rows)
    torch.cuda.synchronize()
    for layer in range(SPEC.num_layers):
        # Every page, written or not, byte for byte (the untouched ones keep their random bytes).
        a = cpu.layers[layer].contiguous().view(torch.uint8)
        b = gpu.layers[layer].cpu().contiguous().view(torch.uint8)
        assert torch.equal(a, b), f"layer {layer}"


@pytest.mark.parametrize("order", ORDERS)
def test_round_trip_through_device_blocks(order: tuple[int, ...] | None) -> None:
    """Gather pages of a shuffled table into device block buffers, scatter them into other pages
    (the same-device branch): the pages moved, nothing else was written."""
    src = PagedKV(SPEC, _caches(order, "cuda", 7))
    dst = PagedKV(SPEC, {k: torch.zeros_like(v) for k, v in _caches(order, "cuda", 7).items()})
    ids, targets = _table(8, 5), _table(9, 5)
    buf = torch.empty((len(ids), SPEC.block_bytes), dtype=torch.uint8, device="cuda")
    src.gather(ids, buf)
    pb = SPEC.page_bytes
    for layer in range(SPEC.num_layers):
        dst.scatter_layer(layer, dst.block_ids(targets), buf[:, layer * pb : (layer + 1) * pb])
    torch.cuda.synchronize()
    untouched = [b for b in range(BLOCKS) if b not in targets]
    for layer in range(SPEC.num_layers):
        assert torch.equal(dst.layers[layer][targets].cpu(), src.layers[layer][ids].cpu())
        assert not dst.layers[layer][untouched].any()


@pytest.mark.parametrize("order", ORDERS)
def test_gather_to_slots_on_cuda_stores_the_bytes_of_a_cpu_gather(order: tuple[int, ...] | None, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The GPU save into a store reservation (``cudaMemcpy2DAsync`` device-to-host into the
    registered arena, ``engine.gpu.ArenaSlots``): the committed blocks load as the bytes of the
    same gather on the CPU."""
    from engine.gpu import ArenaSlots, release_arenas
    from kvstore.config import StoreConfig, TierSpec
    from kvstore.store import KVStore

    ids = _table(7, 12)
    want = torch.empty(len(ids), SPEC.block_bytes, dtype=torch.uint8)
    PagedKV(SPEC, _caches(order, "cpu", 3)).gather(ids, want)
    kv = PagedKV(SPEC, _caches(order, "cuda", 3))
    slab = -(-SPEC.block_bytes // 4096) * 4096 * 4
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": 8 * slab, "slab_bytes": slab}),)
    ns = SPEC.namespace("test/pages-device", "rev", 0, 1)
    chain = [bytes([i + 1]) * 16 for i in range(len(ids))]
    with KVStore(StoreConfig(root=tmp_path, tiers=tiers, persist_on_close=False)) as store:
        store.register_namespace(ns)
        slots = ArenaSlots(store.reserve(ns, chain))
        try:
            kv.gather_to_slots(ids, slots)
            torch.cuda.synchronize()
            assert slots.commit() == len(ids)
        finally:
            slots.abort()
            del slots
            release_arenas()
        got = torch.zeros_like(want)
        assert store.get_into(ns, chain, got.numpy()) == len(ids)
    assert torch.equal(got, want)


FAMILIES = {
    "mla": PageSpec(SPEC.layer_names[:2], 16, 1, 576, torch.bfloat16, "LBNHC", kind="mla", rope_dim=64),
    "fp8": PageSpec(SPEC.layer_names, 16, 4, 64, torch.uint8, "LBHNC", kv_cache_dtype="fp8"),
    "hybrid-groups": PageSpec(SPEC.layer_names, 16, 4, 64, torch.bfloat16, "LBHNC",
                              sliding=SPEC.layer_names[0::2], window=32, vllm_windows=True, groups=(0, 1, 0, 1)),
}
"""MLA (one latent of 576 a token), fp8 (1-byte pages) and vLLM's hybrid KV cache manager (sliding
layers 0, 2 in group 0, full layers 1, 3 in group 1: a block's pages are one id per group)."""


def family_pages(spec: PageSpec, device: str, seed: int) -> dict[str, torch.Tensor]:
    """Random pages of ``spec`` on ``device`` (the same bytes for any device, from the CPU)."""
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, spec.num_kv_heads, spec.block_size, spec.content)
    raw = {n: torch.randint(0, 256, (*shape[:3], shape[3] * spec.dtype.itemsize), dtype=torch.uint8, generator=g)
           for n in spec.layer_names}
    return {n: t.view(spec.dtype).to(device) for n, t in raw.items()}


def family_round_trip(spec: PageSpec, device: str) -> None:
    """Gather a shuffled table's pages on ``device`` into pinned host rows (the save path): the
    bytes of the same gather on the CPU; scatter those rows into zeroed pages at other ids (the
    load path): the pages moved, nothing else was written."""
    ids: list = _table(10, 6)
    targets: list = _table(11, 6)
    if spec.groups:  # one page id per KV cache group
        ids = list(zip(ids, _table(12, 6), strict=True))
        targets = list(zip(targets, _table(13, 6), strict=True))
    want = torch.empty((len(ids), spec.block_bytes), dtype=torch.uint8)
    PagedKV(spec, family_pages(spec, "cpu", 5)).gather(ids, want)
    src = PagedKV(spec, family_pages(spec, device, 5))
    rows = torch.full_like(want, 0x5A).pin_memory() if device == "cuda" else torch.full_like(want, 0x5A)
    src.gather(ids, rows)
    dst = PagedKV(spec, {n: torch.zeros_like(t) for n, t in family_pages(spec, device, 5).items()})
    pb = spec.page_bytes
    for layer in range(spec.num_layers):
        dst.scatter_layer(layer, dst.block_ids(targets), rows[:, layer * pb : (layer + 1) * pb])
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(rows, want)
    for layer in range(spec.num_layers):
        col = spec.groups[layer] if spec.groups else None
        got = [t[col] if col is not None else t for t in targets]
        had = [i[col] if col is not None else i for i in ids]
        moved = dst.layers[layer][got].cpu().view(torch.uint8)
        assert torch.equal(moved, src.layers[layer][had].cpu().view(torch.uint8)), f"layer {layer}"
        untouched = [b for b in range(BLOCKS) if b not in got]
        assert not dst.layers[layer][untouched].cpu().view(torch.uint8).any()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_pages_round_trip_on_cuda_as_on_the_cpu(family: str) -> None:
    family_round_trip(FAMILIES[family], "cuda")


@pytest.mark.parametrize("order", ORDERS)
def test_one_launch_copies_on_cuda_give_the_per_layer_bytes(order: tuple[int, ...] | None) -> None:
    """``engine.pagecopy``'s compiled kernel (where Triton is installed, as with vLLM's CUDA
    builds): a gather, and a tile of layers 1..3 scattered from strided staging rows, byte for
    byte what the per-layer copies give."""
    fast = PagedKV(SPEC, _caches(order, "cuda", 11), one_launch=True)
    slow = PagedKV(SPEC, _caches(order, "cuda", 11))  # layer by layer
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("Triton is not installed: the per-layer copies are the only path")
    assert fast.one_launch
    ids = _table(12, 9)
    a = torch.zeros((len(ids), SPEC.block_bytes), dtype=torch.uint8, device="cuda")
    b = torch.ones_like(a)
    fast.gather(ids, a)
    slow.gather(ids, b)
    pb = SPEC.page_bytes
    g = torch.Generator().manual_seed(13)
    staging = torch.randint(0, 256, (6, 5 * pb), dtype=torch.uint8, generator=g).cuda()
    targets = fast.block_ids(_table(14, 6))
    fast.scatter_layers(1, 4, targets, staging[:, pb : 4 * pb])
    slow.scatter_layers(1, 4, targets, staging[:, pb : 4 * pb])
    torch.cuda.synchronize()
    assert torch.equal(a, b)
    for x, y in zip(fast.layers, slow.layers, strict=True):
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
