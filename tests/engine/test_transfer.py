"""``engine.transfer``: blocks between host memory and vLLM's pages, byte for byte, in every
memory order vLLM 0.32 gives a connector (its ``KVCacheLayout``s: the logical ``[B, H, N, C]``
view of each layer over LBHNC = HND (FlashInfer, the CPU build), LBNHC = NHD (FlashAttention, the
CUDA default), cross-layer BLHNC / BLNHC (a block's layers back to back), LHBNC and BHLNC);
a block written under one layout reads under any other. The CPU tests run everywhere; the CUDA
ones (the DMA ring, events per layer, the save's pieces, the connector's worker against a real
daemon) where a GPU is (``tools/bench/_peers/h200_bundle.sh`` carries them to one)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.gpu import ArenaBlocks, HostBlocks, register_host, unregister_host
from engine.transfer import ConcatSource, PagedLoader, PagedSaver, tiles
from engine.vllm.pages import PagedKV, PageSpec
from kvstore.config import StoreConfig, TierSpec
from kvstore.keys import BlockHash, Namespace, hash_blocks
from kvstore.store import KVStore

BT, H, D, LAYERS, BLOCKS = 16, 2, 8, 3, 12
SPEC = PageSpec(tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)), BT, H, D, torch.bfloat16, "LBHNC")
# vLLM 0.32's KVCacheLayout members: the physical order of the logical [L, B, H, N, C] axes.
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _caches(layout: str, device: str = "cpu", seed: int | None = 0) -> dict[str, torch.Tensor]:
    """One allocation in ``layout``'s physical order, as vLLM makes it, and each layer's logical
    ``[B, H, N, C]`` view of it (random values, or zeros with ``seed=None``)."""
    logical = (LAYERS, BLOCKS, H, BT, 2 * D)
    order = LAYOUTS[layout]
    phys = torch.empty([logical[a] for a in order], dtype=SPEC.dtype, device=device)
    if seed is None:
        phys.zero_()
    else:
        g = torch.Generator(device=device).manual_seed(seed)
        phys.view(torch.int16).random_(generator=g)
    view = phys.permute(*[order.index(a) for a in range(5)])  # back to the logical order
    return {name: view[i] for i, name in enumerate(SPEC.layer_names)}


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """An exact sum of ``t``'s 16-bit words, on ``t``'s device (a kernel on the current stream)."""
    return t.contiguous().view(torch.int16).to(torch.int64).sum()


def _reference(caches: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The store's block format by definition: per block, every layer's ``[H, N, C]`` in logical order."""
    rows = [torch.cat([caches[n][b].contiguous().view(torch.uint8).flatten() for n in SPEC.layer_names]) for b in ids]
    return torch.stack(rows)


def test_tiles_cover_every_block_and_layer_once() -> None:
    for n, group, piece, tail in itertools.product((1, 7, 64), (0, 1, 2, 3, 5), (1, 100, 4096, 1 << 20), (1, 2, 4)):
        seen = np.zeros((n, LAYERS), dtype=int)
        for a, b, lo, hi in tiles(n, LAYERS, 64, piece, group, tail):
            assert 0 <= a < b <= n and 0 <= lo < hi <= LAYERS
            assert (b - a) * (hi - lo) * 64 <= max(piece, (hi - lo) * 64)
            seen[a:b, lo:hi] += 1
        assert (seen == 1).all()


def test_the_last_tile_is_cut_into_shrinking_parts() -> None:
    # 64 blocks of 4 layers x 64 bytes in tiles of 16 blocks: three whole tiles, then the last
    # one in halves (8, 4) and two equal eighths (2, 2); the last part ends the restore
    plan = tiles(64, LAYERS, 64, 16 * LAYERS * 64, 0, 4)
    assert [b - a for a, b, _, _ in plan] == [16, 16, 16, 8, 4, 2, 2]
    assert plan[-1][1] == 64
    assert [b - a for a, b, _, _ in tiles(64, LAYERS, 64, 16 * LAYERS * 64, 0, 1)] == [16] * 4
    # a plan of fewer tiles than parts is not cut (no earlier tile's DMA to queue them under)
    assert [b - a for a, b, _, _ in tiles(48, LAYERS, 64, 16 * LAYERS * 64, 0, 4)] == [16] * 3
    assert [b - a for a, b, _, _ in tiles(48, LAYERS, 64, 16 * LAYERS * 64, 0, 3)] == [16, 16, 8, 4, 4]
    # parts of one block at least
    assert [b - a for a, b, _, _ in tiles(7, LAYERS, 64, 2 * LAYERS * 64, 0, 4)] == [2, 2, 2, 1]
    assert tiles(1, LAYERS, 64, 16 * LAYERS * 64, 0, 4) == [(0, 1, 0, LAYERS)]
    # layer-wise: only the plan's last tile (the last group's) is cut
    plan = tiles(32, LAYERS, 64, 16 * 64, 1, 4)
    assert [(b - a) for a, b, lo, _ in plan if lo < LAYERS - 1] == [16, 16] * (LAYERS - 1)
    assert [(b - a) for a, b, lo, _ in plan if lo == LAYERS - 1] == [16, 8, 4, 2, 2]


def test_a_loader_refuses_a_tail_of_no_parts() -> None:
    with pytest.raises(ValueError, match="tail_parts"):
        PagedLoader(torch.device("cpu"), tail_parts=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gather_gives_the_block_format_in_every_layout(layout: str) -> None:
    caches = _caches(layout, seed=1)
    kv = PagedKV(SPEC, caches)
    ids = [7, 2, 9, 0]
    out = torch.empty((len(ids), SPEC.block_bytes), dtype=torch.uint8)
    kv.gather(ids, out)
    assert torch.equal(out, _reference(caches, ids))


@pytest.mark.parametrize("src_layout,dst_layout", [("LBNHC", "LBHNC"), ("LBHNC", "BLNHC"), ("BHLNC", "LBNHC"),
                                                   ("BLHNC", "LHBNC")])
def test_a_block_saved_under_one_layout_loads_under_another(src_layout: str, dst_layout: str) -> None:
    src = _caches(src_layout, seed=2)
    ids_src, ids_dst = [3, 8, 1], [10, 4, 6]
    blocks = torch.empty((3, SPEC.block_bytes), dtype=torch.uint8)
    PagedKV(SPEC, src).gather(ids_src, blocks)
    dst = _caches(dst_layout, seed=None)
    kv = PagedKV(SPEC, dst)
    PagedLoader(torch.device("cpu")).load(HostBlocks(blocks), kv, ids_dst)
    for name in SPEC.layer_names:
        assert torch.equal(dst[name][ids_dst].view(torch.int16), src[name][ids_src].view(torch.int16))
        untouched = [b for b in range(BLOCKS) if b not in ids_dst]
        assert not dst[name][untouched].view(torch.int16).any()


def test_the_cpu_load_reports_each_layer_and_stops_when_cancelled() -> None:
    src = _caches("LBHNC", seed=3)
    blocks = torch.empty((4, SPEC.block_bytes), dtype=torch.uint8)
    PagedKV(SPEC, src).gather([0, 1, 2, 3], blocks)
    # two sources as one: the requests of one step
    both = ConcatSource([(HostBlocks(blocks[:1]), 1), (HostBlocks(blocks[1:]), 3)])
    dst = _caches("LBNHC", seed=None)
    seen: list[tuple[int, int]] = []
    load = PagedLoader(torch.device("cpu")).load(both, PagedKV(SPEC, dst), [5, 6, 7, 8],
                                                 on_layers=lambda lo, hi, ev: seen.append((lo, hi)),
                                                 cancelled=lambda: len(seen) == 2)
    assert seen == [(0, 1), (1, 2)] and load.ready()
    for i, name in enumerate(SPEC.layer_names):
        written = torch.equal(dst[name][[5, 6, 7, 8]].view(torch.int16), src[name][[0, 1, 2, 3]].view(torch.int16))
        assert written == (i < 2)


def test_a_save_drains_in_pieces_through_a_small_host_buffer() -> None:
    src = _caches("LBNHC", seed=4)
    kv = PagedKV(SPEC, src)
    ids = [11, 0, 5, 6, 2]
    saver = PagedSaver(torch.device("cpu"), piece_bytes=2 * SPEC.block_bytes)
    staged = saver.stage(kv, ids)
    host = torch.zeros(4 * SPEC.block_bytes, dtype=torch.uint8)
    got: dict[int, torch.Tensor] = {}
    offsets = []

    def put(a: int, b: int, off: int) -> None:
        offsets.append(off)
        for i in range(a, b):
            got[i] = host[off + (i - a) * SPEC.block_bytes : off + (i - a + 1) * SPEC.block_bytes].clone()

    saver.drain(staged, host, put)
    assert offsets == [0, 2 * SPEC.block_bytes, 0]  # the two halves in turn
    assert torch.equal(torch.stack([got[i] for i in range(len(ids))]), _reference(src, ids))


class _CountedKV(PagedKV):
    def __init__(self, caches: dict[str, torch.Tensor], fail: bool = False) -> None:
        super().__init__(SPEC, caches)
        self.gathers, self.fail = 0, fail

    def gather(self, block_ids: list[int], out: torch.Tensor) -> None:  # type: ignore[override]
        self.gathers += 1
        if self.fail:
            raise torch.OutOfMemoryError("out of memory")
        super().gather(block_ids, out)


def test_a_deferred_gather_runs_once_whoever_asks_first() -> None:
    """The fence (``settle``) and the saver thread (``run``) share one gather: the pages as they
    were when it ran, whatever is written after; a failed gather is raised to ``run`` only."""
    src = _caches("LBNHC", seed=5)
    ids = [3, 1, 7]
    want = _reference(src, ids)
    kv = _CountedKV(src)
    g = PagedSaver(torch.device("cpu")).defer(kv, ids)
    assert kv.gathers == 0 and g.num_blocks == 3
    g.settle()
    for t in src.values():
        t.zero_()
    staged = g.run()
    assert kv.gathers == 1 and staged is g.run()
    assert torch.equal(staged.rows, want)
    bad = PagedSaver(torch.device("cpu")).defer(_CountedKV(_caches("LBNHC", seed=6), fail=True), ids)
    bad.settle()  # the fence does not raise
    with pytest.raises(torch.OutOfMemoryError):
        bad.run()


# ---- on a GPU --------------------------------------------------------------------------------


def _store(tmp_path: Path) -> KVStore:
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": 64 << 20, "slab_bytes": 4 << 20}),)
    return KVStore(StoreConfig(root=tmp_path, tiers=tiers, persist_on_close=False, policy="lru"))


def _stored(store: KVStore, src: dict[str, torch.Tensor], ids: list[int]) -> tuple[Namespace, list[BlockHash]]:
    """Pages ``ids`` of ``src`` (CUDA) put into ``store`` as blocks: their namespace and hashes."""
    blocks = torch.empty((len(ids), SPEC.block_bytes), dtype=torch.uint8, device="cuda")
    PagedKV(SPEC, src).gather(ids, blocks)
    ns = SPEC.namespace("test/transfer", "r", 0, 1)
    store.register_namespace(ns)
    hashes = hash_blocks(ns, np.arange(len(ids) * BT))
    store.put(ns, hashes, blocks.cpu().view(-1).numpy())
    return ns, hashes


@cuda
@pytest.mark.parametrize("layout,group,stage", [("LBNHC", 0, 1 << 30), ("LBHNC", 0, 1 << 30), ("LBNHC", 1, 1 << 30),
                                                ("BLNHC", 2, 1 << 30), ("LBNHC", 0, 0)])
def test_a_device_load_from_a_lease_writes_the_pages(tmp_path: Path, layout: str, group: int, stage: int) -> None:
    """Blocks in the registered arena, leased, DMA'd through the staging ring (``stage=0``: one
    block a tile, a ring of one, so every tile waits for the scatter before it), scattered into
    device pages of ``layout``; every layer's event fires, and the pages equal the source."""
    src = _caches(layout, "cuda", seed=5)
    ids_src, ids_dst = [0, 3, 5, 7, 9], [11, 1, 2, 8, 10]
    with _store(tmp_path) as store:
        ns, hashes = _stored(store, src, ids_src)
        lease = store.acquire(ns, hashes)
        dst = _caches(layout, "cuda", seed=None)
        piece = SPEC.block_bytes if stage == 0 else 64 << 20
        loader = PagedLoader(torch.device("cuda"), piece_bytes=piece, stage_bytes=max(stage, piece))
        ready: list[int] = []
        load = loader.load(ArenaBlocks(store, lease), PagedKV(SPEC, dst), ids_dst, layer_group=group,
                           on_layers=lambda lo, hi, ev: ready.extend(range(lo, hi)))
        assert sorted(ready) == list(range(LAYERS)) and all(ev is not None for ev in load.layer_events)
        load.wait_all()
        load.synchronize()
        store.release(lease)
        for name in SPEC.layer_names:
            assert torch.equal(dst[name][ids_dst].view(torch.int16), src[name][ids_src].view(torch.int16))


@cuda
@pytest.mark.parametrize("slots,hold", [(1, False), (2, False), (1, True), (2, True), (3, True)])
def test_loads_queued_back_to_back_share_the_staging_ring(tmp_path: Path, slots: int, hold: bool) -> None:
    """Two loads queued one after the other with no host wait between them (the connector's
    lease chunks) go on around one staging ring of one to three one-block slots: every tile
    waits for the scatter that last read its slot, and both loads' pages equal their sources.
    With ``hold_last`` the first load's last scatters go after the second's first DMA and the
    second's after the flush; every layer's event is set by then."""
    src = _caches("LBNHC", "cuda", seed=8)
    ids_src, ids_dst = [0, 3, 5, 7, 9, 2], [11, 1, 6, 8, 10, 4]
    with _store(tmp_path) as store:
        ns, hashes = _stored(store, src, ids_src)
        head, rest = store.acquire(ns, hashes[:2]), store.acquire(ns, hashes[2:])
        dst = _caches("LBNHC", "cuda", seed=None)
        loader = PagedLoader(torch.device("cuda"), piece_bytes=SPEC.block_bytes, stage_bytes=slots * SPEC.block_bytes)
        pages = PagedKV(SPEC, dst)
        first = loader.load(ArenaBlocks(store, head), pages, ids_dst[:2], hold_last=hold)
        second = loader.load(ArenaBlocks(store, rest), pages, ids_dst[2:], hold_last=hold)
        loader.flush()
        assert all(ev is not None for ev in first.layer_events + second.layer_events)
        assert first.done is not None and second.done is not None
        second.synchronize()
        first.synchronize()
        store.release(head)
        store.release(rest)
        for name in SPEC.layer_names:
            assert torch.equal(dst[name][ids_dst].view(torch.int16), src[name][ids_src].view(torch.int16))


@cuda
def test_a_device_save_lands_in_registered_host_memory_in_pieces() -> None:
    src = _caches("LBNHC", "cuda", seed=6)
    ids = [4, 2, 9, 1, 0, 11, 3]
    want = torch.empty((len(ids), SPEC.block_bytes), dtype=torch.uint8)
    PagedKV(SPEC, {k: v.cpu() for k, v in src.items()}).gather(ids, want)
    saver = PagedSaver(torch.device("cuda"), piece_bytes=2 * SPEC.block_bytes)
    staged = saver.stage(PagedKV(SPEC, src), ids)
    backing = bytearray(4 * SPEC.block_bytes)  # pageable memory, registered as the daemon's staging is
    host = torch.frombuffer(backing, dtype=torch.uint8)
    register_host(host)
    got = torch.empty_like(want)

    def put(a: int, b: int, off: int) -> None:
        got[a:b] = host[off : off + (b - a) * SPEC.block_bytes].view(b - a, -1)

    try:
        saver.drain(staged, host, put)
    finally:
        unregister_host(host)
    assert torch.equal(got, want)


@cuda
@pytest.mark.parametrize("mode,device_puts", [("async", True), ("layerwise", True), ("async", False)])
def test_the_connector_worker_saves_and_loads_device_pages_through_a_daemon(tmp_path: Path, mode: str,
                                                                            device_puts: bool) -> None:
    """The worker as vLLM drives it (``WorkerDriver``) against a real daemon over shared memory:
    a save by PUT_DEVICE (the daemon copies from the GPU into its arena) or through the daemon's
    staging segment, then a load from the lease the scheduler's lookup took into other pages,
    async or layer by layer (each layer's wait then a kernel on the forward stream)."""
    from engine.vllm.harness import WorkerDriver, small_daemon

    src = _caches("LBNHC", "cuda", seed=7)
    tokens = np.arange(100, 100 + 5 * BT)
    with small_daemon(tmp_path, dram="64MiB") as d:
        saver = WorkerDriver(d.url, SPEC, src, plane="shm", piece_bytes=2 * SPEC.block_bytes,
                             stage_bytes=2 * SPEC.block_bytes, device_puts=device_puts)
        saver.save(tokens, [0, 3, 5, 7, 9])
        client = saver.worker.save_link.client
        assert client is not None
        # the daemon on this node has the GPU: it says so, or why not
        assert client.info["put_device"], client.info.get("put_device_unavailable")
        assert saver.worker.counters.saved_blocks == 5, saver.worker.counters
        assert saver.worker.counters.save_errors == 0, saver.worker.counters
        assert (saver.worker.counters.device_puts > 0) == device_puts, saver.worker.counters
        dst = _caches("LBNHC", "cuda", seed=None)
        loader = WorkerDriver(d.url, SPEC, dst, plane="shm", load_mode=mode, layer_group=1,
                              piece_bytes=SPEC.block_bytes, stage_bytes=2 * SPEC.block_bytes)
        # an integer checksum (random bits include NaNs); only a layer-wise load is read by the
        # same step's forward: an async one's request waits in vLLM until get_finished names it
        sums: list[torch.Tensor] = []
        n = loader.load(tokens, [11, 1, 2, 8, 10], layerwise=mode == "layerwise",
                        compute=(lambda i: sums.append(_checksum(dst[SPEC.layer_names[i]][[11, 1, 2, 8, 10]])))
                        if mode == "layerwise" else None)
        torch.cuda.synchronize()
        assert n == 5
        for i, name in enumerate(SPEC.layer_names):
            assert torch.equal(dst[name][[11, 1, 2, 8, 10]].view(torch.int16), src[name][[0, 3, 5, 7, 9]].view(torch.int16))
            if sums:  # the forward's kernel at layer i saw the loaded layer
                assert int(sums[i]) == int(_checksum(src[name][[0, 3, 5, 7, 9]]))
        assert len(sums) == (len(SPEC.layer_names) if mode == "layerwise" else 0)
        # copied from the lease the scheduler's lookup took (LOOKUP_LEASE), no ACQUIRE of its own
        assert loader.worker.counters.preleased_blocks == 5, loader.worker.counters
        saver.close()
        loader.close()
