"""The worker side's pages of each model family against a real daemon, driven as vLLM drives it
on CPU page tensors (no vLLM): a sliding-window page (full layers per block, sliding layers as
window pieces at checkpoints), an all-sliding page (windows only), MLA (one copy for every
tensor-parallel rank, saved by rank 0 only), fp8 (1-byte pages, scales in the namespace) and the
KV cache groups of vLLM's hybrid manager (page ids per group), and recurrent state beside full
layers (a state of every recurrent layer at checkpoints, into the page vLLM keeps a hit's state in).
Each on the CPU and, where there is one, on a CUDA device (the GPU load and save paths of
``engine.transfer``; skipped without CUDA). Neither this module nor ``test_pages_device.py``
imports vLLM: they run on a GPU machine that has torch but no vLLM."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.vllm.config import ConnectorConfig
from engine.vllm.harness import small_daemon
from engine.vllm.pages import PageSpec, StateSpec
from engine.vllm.worker import LoadSpec, ReqInfo, SaveSpec, StateSave, StepPlan, Worker
from kvstore.client import connect
from kvstore.client.spawn import LocalDaemon
from kvstore.hybrid import CheckpointPolicy, HybridNamespaces
from kvstore.hybrid import lookup as hybrid_lookup

BT = 32
NAMES = tuple(f"model.layers.{i}.attn" for i in range(4))
HYBRID = PageSpec(NAMES, BT, 2, 64, torch.float32, "LBHNC", sliding=(NAMES[0], NAMES[2]), window=48)
ALL_SLIDING = PageSpec(NAMES, BT, 2, 64, torch.float32, "LBHNC", sliding=NAMES, window=48)
MLA = PageSpec(NAMES[:2], 16, 1, 576, torch.float32, "LBHNC", kind="mla", rope_dim=64)
FP8 = PageSpec(NAMES, BT, 2, 64, torch.uint8, "LBHNC", kv_cache_dtype="fp8")
VLLM_CONFIG = SimpleNamespace(model_config=SimpleNamespace(model="org/tiny", revision="main", quantization=None))
ROBUST = {"lookup_timeout_s": 60.0, "load_timeout_s": 60.0, "save_timeout_s": 60.0}
TOKENS = np.arange(5, 5 + 8 * BT, dtype=np.int32)  # a request of 8 full blocks


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a CUDA device"))]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[LocalDaemon]:
    with small_daemon(tmp_path, dram="64MiB") as d:
        yield d


def _caches(spec: PageSpec, seed: int | None, device: str = "cpu", blocks: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)
    shape = (blocks, spec.num_kv_heads, spec.block_size, spec.content)
    if spec.dtype == torch.uint8:
        pages = {n: torch.randint(0, 256, shape, generator=g, dtype=torch.uint8) if seed is not None
                 else torch.zeros(shape, dtype=torch.uint8) for n in spec.layer_names}
    else:
        pages = {n: torch.randn(shape, generator=g) if seed is not None else torch.zeros(shape)
                 for n in spec.layer_names}
    return {n: t.to(device) for n, t in pages.items()}


def _host(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if any(t.is_cuda for t in caches.values()):
        torch.cuda.synchronize()
    return {n: t.cpu() for n, t in caches.items()}


def _worker(url: str, spec: PageSpec, rank: int = 0, world: int = 1, plane: str = "auto") -> Worker:
    cfg = ConnectorConfig(url=url, plane=plane, **ROBUST)  # type: ignore[arg-type]
    return Worker(VLLM_CONFIG, cfg, spec, tp=(rank, world))


def _step(w: Worker, plan: StepPlan) -> None:
    w.bind(plan)
    w.start_load_kv()
    for name in w.spec.layer_names:
        w.wait_for_layer_load(name)
    w.wait_for_save()


def _save(w: Worker, tokens: np.ndarray, pages: list[int], pieces: list[int] | None = None) -> None:
    _step(w, StepPlan(infos={"s": ReqInfo(tokens, "", b"")}, saves=[SaveSpec("s", 0, pages, pieces or [])]))
    w.flush()


def _load(w: Worker, tokens: np.ndarray, pages: list[int]) -> set[int]:
    _step(w, StepPlan(infos={"l": ReqInfo(tokens, "", b"")}, loads=[LoadSpec("l", 0, pages, False)]))
    return w.take_errors()


@pytest.mark.parametrize("plane", ["shm", "tcp"])
@pytest.mark.parametrize("spec", [HYBRID, ALL_SLIDING], ids=["half-sliding", "all-sliding"])
def test_sliding_pages_store_full_layers_per_block_and_windows_at_checkpoints(daemon: LocalDaemon, device: str,
                                                                              spec: PageSpec, plane: str) -> None:
    """Saved and loaded over the daemon's shared memory (leases on its arena) or TCP (the full
    part and the window read into one host buffer, back to back)."""
    src_dev = _caches(spec, seed=1, device=device)
    src = _host(src_dev)
    pages = [3, 1, 4, 9, 2, 6, 5, 8]
    saver = _worker(daemon.url, spec)
    saver.register_kv_caches(src_dev)
    policy = CheckpointPolicy(every_blocks=4)
    hyb = saver.hyb_for("")
    assert hyb.window_blocks == 2  # window 48 over 32-token blocks: the 47 tokens before a boundary
    ckpts = policy.new_checkpoints(0, 7)  # blocks 3 and 7
    pieces = sorted({j for c in ckpts for j in hyb.checkpoint_blocks(c)})
    assert ckpts == [3, 7] and pieces == [2, 3, 6, 7]
    _save(saver, TOKENS, pages, pieces)
    assert saver.counters.saved_pieces == 4 and saver.counters.save_errors == 0
    with connect(daemon.url, plane="tcp", timeout=60) as c:
        hashes = hyb.hashes(TOKENS)
        for p in hyb.parts():
            c.register_namespace(p)
        # The reference engine's lookup finds the checkpoints: 6 cached blocks end on block 3.
        where = hybrid_lookup(c, hyb, hashes[:6], policy)
        assert where.checkpoint == 3
        if hyb.full is not None:
            assert where.full_blocks == 6 and hyb.full.block_bytes == spec.block_bytes // 2
    # Loaded by a fresh worker into other pages, up to checkpoint 3 (blocks 0..3).
    dst_dev = _caches(spec, seed=None, device=device)
    loader = _worker(daemon.url, spec, plane=plane)
    loader.register_kv_caches(dst_dev)
    into = [7, 0, 10, 11]
    assert _load(loader, TOKENS[: 4 * BT], into) == set()
    dst = _host(dst_dev)
    for name in spec.layer_names:
        if name in spec.sliding:  # the checkpoint's window only: blocks 2 and 3
            assert torch.equal(dst[name][[10, 11]], src[name][[4, 9]])
            assert not dst[name][[7, 0]].any()
        else:
            assert torch.equal(dst[name][into], src[name][pages[:4]])
    # A request whose window piece is gone fails whole (vLLM recomputes it from its first block).
    with connect(daemon.url, plane="tcp", timeout=60) as c:
        assert hyb.window is not None
        c.register_namespace(hyb.window)
        assert c.delete(hyb.window, [hyb.window_key(hyb.hashes(TOKENS)[3])]) == 1
    assert _load(loader, TOKENS[: 4 * BT], into) == set(into)
    saver.close()
    loader.close()


def test_mla_latent_pages_are_stored_once_for_every_rank(daemon: LocalDaemon, device: str) -> None:
    """Rank 1 of 2 stores nothing (its latent cache is rank 0's); both ranks load rank 0's."""
    src_dev = _caches(MLA, seed=2, device=device)
    src = _host(src_dev)
    tokens = TOKENS[: 4 * 16]
    r0, r1 = _worker(daemon.url, MLA, 0, 2), _worker(daemon.url, MLA, 1, 2)
    assert r0.ns_for("") == r1.ns_for("") and r0.ns_for("").rank == 0
    group = r0.ns_for("").layout.groups[0]
    assert (group.kind, group.latent_dim, group.rope_dim) == ("mla", 512, 64)
    for w in (r0, r1):
        w.register_kv_caches(src_dev)
    _save(r1, tokens, [1, 2, 3, 4])
    assert r1.counters.saves_submitted == 0
    _save(r0, tokens, [1, 2, 3, 4])
    assert r0.counters.saved_blocks == 4
    for rank in (0, 1):
        dst_dev = _caches(MLA, seed=None, device=device)
        w = _worker(daemon.url, MLA, rank, 2)
        w.register_kv_caches(dst_dev)
        assert _load(w, tokens, [5, 6, 7, 8]) == set()
        dst = _host(dst_dev)
        for name in MLA.layer_names:
            assert torch.equal(dst[name][[5, 6, 7, 8]], src[name][[1, 2, 3, 4]])
        w.close()
    r0.close()
    r1.close()


def test_fp8_pages_round_trip_as_bytes_and_scales_are_part_of_the_namespace(daemon: LocalDaemon,
                                                                             device: str) -> None:
    src_dev = _caches(FP8, seed=3, device=device)
    src = _host(src_dev)
    w = _worker(daemon.url, FP8)
    ns = w.ns_for("")
    assert ns.layout.dtype == "float8_e4m3fn" and ns.block_bytes == 4 * 2 * BT * 128
    assert w.spec.scales and ns.model_revision.endswith(f"+kvscales-{w.spec.scales}")
    layers = [SimpleNamespace(_k_scale_float=0.5, _v_scale_float=1.0)] * 4
    rescaled = SimpleNamespace(**vars(VLLM_CONFIG), compilation_config=SimpleNamespace(
        static_forward_context=dict(zip(NAMES, layers, strict=True))))
    other = Worker(rescaled, ConnectorConfig(url=daemon.url, **ROBUST), FP8, tp=(0, 1))  # type: ignore[arg-type]
    assert other.spec.scales != w.spec.scales and other.ns_for("").root != ns.root  # never a wrong hit
    other.close()
    w.register_kv_caches(src_dev)
    _save(w, TOKENS[: 3 * BT], [1, 2, 3])
    dst_dev = _caches(FP8, seed=None, device=device)
    r = _worker(daemon.url, FP8)
    r.register_kv_caches(dst_dev)
    assert _load(r, TOKENS[: 3 * BT], [4, 5, 6]) == set()
    dst = _host(dst_dev)
    for name in NAMES:
        assert torch.equal(dst[name][[4, 5, 6]], src[name][[1, 2, 3]])
    w.close()
    r.close()


def test_hybrid_keys_are_the_reference_engines() -> None:
    """The connector's parts are ``HybridNamespaces.of`` its namespace: the reference engine's
    keys for the same layout."""
    ns = HYBRID.namespace("org/tiny", "main", 0, 1)
    hyb = HybridNamespaces.of(ns)
    assert hyb.full is not None and hyb.window is not None
    assert [g.kind for g in ns.layout.groups] == ["full", "sliding"]
    assert hyb.full.block_bytes + hyb.window.block_bytes == HYBRID.block_bytes


HMA = PageSpec(NAMES, BT, 2, 64, torch.float32, "LBHNC", sliding=(NAMES[0], NAMES[2]), window=48,
               vllm_windows=True, groups=(0, 1, 0, 1))
"""``HYBRID`` as vLLM's hybrid KV cache manager hands it over: the sliding layers in KV cache group
0 (pages only for the window), the full ones in group 1; a block's pages are (group 0's id,
group 1's id)."""


def _load_async(w: Worker, tokens: np.ndarray, pages: list[tuple[int, int]]) -> None:
    _step(w, StepPlan(infos={"l": ReqInfo(tokens, "", b"")}, loads=[LoadSpec("l", 0, pages, True)]))
    for _ in range(6000):
        if "l" in w.get_finished():
            return
        time.sleep(0.01)
    raise AssertionError("the async load did not finish")


def test_hybrid_manager_pages_per_group_share_blocks_with_the_one_group_mode(daemon: LocalDaemon, device: str) -> None:
    """Blocks saved from one KV cache group (the hybrid manager off) load into the groups of the
    hybrid manager: the full layers from the full group's pages of every block, the sliding
    layers into the sliding group's pages of the checkpoint's window (vLLM's null block, 0,
    elsewhere, never written). Saved from the groups, they load back the same way. A lost
    window piece fails the request, reported per request (``failed_recving``): vLLM 0.32 takes
    no block-level load errors for several groups."""
    assert HMA.namespace("org/tiny", "main", 0, 1) == HYBRID.namespace("org/tiny", "main", 0, 1)
    src_dev = _caches(HYBRID, seed=3, device=device)
    src = _host(src_dev)
    one = _worker(daemon.url, HYBRID)
    one.register_kv_caches(src_dev)
    _save(one, TOKENS[: 4 * BT], [3, 1, 4, 9], [2, 3])  # checkpoint 3's window
    dst_dev = _caches(HMA, seed=None, device=device)
    w = _worker(daemon.url, HMA)
    w.register_kv_caches(dst_dev)
    into = [(0, 7), (0, 5), (10, 2), (11, 6)]
    _load_async(w, TOKENS[: 4 * BT], into)
    assert w.take_errors() == set() and w.take_failed_requests() == set()
    dst = _host(dst_dev)
    for name in HMA.layer_names:
        if name in HMA.sliding:
            assert torch.equal(dst[name][[10, 11]], src[name][[4, 9]]) and not dst[name][0].any()
        else:
            assert torch.equal(dst[name][[7, 5, 2, 6]], src[name][[3, 1, 4, 9]])
    # Saved from the groups (another prompt), loaded back by the one-group worker.
    other = TOKENS[: 4 * BT] + 1
    _save(w, other, into, [2, 3])
    assert w.counters.saved_pieces == 2 and w.counters.save_errors == 0
    back_dev = _caches(HYBRID, seed=None, device=device)
    back = _worker(daemon.url, HYBRID)
    back.register_kv_caches(back_dev)
    assert _load(back, other, [1, 2, 3, 4]) == set()
    got = _host(back_dev)
    for name in HMA.layer_names:
        rows = [2, 3] if name in HMA.sliding else [0, 1, 2, 3]
        want = [into[j][0 if name in HMA.sliding else 1] for j in rows]
        assert torch.equal(got[name][[r + 1 for r in rows]], dst[name][want])
    with connect(daemon.url, plane="tcp", timeout=60) as c:
        hyb = w.hyb_for("")
        assert hyb.window is not None
        c.register_namespace(hyb.window)
        assert c.delete(hyb.window, [hyb.window_key(hyb.hashes(other)[3])]) == 1
    _load_async(w, other, into)
    assert w.take_errors() == set() and w.take_failed_requests() == {"l"}
    for x in (one, w, back):
        x.close()


STATE = StateSpec((NAMES[0], NAMES[2]), ((3, 16), (2, 8, 8)), (torch.bfloat16, torch.float32), BT,
                  "GDN_ATTN", groups=(0, 0))
"""A gated-delta-net-shaped state (a conv and a recurrent tensor) of 2 recurrent layers in KV cache
group 0, as vLLM hands them over: ``[B, 1, 1, state_bytes]`` int8 views."""
LINEAR = PageSpec((NAMES[1], NAMES[3]), BT, 2, 64, torch.float32, "LBHNC", groups=(1, 1), state=STATE)
"""Full layers in group 1 beside them (Qwen3-Next's layout); a block's pages are (state page, KV page)."""


def _state_caches(seed: int | None, device: str, blocks: int = 12) -> dict[str, torch.Tensor]:
    caches = _caches(LINEAR, seed, device, blocks)
    g = torch.Generator().manual_seed((seed or 0) + 1)
    for name in STATE.layer_names:
        t = torch.randint(-128, 127, (blocks, 1, 1, STATE.state_bytes), generator=g, dtype=torch.int8)
        caches[name] = (t if seed is not None else torch.zeros_like(t)).to(device)
    return caches


def test_recurrent_state_at_checkpoints_beside_the_full_layers(daemon: LocalDaemon, device: str) -> None:
    """A page with recurrent layers: the full layers are saved per block, the states vLLM offers
    at blocks 3 and 7 (``StateSave``: the page holding each) under those blocks; a load of 8
    blocks writes the full layers of every block and the checkpoint's state into the state page
    of its last block only (the others are vLLM's null block, never written). With that state
    lost, the request fails whole (per request: several KV cache groups)."""
    src_dev = _state_caches(seed=5, device=device)
    src = _host(src_dev)
    w = _worker(daemon.url, LINEAR)
    w.register_kv_caches(src_dev)
    pages = [(0, p) for p in (3, 1, 4, 9, 2, 6, 5, 8)]
    _step(w, StepPlan(infos={"s": ReqInfo(TOKENS, "", b"")}, saves=[SaveSpec("s", 0, pages)],
                      states=[StateSave("s", 3, (10, 0)), StateSave("s", 7, (11, 0))]))
    w.flush()
    assert (w.counters.saved_blocks, w.counters.saved_states, w.counters.save_errors) == (8, 2, 0)
    hyb = w.hyb_for("")
    assert hyb.window is None and hyb.full is not None and hyb.state is not None
    with connect(daemon.url, plane="tcp", timeout=60) as c:
        found = hybrid_lookup(c, hyb, hyb.hashes(TOKENS)[:7], CheckpointPolicy(every_blocks=4))
        assert (found.full_blocks, found.checkpoint) == (7, 3)  # block 7 is not asked: its state is not seen
    dst_dev = _state_caches(seed=None, device=device)
    r = _worker(daemon.url, LINEAR)
    r.register_kv_caches(dst_dev)
    into = [(0, 7), (0, 5), (0, 2), (0, 6), (0, 1), (0, 3), (0, 11), (9, 10)]
    _load_async(r, TOKENS, into)
    assert r.take_failed_requests() == set() and r.counters.loaded_blocks == 8
    dst = _host(dst_dev)
    for name in LINEAR.layer_names:
        assert torch.equal(dst[name][[p for _, p in into]], src[name][[p for _, p in pages]])
    for name in STATE.layer_names:
        assert torch.equal(dst[name][9], src[name][11]) and not dst[name][torch.arange(12) != 9].any()
    with connect(daemon.url, plane="tcp", timeout=60) as c:
        c.register_namespace(hyb.state)
        assert c.delete(hyb.state, [hyb.state_key(hyb.hashes(TOKENS)[7])]) == 1
    _load_async(r, TOKENS, into)
    assert r.take_failed_requests() == {"l"}
    for x in (w, r):
        x.close()


def test_the_cuda_page_tests_import_no_vllm() -> None:
    """The GPU machine has torch and transformers but no vLLM: this module and the CUDA page tests
    import with vLLM made unimportable."""
    code = ("import sys; sys.modules['vllm'] = None; "
            "import tests.engine.vllm.test_worker_families, tests.engine.vllm.test_pages_device; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' and sys.modules[m] is not None))")
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
