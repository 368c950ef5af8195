"""Benchmarks print one JSON object per line with the figure, its same-run baseline and ratio."""

from __future__ import annotations

import json

import pytest

from tools.bench.__main__ import main

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
