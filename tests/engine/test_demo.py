"""The embedded demo runs end to end on the default tiers and restarts warm."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.demo import main, serve, workload


def test_demo_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--root", str(tmp_path / "d"), "--users", "3", "--turns", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 9
    assert 0 < out["hit_blocks"] < out["blocks"]
    # After the restart the first user's last turn is served whole from persistent tiers.
    assert out["restart_recovered_blocks"] > 0
    assert out["restart_hit_blocks"] == out["restart_request_blocks"]
    engine = out["reference_engine"]
    if "skipped" not in engine:
        rows = engine["prompts"]
        assert rows[0]["hit_tokens"] == 0
        assert all(r["hit_tokens"] == 1024 and r["tier"] == "dram" for r in rows[1:])
        assert all(r["same_next_token"] for r in rows)


def test_demo_without_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--root", str(tmp_path / "d"), "--users", "1", "--turns", "2", "--no-model"]) == 0
    text = capsys.readouterr().out
    assert "warm restart" in text and "reference engine" not in text


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--users", "0"])
    assert e.value.code == 2


def test_workload_turns_extend_each_other() -> None:
    prompts = workload(2, 3, np.random.default_rng(0))
    assert len(prompts) == 6
    # interleaved by turn: prompts[2] is user 0's second turn, extending prompts[0]
    assert np.array_equal(prompts[2][: prompts[0].size], prompts[0])
    assert callable(serve)
