"""Benchmarks print one JSON object per line with the figure, its same-run baseline and ratio."""

from __future__ import annotations

import json
import sys
import types

import pytest

from kvstore.version import version
from tools.bench.__main__ import BENCHES, main
from tools.bench._common import median_trial, missed_goals

KEYS = {"bench", "metric", "value", "unit", "baseline", "ratio"}


@pytest.mark.parametrize("name", ["hash", "index"])
def test_bench_json_lines(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([name, "--json", "--quick"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows
    for r in rows:
        assert r.keys() >= KEYS
        assert r["bench"] == name
        assert r["value"] > 0 and r["baseline"] > 0
        assert r["ratio"] == pytest.approx(r["value"] / r["baseline"], rel=1e-2, abs=1e-4)


def test_throughput_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """The batched-prefill bench end to end on a tiny CPU model: every engine runs the stream and
    the batch agrees with each request run alone."""
    pytest.importorskip("transformers")
    assert main(["throughput", "--json", "--smoke", "--check"]) in (0, 3)  # goals state only 96% rows
    rows = {r["metric"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"dram_hit80_tokens_per_s", "hbm_hit80_tokens_per_s", "ideal_hit80_tokens_per_s", "hbm_vs_ideal_hit80"}
    for r in rows.values():
        assert r.keys() >= KEYS and r["value"] > 0 and r["baseline"] > 0
    assert rows["dram_hit80_tokens_per_s"]["measured_hit"] > 0.7
    assert rows["dram_hit80_tokens_per_s"]["hbm_share_of_hits"] == 0
    assert rows["hbm_hit80_tokens_per_s"]["hbm_share_of_hits"] == 1.0  # after the warm-up round
    check = rows["hbm_vs_ideal_hit80"]["check"]
    assert check["same_greedy_token"] == check["checked_requests"] == 2
    assert check["logits_rel_err"] <= 1e-4


def test_flop_bound_is_below_one_over_one_minus_h_and_falls_with_context() -> None:
    """Hit tokens are not free: the new tokens attend to the whole prefix, more so when it is long."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tools.bench.throughput import flop_bound

    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                                   num_attention_heads=32, num_key_value_heads=8)

    def stream(n: int) -> list[list[torch.Tensor]]:
        return [[torch.zeros(n, dtype=torch.long), torch.zeros(n * 25 // 24, dtype=torch.long)]]  # 96% hit

    short, long = flop_bound(cfg, [], stream(1024)), flop_bound(cfg, [], stream(32768))
    assert long < 20 < short < 25  # 32K-token prompts: 18.2x at best; 1K: 24.9x
    from tools.bench.throughput import flop_bound_by_length

    by_len = flop_bound_by_length(cfg, 0.96)
    assert list(by_len.values()) == sorted(by_len.values(), reverse=True)  # falls with the length
    assert by_len["32768"] < 20 < by_len["1024"] < 25


def test_bench_rejects_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["nope"])
    assert e.value.code == 2


# ---- --check: a figure that misses its goal makes the run exit non-zero -----------------------------


def _row(**kw: object) -> dict[str, object]:
    return {"bench": "b", "metric": "m", "value": 2.0, "unit": "ms", "baseline": 4.0, "ratio": 0.5, **kw}


@pytest.mark.parametrize(
    "row, misses",
    [
        (_row(goal_ms=1.0), 1),
        (_row(goal_ms=2.0), 0),
        (_row(goal_ms=None), 0),
        (_row(unit="B", goal_bytes=1), 1),
        (_row(goal_ratio=0.4), 1),  # a time: the ratio must stay at most the goal
        (_row(goal_ratio=0.6), 0),
        (_row(unit="GB/s", goal_ratio=0.8), 1),  # a rate: at least the goal
        (_row(unit="GB/s", goal_ratio=0.5), 0),
        (_row(speedup=10, goal_speedup=12), 1),
        (_row(speedup=13, goal_speedup=12), 0),
    ],
)
def test_missed_goals(row: dict[str, object], misses: int) -> None:
    assert len(missed_goals(row)) == misses


def test_unknown_goal_is_a_bug_not_a_pass() -> None:
    with pytest.raises(ValueError, match="unknown goal 'goal_furlongs'"):
        missed_goals(_row(goal_furlongs=1))


def _fake_bench(monkeypatch: pytest.MonkeyPatch, rows: list[dict[str, object]]) -> None:
    mod = types.ModuleType("fake_bench")
    mod.run = lambda args: iter(rows)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_bench", mod)
    monkeypatch.setitem(BENCHES, "fake", "fake_bench")


def test_check_exits_non_zero_on_a_missed_goal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_bench(monkeypatch, [_row(goal_ms=1.0), _row(metric="ok", goal_ms=5.0)])
    assert main(["fake", "--json"]) == 0  # without --check goals are only printed
    assert main(["fake", "--json", "--check"]) == 3
    err = capsys.readouterr().err
    assert "MISSED b/m: 2 ms > goal 1 ms" in err and "b/ok" not in err
    _fake_bench(monkeypatch, [_row(goal_ms=5.0)])
    assert main(["fake", "--check"]) == 0


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip().endswith(version())


def test_outage_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["outage", "--json", "--quick"]) == 0
    rows = {r["metric"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    down = rows["request_cache_calls_p99_daemon_down"]
    assert down["goal_us"] == 1000.0 and down["lookups_skipped"] >= 200 and down["stores_skipped"] >= 200
    assert {"first_call_after_kill", "hits_back_after_restart"} <= set(rows)


def test_median_trial_reports_the_trial_with_the_median_ratio() -> None:
    # ratios 0.5, 2.0, 0.9, 1.0, 0.8: the median trial is the third, its own value and baseline
    trials = [(1.0, 2.0), (4.0, 2.0), (0.9, 1.0), (3.0, 3.0), (0.4, 0.5)]
    assert median_trial(trials) == (0.9, 1.0, [0.5, 2.0, 0.9, 1.0, 0.8])
    # an even count takes the lower middle ratio, never a mean of two trials
    assert median_trial(trials[:4])[:2] == (0.9, 1.0)
    with pytest.raises(ValueError, match="no trials"):
        median_trial([])
