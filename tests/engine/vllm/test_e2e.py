"""vLLM's CPU build over a kvstore daemon, end to end (each scenario is one vLLM process).

(a) same greedy tokens and logprobs with and without kvstore; (b) a fresh process hits what
another stored; (c) vLLM's own prefix cache on and off (and serving part of a prompt, kvstore the
rest); (d) a working set larger than vLLM's KV capacity, and preemptions; (e) the daemon killed
mid-run and restarted; (f) concurrent requests sharing a prefix; a GQA model with head_dim 128
(chunked prefill, the TCP data plane); tensor parallelism 2, with one rank's blocks gone (its
failed loads reported to vLLM, which recomputes them). Every kvstore scenario checks the
scheduler's one lookup per request against the daemon's own count.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed here: run `make test-vllm`")

from engine.vllm.harness import small_daemon  # noqa: E402
from tests.engine.vllm.conftest import (  # noqa: E402
    counters,
    one_lookup_per_admission,
    prompts,
    round_stats,
    run_scenario,
    same_outputs,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BT = 32
# 9, 16, 24 and 20 full blocks; 640 is a whole number of blocks (the last token is recomputed).
S = prompts(1, [300, 520, 777, 640])
# Eight concurrent requests sharing a 256-token prefix: 8 x ~520 tokens > the 64 pages of (d).
F = prompts(2, [420, 520, 610, 480, 560, 450, 590, 500], prefix=256)
# Eight 200-token requests fit vLLM's 64 pages at once (7 pages each) and are admitted together;
# 64 tokens later each needs 9 (72 > 64): vLLM must preempt, whatever the timing.
P = prompts(3, [200] * 8)
P_TOKENS = 64
# Generous daemon timeouts and save slots: on a loaded 2-core CI box a healthy daemon can take
# seconds to answer, and a timeout opens the breaker (a miss where a test counts hits) or a full
# save queue drops a save. A killed daemon refuses connections at once, whatever the timeout.
# ``known_s``: a prompt vLLM's own cache serves whole skips its lookup for the whole test.
ROBUST = {"lookup_timeout_s": 60, "load_timeout_s": 120, "save_timeout_s": 120, "max_pending_saves": 256,
          "known_s": 3600}
SMALL_ENGINE = {"prefix_caching": False, "num_gpu_blocks_override": 64, "max_model_len": 1536, "dtype": "float32",
                "disable_log_stats": False}  # vLLM's stats on: its preemption count


def _full(p: list[int]) -> int:
    """Tokens kvstore can serve of prompt ``p``: whole blocks, never the block of its last token."""
    return ((len(p) - 1) // BT) * BT


@pytest.fixture(scope="module")
def reference(models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """vLLM without any connector, prefix cache off."""
    spec = {"model": models["small"], "connector": None, "engine": SMALL_ENGINE,
            "rounds": [{"prompts": S}, {"prompts": F}, {"prompts": P, "max_tokens": P_TOKENS}]}
    tmp = tmp_path_factory.mktemp("reference")
    out = run_scenario(spec, tmp)
    assert round_stats(tmp)[2]["preemptions"] > 0  # the premise of the preemption test
    return out


@pytest.fixture(scope="module")
def writer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("writer")


@pytest.fixture(scope="module")
def writer(models: dict[str, str], daemon: Any, writer_dir: Path) -> list[list[dict[str, Any]]]:
    """kvstore (async loads), vLLM's prefix cache off, 64 pages: S cold, S warm, F, F again,
    P (preempted) cold and warm."""
    spec = {"model": models["small"], "url": daemon.url, "connector": {**ROBUST, "load_mode": "async"},
            "engine": SMALL_ENGINE,
            "rounds": [{"prompts": S}, {"prompts": S}, {"prompts": F}, {"prompts": F},
                       {"prompts": P, "max_tokens": P_TOKENS}, {"prompts": P, "max_tokens": P_TOKENS}]}
    return run_scenario(spec, writer_dir)


def _hit(out: dict[str, Any]) -> int:
    return int(out["kvstore_hit_tokens"])


def test_same_tokens_and_logprobs_with_and_without_kvstore(reference: list, writer: list, writer_dir: Path) -> None:
    cold, warm = writer[0], writer[1]
    assert all(_hit(o) == 0 for o in cold)
    same_outputs(cold, reference[0])  # nothing loaded
    # Warm: every full block but the one holding the last token comes from kvstore.
    assert [_hit(o) for o in warm] == [_full(p) for p in S]
    same_outputs(warm, reference[0])
    # One lookup RPC per request (the daemon's count), and one more per preemption.
    one_lookup_per_admission(round_stats(writer_dir), [S, S, F, F, P, P])
    after_cold, after_warm = counters(writer_dir)[:2]
    (c0,), (c1,) = after_cold, after_warm
    assert c0["saved_blocks"] == sum(len(p) // BT for p in S) and c0["loaded_blocks"] == 0
    assert c1["loaded_blocks"] - c0["loaded_blocks"] == sum(_full(p) // BT for p in S) and c1["failed_blocks"] == 0
    # ... copied from the lease the scheduler's lookup took (LOOKUP_LEASE, no ACQUIRE), except a
    # request vLLM could not allocate pages for in the step of its lookup (64 pages here): its
    # lease went back at that step's end, and its worker leased the blocks itself
    assert 0 < c1["preleased_blocks"] - c0["preleased_blocks"] <= c1["loaded_blocks"] - c0["loaded_blocks"]
    # Nothing is saved again, not even the 640-token prompt's last block (never loaded: it
    # holds the last token, but the lookup saw it cached).
    assert c1["saved_blocks"] == c0["saved_blocks"] and c1["saves_submitted"] == c0["saves_submitted"]


def test_preempted_requests_come_back_right(reference: list, writer: list, writer_dir: Path) -> None:
    """(d) vLLM preempts (its pages cannot hold every request's growth): the preempted requests
    are admitted again (looked up again, loaded again) and every answer is vLLM's own."""
    cold, warm = writer[4], writer[5]
    stats = round_stats(writer_dir)
    assert stats[4]["preemptions"] > 0 and stats[5]["preemptions"] > 0
    same_outputs(cold, reference[2])
    same_outputs(warm, reference[2])
    # Warm: each request's prompt comes from kvstore, on its first admission and again after a
    # preemption (the reported hit is the last admission's).
    assert [_hit(o) for o in warm] == [_full(p) for p in P]


def test_concurrent_requests_with_shared_prefix_and_more_than_kv_capacity(reference: list, writer: list) -> None:
    first, again = writer[2], writer[3]
    same_outputs(first, reference[1])
    same_outputs(again, reference[1])
    # The working set (S and F, ~6,900 tokens) is three times vLLM's 2,048-token KV; every
    # request of the repeat finds its whole prefix in kvstore.
    assert [_hit(o) for o in again] == [_full(p) for p in F]


def test_a_fresh_process_hits_what_another_stored_and_prefix_cache_on(
    models: dict[str, str], daemon: Any, reference: list, writer: list, tmp_path: Path
) -> None:
    assert writer  # the writer's blocks are in the daemon
    spec = {"model": models["small"], "url": daemon.url, "connector": {**ROBUST, "load_mode": "layerwise"},
            "engine": {"prefix_caching": True, "max_model_len": 1536, "dtype": "float32", "disable_log_stats": False},
            "rounds": [{"prompts": S}, {"prompts": S}]}
    fresh, again = run_scenario(spec, tmp_path, inproc=False)
    stats = round_stats(tmp_path)
    # A new process, an empty vLLM prefix cache: the blocks come from the daemon, layer by layer,
    # from the leases the scheduler's lookups took.
    assert [_hit(o) for o in fresh] == [_full(p) for p in S]
    (c0,) = counters(tmp_path)[0]
    assert c0["preleased_blocks"] == c0["loaded_blocks"] == sum(_full(p) // BT for p in S)
    same_outputs(fresh, reference[0])
    # Now vLLM's own prefix cache holds them: it serves the prefix, kvstore is not asked to load.
    assert all(_hit(o) == 0 and o["cached_tokens"] >= _full(p) for o, p in zip(again, S, strict=True))
    same_outputs(again, reference[0])
    # ... nor to look it up: the first round's lookups saw every block (known_s), and vLLM's
    # hit covers every block kvstore could load.
    assert stats[1]["lookups"] == 0
    one_lookup_per_admission(stats, [S, S], [fresh, again])


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


def test_gqa_head_dim_128_chunked_prefill_over_tcp_with_prefix_cache_on(models: dict[str, str], daemon: Any,
                                                                          tmp_path: Path) -> None:
    """GQA, head_dim 128, vLLM's prefix cache on over 64 pages, prefills in chunks of 4 blocks
    (saves chunk by chunk), loads layer by layer over the daemon's TCP plane. Where vLLM's cache
    still holds part of a prompt, kvstore serves exactly the blocks after it."""
    spec = {"model": models["gqa128"], "url": daemon.url,
            "connector": {**ROBUST, "load_mode": "layerwise", "plane": "tcp"},
            "engine": {"prefix_caching": True, "num_gpu_blocks_override": 64, "max_num_batched_tokens": 4 * BT,
                       "max_model_len": 1536, "dtype": "float32", "disable_log_stats": False},
            "rounds": [{"prompts": S}, {"prompts": S}, {"prompts": F}, {"prompts": F}]}
    cold, warm, f_cold, f_warm = run_scenario(spec, tmp_path)
    assert all(_hit(o) == 0 for o in cold)
    same_outputs(warm, cold)
    same_outputs(f_warm, f_cold)
    for rnd, ps in ((warm, S), (f_warm, F)):
        # Every servable token was served, by vLLM's cache or by kvstore, in whole blocks.
        assert [o["cached_tokens"] for o in rnd] == [_full(p) for p in ps]
        assert all(_hit(o) % BT == 0 for o in rnd)
    # Shared-prefix requests: vLLM serves the prefix it still holds, kvstore the rest of the prompt.
    assert any(0 < _hit(o) < o["cached_tokens"] for o in f_warm)
    assert sum(_hit(o) for o in warm) > 0
    (c0,), (c1,) = counters(tmp_path)[:2]
    assert c0["saved_blocks"] == sum(len(p) // BT for p in S)  # every full block, 4 blocks a step
    assert c1["loaded_blocks"] - c0["loaded_blocks"] == sum(_hit(o) for o in warm) // BT
    one_lookup_per_admission(round_stats(tmp_path), [S, S, F, F], [cold, warm, f_cold, f_warm])


def test_tensor_parallel_2_and_one_ranks_blocks_gone(models: dict[str, str], tmp_path: Path) -> None:
    """TP=2 on the CPU build: two worker processes (gloo), each storing and loading its own KV
    heads under its own ``Namespace.rank/world_size``; the scheduler looks up rank 0's. Then
    rank 1's copy of the blocks is deleted: the scheduler still finds rank 0's and promises
    them, rank 1's loads fail and are reported (``get_block_ids_with_load_errors``), and vLLM
    recomputes: the same answers, no error."""
    cpus = sorted(os.sched_getaffinity(0))
    bind = f"{cpus[0]}|{cpus[-1]}"  # one core per rank (vLLM cannot auto-bind two ranks on one NUMA node)
    with small_daemon(tmp_path / "daemon") as d:
        spec = {"model": models["small"], "url": d.url, "connector": {**ROBUST, "load_mode": "layerwise"},
                "engine": {"prefix_caching": False, "max_model_len": 1536, "dtype": "float32",
                           "tensor_parallel_size": 2, "distributed_executor_backend": "mp", "disable_log_stats": False},
                "rounds": [{"prompts": S}, {"prompts": S}, {"prompts": S, "drop": 1}]}
        cold, warm, dropped = run_scenario(spec, tmp_path / "run", inproc=False, env={"VLLM_CPU_OMP_THREADS_BIND": bind})
    assert all(_hit(o) == 0 for o in cold)
    assert [_hit(o) for o in warm] == [_full(p) for p in S]
    same_outputs(warm, cold)  # loaded on both ranks = computed on both ranks
    # Rank 1 loaded nothing and vLLM recomputed. Each round gets pages no earlier round used
    # (vLLM's free-page queue hands out its ~16,000 CPU pages in order, prefix cache off), so rank
    # 1's pages held no KV of these prompts: had vLLM not recomputed, the answers would differ.
    same_outputs(dropped, cold)
    after_cold, after_warm, after_drop = counters(tmp_path / "run")
    assert [c["rank"] for c in after_warm] == [0, 1]
    promised = sum(_full(p) // BT for p in S)
    for c0, c1 in zip(after_cold, after_warm, strict=True):
        assert c0["saved_blocks"] == sum(len(p) // BT for p in S)  # every full prompt block, per rank
        assert c1["loaded_blocks"] - c0["loaded_blocks"] == promised
        assert c1["failed_blocks"] == 0  # each rank found its own heads' blocks
    r0, r1 = after_drop
    assert r0["loaded_blocks"] - after_warm[0]["loaded_blocks"] == promised and r0["failed_blocks"] == 0
    assert r1["loaded_blocks"] == after_warm[1]["loaded_blocks"] and r1["failed_blocks"] == promised
    one_lookup_per_admission(round_stats(tmp_path / "run"), [S, S, S])
