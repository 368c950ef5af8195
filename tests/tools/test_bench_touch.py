"""The touch benchmark runs (quick sizes): both stores, the default policy, a lease of every block."""

from __future__ import annotations

import json

import pytest

from tools.bench.__main__ import main


def test_touch_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["touch", "--json", "--quick"]) == 0
    rows = {r["metric"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"acquire_256_blocks_dram", "acquire_256_blocks_dram_nvme"}
    for r in rows.values():
        assert r["bench"] == "touch" and r["unit"] == "us" and r["policy"] == "ChainPolicy"
        assert r["value"] > 0 and r["baseline"] > 0 and len(r["trial_ratios"]) == r["rounds"] == 5
