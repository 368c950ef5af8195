"""The daemon benchmarks run (quick sizes), each on its own daemon, in the bench line format."""

from __future__ import annotations

import json

import pytest

from tools.bench.__main__ import main

KEYS = {"bench", "metric", "value", "unit", "baseline", "ratio"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shm", "tcp", "rpc", "concurrent"])
def test_daemon_bench_json_lines(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([name, "--json", "--quick"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows
    for r in rows:
        assert r.keys() >= KEYS and r["bench"] == name
        assert r["value"] > 0 and r["baseline"] > 0
        if name == "concurrent":
            assert r["errors"] == 0, r["first_errors"]


def test_ucx_bench_says_why_it_is_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import ucxx  # noqa: F401
    except ImportError:
        assert main(["ucx", "--json", "--quick"]) == 0
        assert "pip install 'kvstore-llm[ucx]'" in capsys.readouterr().err
    else:
        pytest.skip("ucxx is installed: the benchmark runs instead (test_ucx_bench_json_lines)")


@pytest.mark.slow
def test_ucx_bench_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ucxx")
    assert main(["ucx", "--json", "--quick"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["metric"].split("_")[0], r["baseline_kind"]) for r in rows] == [
        ("get", "raw ucxx"), ("get", "raw socket recv_into"), ("cpu", "raw ucxx"), ("cpu", "raw socket recv_into")]
    for r in rows[:2]:  # the figure is the median-ratio trial of the three
        assert r["unit"] == "GB/s" and r["value"] > 0 and r["baseline"] > 0 and len(r["trial_ratios"]) == 3
        assert r["ratio"] in r["trial_ratios"]
    for r in rows[2:]:  # processor time of both processes of each side, per 64 MiB
        assert r["unit"] == "ms" and r["value"] == pytest.approx(r["receiver_ms"] + r["sender_ms"], abs=0.01)
        assert r["baseline"] == pytest.approx(r["baseline_receiver_ms"] + r["baseline_sender_ms"], abs=0.01)
        assert r["idle_ms_per_s"].keys() == {"client", "daemon", "raw_ucxx_sender"}
