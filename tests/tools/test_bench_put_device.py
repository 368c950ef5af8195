"""The put_device benchmark runs (quick sizes): a threaded daemon's PUT_DEVICEs on the fake CUDA
runtime store every block, and each phase has its in-process baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench.__main__ import main
from tools.bench.put_device import NS, FakeCudart, daemon_phases


def test_put_device_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["put_device", "--json", "--quick"]) == 0
    rows = {r["metric"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {f"{phase}_256_blocks_{log}" for phase in ("reserve", "commit")
                         for log in ("events", "no_events")}
    for r in rows.values():
        assert r["bench"] == "put_device" and r["unit"] == "ms" and r["puts"] == 5
        assert r["value"] > 0 and r["baseline"] > 0 and r["spread_ms"][0] <= r["value"] <= r["spread_ms"][1]


def test_the_daemon_on_the_fake_runtime_stores_every_block_and_reports_every_phase(tmp_path: Path) -> None:
    lib = FakeCudart(dma_s_per_block=0.0)
    rows = daemon_phases(8, 2, True, tmp_path, lib)  # (each put asserts all 8 blocks were new)
    assert len(rows) == 2 and all(set(r) >= {"reserve", "queue", "wait", "commit"} for r in rows)
    assert NS.block_bytes == 2048
