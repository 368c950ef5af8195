"""Benchmarks print one JSON object per line with the figure, its same-run baseline and ratio."""

from __future__ import annotations

import json
import sys
import types

import pytest

from kvstore.version import version
from tools.bench.__main__ import BENCHES, main
from tools.bench._common import missed_goals

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
