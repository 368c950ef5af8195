"""Every layer's pages in one kernel launch (``engine.pagecopy``), on Triton's interpreter over
CPU tensors: byte for byte what the per-layer copies give, for vLLM's page memory orders, a
shuffled block table, a tile of some layers from strided rows, and what it refuses (the caller
then copies layer by layer). Triton comes with vLLM: these run in ``.venv-vllm`` (the ``vllm``
mark); on a GPU ``tests/engine/vllm/test_pages_device.py`` runs the compiled kernel."""

from __future__ import annotations

import pytest
import torch

from engine.pagecopy import page_copier
from engine.vllm.pages import PagedKV, PageSpec

pytestmark = pytest.mark.vllm
triton = pytest.importorskip("triton")

SPEC = PageSpec(tuple(f"model.layers.{i}.self_attn.attn" for i in range(3)), 4, 2, 8, torch.bfloat16, "LBHNC")
# Memory orders of the logical [B, H, N, C] view: HND (B H N C), NHD (B N H C), head-major (H B N C)
ORDERS = [(0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 2, 3)]
BLOCKS = 10


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _caches(order: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, SPEC.num_kv_heads, SPEC.block_size, SPEC.content)
    out = {}
    for name in SPEC.layer_names:
        phys = torch.randn([shape[p] for p in order], generator=g).to(torch.bfloat16)
        out[name] = phys.permute(*[order.index(d) for d in range(4)])
    return out


@pytest.mark.parametrize("order", ORDERS)
def test_one_launch_gather_gives_the_bytes_of_the_per_layer_gather(order: tuple[int, ...]) -> None:
    kv = PagedKV(SPEC, _caches(order, 1), one_launch=True)
    assert kv.one_launch
    ref = PagedKV(SPEC, _caches(order, 1))  # layer by layer
    ids = [7, 2, 9, 0, 4]
    got = torch.full((len(ids), SPEC.block_bytes), 0xA5, dtype=torch.uint8)
    want = torch.full_like(got, 0x5A)
    kv.gather(ids, got)
    ref.gather(ids, want)
    assert torch.equal(got, want)


@pytest.mark.parametrize("order", ORDERS)
def test_one_launch_scatter_of_a_tile_writes_those_pages_and_layers_only(order: tuple[int, ...]) -> None:
    """Layers 1..2 of 4 blocks from a strided view of a wider staging buffer (a restore's tile)."""
    kv = PagedKV(SPEC, _caches(order, 3), one_launch=True)
    ref = PagedKV(SPEC, _caches(order, 3))
    pb = SPEC.page_bytes
    staging = torch.randint(0, 256, (4, 5 * pb), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    rows = staging[:, pb : 3 * pb]  # row stride 5 pages
    targets = torch.tensor([5, 1, 8, 3])
    kv.scatter_layers(1, 3, targets, rows)
    ref.scatter_layers(1, 3, targets, rows)
    for a, b in zip(kv.layers, ref.layers, strict=True):  # every page, written or not
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    assert torch.equal(kv.layers[1][targets].contiguous().view(torch.uint8).reshape(4, -1), rows[:, :pb])


def test_round_trip_moves_the_pages_and_nothing_else() -> None:
    src = PagedKV(SPEC, _caches((0, 2, 1, 3), 5), one_launch=True)
    dst = PagedKV(SPEC, {k: torch.zeros_like(v) for k, v in _caches((0, 2, 1, 3), 5).items()}, one_launch=True)
    ids, targets = [3, 8, 1], [0, 6, 9]
    buf = torch.empty((3, SPEC.block_bytes), dtype=torch.uint8)
    src.gather(ids, buf)
    dst.scatter_layers(0, SPEC.num_layers, dst.block_ids(targets), buf)
    untouched = [b for b in range(BLOCKS) if b not in targets]
    for a, b in zip(src.layers, dst.layers, strict=True):
        assert torch.equal(b[targets], a[ids])
        assert not b[untouched].any()


def test_layers_one_kernel_cannot_copy_are_left_to_the_per_layer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    caches = _caches((0, 1, 2, 3), 6)
    layers = list(caches.values())
    assert page_copier(layers) is not None
    assert not PagedKV(SPEC, caches).one_launch  # off unless asked (the connector's page_kernel)
    nhd = layers[1].permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # the same view over NHD memory
    assert nhd.shape == layers[0].shape and nhd.stride() != layers[0].stride()
    assert page_copier([layers[0], nhd]) is None  # layers in two memory orders
    assert page_copier([layers[0], layers[1].permute(0, 1, 3, 2)]) is None  # content not contiguous
    assert page_copier([layers[0], layers[1].float()]) is None  # another dtype
    assert page_copier([layers[0], torch.zeros(BLOCKS, 2, 4, 16, dtype=torch.bfloat16).permute(0, 2, 1, 3)]) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert page_copier(layers) is None  # CPU pages without the interpreter: per layer
    assert not PagedKV(SPEC, caches, one_launch=True).one_launch


def test_rows_of_the_wrong_shape_are_refused() -> None:
    copier = page_copier(list(_caches((0, 1, 2, 3), 7).values()))
    assert copier is not None
    with pytest.raises(ValueError, match="rows must be"):
        copier.gather(torch.tensor([1, 2]), torch.empty((2, SPEC.block_bytes - 2), dtype=torch.uint8))


def test_a_kernel_that_gives_other_bytes_is_not_used_and_the_pages_are_left_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import engine.pagecopy as pagecopy

    caches = _caches((0, 2, 1, 3), 8)
    layers = list(caches.values())
    before = [t.clone() for t in layers]
    real = pagecopy.PageCopier.scatter

    def off_by_one(self: pagecopy.PageCopier, ids: torch.Tensor, rows: torch.Tensor, lo: int, hi: int) -> None:
        real(self, ids, rows ^ 1, lo, hi)  # a miscompiled scatter

    monkeypatch.setattr(pagecopy.PageCopier, "scatter", off_by_one)
    assert page_copier(layers) is None
    for a, b in zip(layers, before, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert page_copier(layers) is not None  # the true kernel passes, and leaves them too
    for a, b in zip(layers, before, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
