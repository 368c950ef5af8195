"""The peer benchmark without the peers: its arguments, its result math, the adapter contract
against kvstore itself and the baselines, and a quick run of the kvstore rows end to end.
(LMCache and Mooncake live in .venv-peers: ``make bench-peers``; their figures are in
docs/benchmarks.md, "Against the peers".)"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

from tools.bench.__main__ import main as bench_main
from tools.bench._common import missed_goals
from tools.bench._peers.base import Adapter
from tools.bench._peers.baselines import MemcpyStore
from tools.bench._peers.child import make_adapter, run_peer, workload_from
from tools.bench._peers.kv import InProcess
from tools.bench._peers.workload import Geometry, Request, Workload, drive, make_request
from tools.bench.peers import compare, parser, peer_rows, select

TINY = Geometry(layers=2)  # 8 KiB a token, 2 MiB a chunk


def tiny(tmp_path, **kw) -> Workload:  # type: ignore[no-untyped-def]
    fields = {"tokens": 1024, "fit": 2, "rounds": 2, "lookups": 2, "clients": 4, "per_client": 1,
              "geometry": TINY, "scratch": str(tmp_path)}
    return Workload(**{**fields, **kw})


# ---- arguments -------------------------------------------------------------------------------


def test_only_selects_peers_and_families_in_run_order() -> None:
    assert select("kvstore*") == ["kvstore", "kvstore-shm", "kvstore-tcp"]
    assert select("kvstore") == ["kvstore"]
    assert select("mooncake,memcpy") == ["memcpy", "mooncake"]
    assert select("lmcache") == ["lmcache-cpu", "lmcache-cpu-mt", "lmcache-disk", "lmcache-redis"]
    assert select("kvstore-tcp") == ["kvstore-tcp"]
    assert len(select(None)) == 10


def test_an_unknown_peer_is_refused_with_the_known_ones() -> None:
    with pytest.raises(SystemExit, match="unknown peer.*vllm.*known: memcpy, socket, kvstore"):
        select("kvstore,vllm")


def test_arguments_parse_and_help_explains(capsys: pytest.CaptureFixture[str]) -> None:
    args = parser().parse_args(["--sizes", "4096,32768", "--only", "kvstore", "--quick"])
    assert args.sizes == (4096, 32768) and args.quick and args.clients == 8
    with pytest.raises(SystemExit) as e:
        bench_main(["peers", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("LMCache", "Mooncake", "--only", "unavailable", "make bench-peers", "Llama-3-8B"):
        assert word in out


def test_geometry_is_llama_8b_and_capacity_is_whole_slabs() -> None:
    g = Geometry()
    assert g.token_bytes == 128 * 1024 and g.chunk_bytes == 32 << 20
    w = Workload(tokens=4096, fit=4)
    assert w.request_bytes == 512 << 20 and w.chunks == 16
    assert w.capacity_bytes == 9 * w.slab_bytes  # 4 requests + 2 chunks, rounded up to 256 MiB slabs
    with pytest.raises(ValueError, match="multiple of 256"):
        Workload(tokens=1000, fit=1)


# ---- result math -----------------------------------------------------------------------------


def _res(store: float, retrieve: float) -> dict:  # type: ignore[type-arg]
    figures = {"store_gbps": store, "first_round_gbps": store / 2, "retrieve_gbps": retrieve,
               "memcpy_gbps": 10.0, "memcpy_mt_gbps": 16.0, "memcpy_threads": 2, "lookup_ms": 0.5, "hash_ms": 0.1, "retrieve_p50_ms": 40.0,
               "concurrent_p50_ms": 100.0, "concurrent_p99_ms": 200.0}
    return {"figures": figures, "info": {}, "missing_tokens": 0, "wrong_chunks": 0, "errors": [],
            "error_count": 0, "samples": {"lookup": 40, "retrieve": 12, "concurrent": 16}}


def test_peer_rows_carry_figure_baseline_and_ratio() -> None:
    w = Workload(tokens=4096, fit=4)
    rows = {r["metric"]: r for r in peer_rows("kvstore", w, _res(4.0, 8.0))}
    assert set(rows) == {"kvstore_4k_store", "kvstore_4k_retrieve", "kvstore_4k_lookup",
                         "kvstore_4k_retrieve_p99_8_clients", "kvstore_4k_store_vs_mt_memcpy",
                         "kvstore_4k_retrieve_vs_mt_memcpy"}
    mt = rows["kvstore_4k_retrieve_vs_mt_memcpy"]
    assert (mt["value"], mt["baseline"], mt["ratio"], mt["memcpy_threads"]) == (8.0, 16.0, 0.5, 2)
    assert rows["kvstore_4k_store"]["ratio"] == 0.4 and rows["kvstore_4k_store"]["first_round_gbps"] == 2.0
    assert rows["kvstore_4k_retrieve"]["value"] == 8.0 and rows["kvstore_4k_retrieve"]["verified"] is True
    assert rows["kvstore_4k_lookup"]["ratio"] == 5.0 and rows["kvstore_4k_lookup"]["unit"] == "ms"
    p99 = rows["kvstore_4k_retrieve_p99_8_clients"]
    assert (p99["value"], p99["baseline"], p99["ratio"], p99["p50_ms"]) == (200.0, 40.0, 5.0, 100.0)


def test_long_requests_run_the_concurrent_phase_unless_skipped() -> None:
    args = parser().parse_args([])
    from tools.bench.peers import workload

    long, short = workload(args, 32768), workload(args, 4096)
    assert (long.fit, long.rounds, long.concurrent, long.per_client) == (1, 2, True, 1)
    assert (short.fit, short.rounds, short.concurrent, short.per_client) == (4, 3, True, 2)
    long = workload(parser().parse_args(["--skip-concurrent-long"]), 32768)
    assert not long.concurrent and workload(parser().parse_args(["--skip-concurrent-long"]), 4096).concurrent
    res = _res(1.0, 1.0)
    res["samples"]["concurrent"] = 0
    rows = peer_rows("kvstore", long, res)
    assert rows[-1]["status"] == "skipped" and "--skip-concurrent-long" in rows[-1]["error"]


def test_a_peer_that_cannot_run_is_one_row_with_the_error() -> None:
    w = Workload(tokens=32768, fit=1)
    (row,) = peer_rows("mooncake", w, {"unavailable": "mooncake is not installed"})
    assert row["metric"] == "mooncake_32k_unavailable" and row["status"] == "unavailable"
    assert row["error"] == "mooncake is not installed" and "value" not in row
    (row,) = peer_rows("lmcache-redis", w, {"failed": "RuntimeError: boom"})
    assert row["status"] == "failed" and row["error"] == "RuntimeError: boom"


def test_comparisons_state_the_goals_of_the_issue() -> None:
    w = Workload(tokens=4096, fit=4)
    figs = {"kvstore": _res(6.0, 6.0)["figures"], "kvstore-tcp": _res(1.0, 2.0)["figures"],
            "lmcache-cpu": _res(5.0, 4.0)["figures"], "mooncake": _res(7.0, 3.0)["figures"]}
    rows = {r["metric"]: r for r in compare(w, figs)}
    assert set(rows) == {f"{kv}_vs_{p}_4k_{op}" for kv in ("kvstore", "kvstore-tcp")
                         for p in ("lmcache-cpu", "mooncake") for op in ("store", "retrieve")}
    s = rows["kvstore_vs_lmcache-cpu_4k_store"]
    assert (s["value"], s["baseline"], s["ratio"], s["goal_ratio"]) == (6.0, 5.0, 1.2, 1.2)
    assert missed_goals(s) == []
    assert missed_goals(rows["kvstore_vs_mooncake_4k_store"]) == ["ratio 0.8571 < goal 1 (value / baseline)"]
    assert missed_goals(rows["kvstore_vs_mooncake_4k_retrieve"]) == []
    assert rows["kvstore-tcp_vs_mooncake_4k_store"]["goal_ratio"] is None
    figs["mooncake"] = {**figs["mooncake"], "retrieve_gbps": 0.0, "verified": False}
    rows = {r["metric"]: r for r in compare(w, figs)}
    lost = rows["kvstore_vs_mooncake_4k_retrieve"]
    assert lost["status"] == "not comparable" and "mooncake did not hold" in lost["error"] and "ratio" not in lost


def test_table_shows_spreads_and_goal_counts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tools.bench._peers.table import load, spread, tables

    assert spread([1.0, 2.5], 2) == "1.00–2.50" and spread([3.0], 2) == "3.00 (1 of 2 runs)" and spread([], 1) == "—"
    w = Workload(tokens=4096, fit=4)
    paths = []
    for i, kv in enumerate((6.5, 5.5)):
        figs = {"kvstore": _res(kv, 6.0), "lmcache-cpu": _res(5.0, 4.0)}
        rows = [r for p, res in figs.items() for r in peer_rows(p, w, res)]
        rows += compare(w, {p: res["figures"] for p, res in figs.items()})
        rows += peer_rows("mooncake", w, {"unavailable": "not installed"})
        path = tmp_path / f"run{i}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows))
        paths.append(str(path))
    text = tables(load(paths))
    assert "| kvstore | 5.50–6.50 | 6.00 | 10.00 | 16.00 (2 threads) |" in text
    assert "| mooncake | unavailable (2 of 2 runs): not installed |" in text
    assert "| kvstore vs lmcache-cpu | 1.10–1.30 | 1.50 | ≥ 1.2 | 1 of 2, 2 of 2 |" in text


# ---- the adapter contract, against kvstore and the baselines ---------------------------------


@pytest.mark.parametrize("adapter", [InProcess, MemcpyStore])
def test_adapter_contract_round_trip_and_lru(adapter: type[Adapter], tmp_path) -> None:  # type: ignore[no-untyped-def]
    w = tiny(tmp_path)
    a = adapter()
    a.open(w)
    try:
        src = np.random.default_rng(1).integers(0, 256, w.request_bytes, dtype=np.uint8)
        reqs = [make_request(w, i) for i in range(w.capacity_bytes // w.request_bytes + 1)]
        for r in reqs:  # one more than fits: the first leaves (LRU)
            a.store(r, src)
        assert a.lookup(reqs[0]) == 0
        for r in reqs[1:]:
            assert a.lookup(r) == w.tokens
            dst = np.zeros_like(src)
            assert a.retrieve(r, dst) == w.tokens
            assert np.array_equal(dst, src)
        assert a.retrieve(reqs[0], np.zeros_like(src)) == 0
    finally:
        a.close()


@pytest.mark.parametrize("peer", ["kvstore", "memcpy"])
def test_drive_verifies_every_byte(peer: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = run_peer(peer, tiny(tmp_path))
    assert res["wrong_chunks"] == 0 and res["missing_tokens"] == 0, res["errors"]
    assert res["samples"] == {"lookup": 4, "retrieve": 4, "concurrent": 4}
    f = res["figures"]
    assert f["store_gbps"] > 0 and f["retrieve_gbps"] > 0 and f["memcpy_gbps"] > 0
    assert f["concurrent_p99_ms"] >= f["concurrent_p50_ms"] > 0


class _SwapsChunks(MemcpyStore):
    """Serves chunk 1 where chunk 0 belongs: the check must see it."""

    def retrieve(self, req: Request, dst: np.ndarray) -> int:
        n = super().retrieve(req, dst)
        cb = self.w.geometry.chunk_bytes
        dst[:cb] = dst[cb : 2 * cb].copy()
        return n


class _Forgets(MemcpyStore):
    def lookup(self, req: Request) -> int:
        return 0


def test_drive_catches_wrong_bytes_and_missing_tokens(tmp_path) -> None:  # type: ignore[no-untyped-def]
    w = tiny(tmp_path, rounds=1, lookups=1, clients=2)
    for bad, field in ((_SwapsChunks(), "wrong_chunks"), (_Forgets(), "missing_tokens")):
        bad.open(w)
        try:
            f = drive(bad, w)
        finally:
            bad.close()
        assert getattr(f, field) > 0 and f.errors


def test_paired_drive_times_every_peer_on_every_call_and_checks_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tools.bench._peers.child import run_paired

    w = tiny(tmp_path)
    res = run_paired(["kvstore", "memcpy"], w)
    calls = w.rounds * w.fit
    for peer in ("kvstore", "memcpy"):
        r = res[peer]
        assert r["wrong_chunks"] == 0 and r["missing_tokens"] == 0, r["errors"]
        assert len(r["lat"]["store"]) == len(r["lat"]["retrieve"]) == calls
        assert r["figures"]["store_gbps"] > 0 and r["figures"]["memcpy_gbps"] > 0
    # a paired bad peer is caught as when it runs alone
    bad = _SwapsChunks()
    bad.open(w)
    good = InProcess()
    good.open(w)
    try:
        from tools.bench._peers.workload import drive_paired

        figs = drive_paired({"bad": bad, "kvstore": good}, w)
    finally:
        bad.close()
        good.close()
    assert figs["bad"].wrong_chunks > 0 and figs["kvstore"].wrong_chunks == 0


def test_paired_ratios_are_call_by_call() -> None:
    from tools.bench.peers import paired_ratios

    kv = {"paired": True, "lat": {"store": [1.0, 2.0, 1.0], "retrieve": [1.0]}}
    peer = {"paired": True, "lat": {"store": [2.0, 2.0, 3.0], "retrieve": [0.5]}}
    assert paired_ratios(kv, peer, "store") == {"paired_median_ratio": 2.0, "paired_min_ratio": 1.0,
                                                "paired_max_ratio": 3.0, "paired_calls": 3}
    assert paired_ratios(kv, peer, "retrieve")["paired_median_ratio"] == 0.5
    assert paired_ratios({**kv, "paired": False}, peer, "store") == {}


def test_a_child_that_dies_without_a_result_never_reports_the_last_sizes(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import sys

    from tools.bench import peers

    w = Workload(tokens=256, fit=1, geometry=Geometry(layers=2))
    (tmp_path / "memcpy.out.json").write_text(json.dumps({"figures": {}, "missing_tokens": 0, "wrong_chunks": 0}))
    monkeypatch.setattr(peers, "_command", lambda names, spec: ([sys.executable, "-c", "raise SystemExit(3)"], {}))
    res = peers.run_child("memcpy", w, tmp_path, 60)
    assert res["failed"].startswith("exit 3 without a result"), res


def test_child_spec_round_trips_the_workload(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import asdict

    w = tiny(tmp_path)
    assert workload_from(json.loads(json.dumps(asdict(w)))) == w
    assert isinstance(make_adapter("kvstore-shm"), Adapter)


# ---- end to end ------------------------------------------------------------------------------


@pytest.mark.slow
def test_quick_run_of_kvstore_and_the_baselines(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    code = bench_main(["peers", "--json", "--quick", "--layers", "2", "--clients", "4",
                       "--only", "kvstore*,memcpy,socket", "--dir", str(tmp_path)])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    peers = {"memcpy", "socket", "kvstore", "kvstore-shm", "kvstore-tcp"}
    metrics = {r["metric"] for r in rows}
    for p in peers:
        assert {f"{p}_1k_store", f"{p}_1k_retrieve", f"{p}_1k_lookup", f"{p}_1k_retrieve_p99_4_clients"} <= metrics
    for r in rows:
        assert r["bench"] == "peers" and "status" not in r, r
        assert r["value"] > 0 and r["baseline"] > 0
        if r["metric"].endswith(("_store", "_retrieve")):
            assert r["verified"], r
        assert all(a.startswith("127.") for a in r.get("listening", [])), r
    assert not list(tmp_path.iterdir())  # the run cleans up after itself


@pytest.mark.skipif(importlib.util.find_spec("lmcache") is not None, reason="LMCache is installed here: it runs")
def test_a_missing_peer_prints_unavailable_and_the_run_goes_on(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    code = bench_main(["peers", "--json", "--quick", "--layers", "2", "--clients", "2",
                       "--only", "lmcache-cpu,memcpy", "--dir", str(tmp_path)])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (gone,) = [r for r in rows if r.get("peer") == "lmcache-cpu"]
    assert gone["status"] == "unavailable" and "make bench-peers" in gone["error"]
    assert {r["metric"] for r in rows if r.get("peer") == "memcpy"} >= {"memcpy_1k_store", "memcpy_1k_retrieve"}


# ---- the paged-KV restore (--device cuda|cpu) ------------------------------------------------


def test_paged_slot_mapping_is_vllms_block_times_size_plus_offset() -> None:
    import torch

    from tools.bench._peers.paged import BLOCK, slot_mapping

    slots = slot_mapping([3, 1], torch.device("cpu")).tolist()
    assert slots == [*range(3 * BLOCK, 4 * BLOCK), *range(BLOCK, 2 * BLOCK)]


def test_paged_cache_blocks_are_disjoint_and_a_wrong_page_is_counted() -> None:
    import torch

    from tools.bench._peers.paged import Cache, page_spec

    cache = Cache(page_spec(layers=2, kv_heads=2, head_dim=8), 64, torch.device("cpu"))
    src, dst = cache.blocks(64)
    assert len(src) == len(dst) == 4 and not set(src) & set(dst)
    assert src != sorted(src) or dst != sorted(dst)  # shuffled block tables
    assert cache.wrong_pages(src, dst) == 2 * 4  # random pages differ everywhere
    for t in cache.layers:
        t[dst] = t[src]
    assert cache.wrong_pages(src, dst) == 0
    cache.layers[1].view(torch.int16)[dst[2], 0, 5, 3] ^= 1  # one bit of one page
    assert cache.wrong_pages(src, dst) == 1
    cache.layers[0][dst, :, :, 8:] = 0  # every V half of layer 0 lost
    got = cache.what_differs(src, dst)
    assert got["k_equal"] == 1.0 and got["v_equal"] < 0.01 and 0.49 < got["zero"] < 0.51
    cache.zero(dst)
    assert all(int(t[dst].count_nonzero()) == 0 for t in cache.layers)


def test_paged_run_on_the_cpu_restores_every_page(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    code = bench_main(["peers", "--device", "cpu", "--json", "--sizes", "64,1024", "--layers", "2", "--rounds", "1",
                       "--only", "kvstore,kvstore-connector,lmcache", "--dir", str(tmp_path)])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by = {r["metric"]: r for r in rows}
    for peer in ("kvstore", "kvstore-connector"):
        for size, blocks in ((64, 4), ("1k", 64)):
            for op in ("restore", "save"):
                r = by[f"{peer}_paged_{size}_{op}"]
                assert r["verified"] and r["wrong_pages"] == 0 and r["missing_tokens"] == 0, r
                assert r["value"] > 0 and r["baseline"] > 0 and r["bytes"] == blocks * 16 * 2 * 2 * 8 * 128 * 2
    assert set(by["kvstore_paged_1k_restore"]["phases_ms"]) == {"hash", "lease", "queue"}
    assert set(by["kvstore_paged_64_save"]["save_phases_ms"]) == {"reserve", "queue", "prepare", "wait", "commit", "pieces"}
    assert by["kvstore-connector_vs_kvstore_paged_1k_restore"]["goal_ratio"] == 0.95
    # LMCache's vLLM connector is CUDA only: one row says so, the kvstore rows still came
    (lm,) = [r for r in rows if r.get("peer") == "lmcache"]
    assert lm["status"] == "unavailable" and "CUDA" in lm["error"]
    assert not list(tmp_path.iterdir())


def test_paired_paged_run_drives_the_stores_in_turn(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    code = bench_main(["peers", "--device", "cpu", "--json", "--sizes", "1024", "--layers", "2", "--rounds", "2",
                       "--only", "kvstore,kvstore-connector-hnd,lmcache", "--paired", "--dir", str(tmp_path)])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by = {r["metric"]: r for r in rows}
    for peer in ("kvstore", "kvstore-connector-hnd"):
        restore, save = by[f"{peer}_paged_1k_restore"], by[f"{peer}_paged_1k_save"]
        assert restore["paired"] and restore["verified"] and restore["trials"] == 2
        assert save["save_trials"] == 3 and len(save["ms_each"]) == 3 and save["verified"]
    assert by["lmcache_paged_open_unavailable"]["status"] == "unavailable"
    assert not list(tmp_path.iterdir())


def test_paged_only_names_the_paged_stores() -> None:
    with pytest.raises(SystemExit, match="known: kvstore-connector, kvstore-connector-hnd, kvstore-connector-lw, kvstore, lmcache, lmcache-nhd"):
        list(__import__("tools.bench.peers", fromlist=["paged_rows"]).paged_rows(
            parser().parse_args(["--device", "cpu", "--only", "mooncake"])))


@pytest.mark.slow
def test_paired_quick_run_drives_the_peers_in_one_child(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    code = bench_main(["peers", "--json", "--quick", "--paired", "--copy-threads", "1", "--layers", "2",
                       "--clients", "2", "--only", "kvstore,memcpy", "--dir", str(tmp_path)])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by = {r["metric"]: r for r in rows}
    for p in ("kvstore", "memcpy"):
        for op in ("store", "retrieve"):
            r = by[f"{p}_1k_{op}"]
            assert r["paired"] and r["verified"] and r["value"] > 0, r
    assert by["kvstore_1k_store"]["copy_threads"] == 1
    assert not list(tmp_path.iterdir())


def test_paged_d2h_pieces_cover_the_blocks_in_order() -> None:
    from tools.bench._peers.paged import D2H_PIECE_BYTES, MAX_SAVE_PIECES, KvstorePaged, page_spec

    s = KvstorePaged()
    s.spec = page_spec()  # 2 MiB blocks
    for n in (1, 3, 256, 2048):
        pieces = s.d2h_pieces(n)
        assert pieces[0][0] == 0 and pieces[-1][1] == n
        assert all(b == c for (_, b), (c, _) in zip(pieces, pieces[1:], strict=False))
        assert len(pieces) == min(n, max(2, min(MAX_SAVE_PIECES, n * s.spec.block_bytes // D2H_PIECE_BYTES)))


def test_the_connector_rows_run_on_the_cpu_against_a_daemon(tmp_path: pathlib.Path) -> None:
    """``kvstore-connector`` (the vLLM connector's worker side, driven as vLLM drives it,
    against a real daemon) saves and restores every page byte for byte on the CPU smoke path,
    async and layer-wise, in vLLM 0.32's NHD memory order (LBNHC)."""
    torch = pytest.importorskip("torch")
    from tools.bench._peers.paged import (
        BLOCK,
        Cache,
        KvstoreConnector,
        KvstoreConnectorLayerwise,
        page_spec,
    )

    spec = page_spec(layers=2, kv_heads=2, head_dim=16)
    for cls in (KvstoreConnector, KvstoreConnectorLayerwise):
        cache = Cache(spec, 256, torch.device("cpu"), layout=cls.layout)
        s = cls()
        s.open(cache, 64 << 20, str(tmp_path))
        try:
            src, dst = cache.blocks(256)
            prompt = np.arange(256, dtype=np.int64)
            s.save(prompt, src)
            cache.zero(dst)
            assert s.restore(prompt, dst) == 256
            assert cache.wrong_pages(src, dst) == 0 and len(dst) == 256 // BLOCK
            assert s.info()["plane"] == "shm"
        finally:
            s.close()


def test_a_peers_untimed_reference_runs_after_the_timed_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer-wise row's compute with nothing to load (``after_restore``) is its reference,
    not part of its TTFT: it runs after the timed restore has ended, outside the timer."""
    torch = pytest.importorskip("torch")
    from tools.bench._peers import paged_run
    from tools.bench._peers.paged import Cache, page_spec

    calls: list[str] = []

    class Peer:
        name = "fake"

        def prepare(self, tokens: int) -> None:
            pass

        def save(self, tokens: np.ndarray, ids: list[int]) -> None:
            calls.append("save")  # the size's untimed save, in start()

        def restore(self, tokens: np.ndarray, ids: list[int]) -> int:
            calls.append("restore")
            return len(ids) * 16

        def after_restore(self) -> None:
            calls.append("after_restore")

    def timed(fn, device):  # type: ignore[no-untyped-def]
        calls.append("timer on")
        out = fn()
        calls.append("timer off")
        return 0.001, out

    monkeypatch.setattr(paged_run, "_timed", timed)
    cache = Cache(page_spec(layers=1, kv_heads=1, head_dim=16), 64, torch.device("cpu"))
    run = paged_run._SizeRun(Peer(), cache, 64, trials=1, where="cpu")
    assert run.start(lambda _: None)
    run.restore_once(1, lambda _: None)
    assert run.error is None
    assert calls[-4:] == ["timer on", "restore", "timer off", "after_restore"]
