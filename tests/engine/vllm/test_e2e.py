"""vLLM's CPU build over a kvstore daemon, end to end (each scenario is one vLLM process).

(a) same greedy tokens and logprobs with and without kvstore; (b) a fresh process hits what
another stored; (c) vLLM's own prefix cache on and off; (d) a working set larger than vLLM's KV
capacity (with preemptions); (e) the daemon killed mid-run and restarted; (f) concurrent
requests sharing a prefix; a GQA model with head_dim 128; tensor parallelism 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed here: run `make test-vllm`")

from engine.vllm.harness import small_daemon  # noqa: E402
from tests.engine.vllm.conftest import counters, prompts, run_scenario, same_outputs  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BT = 32
# 9, 16, 24 and 20 full blocks; 640 is a whole number of blocks (the last token is recomputed).
S = prompts(1, [300, 520, 777, 640])
# Eight concurrent requests sharing a 256-token prefix: 8 x ~520 tokens > the 64 pages of (d).
F = prompts(2, [420, 520, 610, 480, 560, 450, 590, 500], prefix=256)
# Generous daemon timeouts and save slots: on a loaded 2-core CI box a healthy daemon can take
# seconds to answer, and a timeout opens the breaker (a miss where a test counts hits) or a full
# save queue drops a save. A killed daemon refuses connections at once, whatever the timeout.
ROBUST = {"lookup_timeout_s": 60, "load_timeout_s": 120, "save_timeout_s": 120, "max_pending_saves": 256}
SMALL_ENGINE = {"prefix_caching": False, "num_gpu_blocks_override": 64, "max_model_len": 1536, "dtype": "float32"}


@pytest.fixture(scope="module")
def reference(models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """vLLM without any connector, prefix cache off."""
    spec = {"model": models["small"], "connector": None, "engine": SMALL_ENGINE,
            "rounds": [{"prompts": S}, {"prompts": F}]}
    return run_scenario(spec, tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def writer(models: dict[str, str], daemon: Any, tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """kvstore (async loads), vLLM's prefix cache off, 64 pages: S cold, S warm, F, F again."""
    spec = {"model": models["small"], "url": daemon.url, "connector": {**ROBUST, "load_mode": "async"},
            "engine": SMALL_ENGINE,
            "rounds": [{"prompts": S}, {"prompts": S}, {"prompts": F}, {"prompts": F}]}
    return run_scenario(spec, tmp_path_factory.mktemp("writer"))


def _hit(out: dict[str, Any]) -> int:
    return int(out["kvstore_hit_tokens"])


def test_same_tokens_and_logprobs_with_and_without_kvstore(reference: list, writer: list) -> None:
    cold, warm = writer[0], writer[1]
    assert all(_hit(o) == 0 for o in cold)
    same_outputs(cold, reference[0])  # nothing loaded
    # Warm: every full block but the one holding the last token comes from kvstore.
    assert [_hit(o) for o in warm] == [((len(p) - 1) // BT) * BT for p in S]
    same_outputs(warm, reference[0])


def test_concurrent_requests_with_shared_prefix_and_more_than_kv_capacity(reference: list, writer: list) -> None:
    first, again = writer[2], writer[3]
    same_outputs(first, reference[1])
    same_outputs(again, reference[1])
    # The working set (S and F, ~6,900 tokens) is three times vLLM's 2,048-token KV; every
    # request of the second pass finds its whole prefix in kvstore.
    assert [_hit(o) for o in again] == [((len(p) - 1) // BT) * BT for p in F]


def test_a_fresh_process_hits_what_another_stored_and_prefix_cache_on(
    models: dict[str, str], daemon: Any, reference: list, writer: list, tmp_path: Path
) -> None:
    assert writer  # the writer's blocks are in the daemon
    spec = {"model": models["small"], "url": daemon.url, "connector": {**ROBUST, "load_mode": "layerwise"},
            "engine": {"prefix_caching": True, "max_model_len": 1536, "dtype": "float32"},
            "rounds": [{"prompts": S}, {"prompts": S}]}
    fresh, again = run_scenario(spec, tmp_path, inproc=False)
    # A new process, an empty vLLM prefix cache: the blocks come from the daemon, layer by layer.
    assert [_hit(o) for o in fresh] == [((len(p) - 1) // BT) * BT for p in S]
    same_outputs(fresh, reference[0])
    # Now vLLM's own prefix cache holds them: it serves the prefix, kvstore is not asked to load.
    assert all(_hit(o) == 0 and o["cached_tokens"] >= ((len(p) - 1) // BT) * BT for o, p in zip(again, S, strict=True))
    same_outputs(again, reference[0])


def test_daemon_killed_mid_run_then_back(models: dict[str, str], reference: list, tmp_path: Path) -> None:
    conn = {**ROBUST, "load_mode": "async", "backoff_s": 0.2, "max_backoff_s": 1.0}
    spec = {"model": models["small"], "daemon": {"root": str(tmp_path / "daemon")}, "connector": conn,
            "engine": SMALL_ENGINE,
            "rounds": [
                {"prompts": S},  # stored
                {"prompts": S + S, "daemon": "kill_during", "after_s": 0.2},  # hits, then the daemon dies
                {"prompts": S},  # no daemon: all computed
                {"prompts": S, "daemon": "restart"},  # an empty daemon: stored again once reconnected
                {"prompts": S, "until_hit": 40},  # hits resume by themselves
            ]}
    rounds = run_scenario(spec, tmp_path / "run")
    same_outputs(rounds[0], reference[0])
    same_outputs(rounds[1], reference[0] + reference[0])
    same_outputs(rounds[2], reference[0])
    assert all(_hit(o) == 0 for o in rounds[2])
    same_outputs(rounds[3], reference[0])
    same_outputs(rounds[4], reference[0])
    assert any(_hit(o) > 0 for o in rounds[4])


def test_gqa_head_dim_128(models: dict[str, str], daemon: Any, tmp_path: Path) -> None:
    spec = {"model": models["gqa128"], "url": daemon.url, "connector": {**ROBUST, "load_mode": "layerwise"},
            "engine": {"prefix_caching": False, "max_model_len": 1536, "dtype": "float32"},
            "rounds": [{"prompts": S}, {"prompts": S}]}
    cold, warm = run_scenario(spec, tmp_path)
    assert all(_hit(o) == 0 for o in cold)
    assert [_hit(o) for o in warm] == [((len(p) - 1) // BT) * BT for p in S]
    same_outputs(warm, cold)


def test_tensor_parallel_2(models: dict[str, str], tmp_path: Path) -> None:
    """TP=2 on the CPU build: two worker processes (gloo), each storing and loading its own KV
    heads under its own ``Namespace.rank/world_size``; the scheduler looks up rank 0's."""
    cpus = sorted(os.sched_getaffinity(0))
    bind = f"{cpus[0]}|{cpus[-1]}"  # one core per rank (vLLM cannot auto-bind two ranks on one NUMA node)
    with small_daemon(tmp_path / "daemon") as d:
        spec = {"model": models["small"], "url": d.url, "connector": {**ROBUST, "load_mode": "layerwise"},
                "engine": {"prefix_caching": False, "max_model_len": 1536, "dtype": "float32",
                           "tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                "rounds": [{"prompts": S}, {"prompts": S}]}
        cold, warm = run_scenario(spec, tmp_path / "run", inproc=False, env={"VLLM_CPU_OMP_THREADS_BIND": bind})
    assert all(_hit(o) == 0 for o in cold)
    assert [_hit(o) for o in warm] == [((len(p) - 1) // BT) * BT for p in S]
    same_outputs(warm, cold)  # loaded on both ranks = computed on both ranks
    after_cold, after_warm = counters(tmp_path / "run")
    assert [c["rank"] for c in after_warm] == [0, 1]
    for c0, c1 in zip(after_cold, after_warm, strict=True):
        assert c0["saved_blocks"] == sum(len(p) // BT for p in S)  # every full prompt block, per rank
        assert c1["loaded_blocks"] - c0["loaded_blocks"] == sum((len(p) - 1) // BT for p in S)
        assert c1["failed_blocks"] == 0  # each rank found its own heads' blocks
