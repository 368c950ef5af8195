"""The embedded demo runs end to end on the default tiers and restarts warm."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.reference.demo import main, serve, workload
from engine.reference.demo_model import speedup


def test_demo_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--root", str(tmp_path / "d"), "--users", "3", "--turns", "3", "--json", "--keep",
                 "--prompts", "2", "--repeats", "2"]) == 0  # a miss, a hit; two TTFT runs a side
    out = json.loads(capsys.readouterr().out)
    assert out["root_kept"] and out["root_bytes"] > 0 and (tmp_path / "d" / "tiers").is_dir()
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
        assert rows[0]["speedup"] is None  # no hit: its two columns differ only by noise
        for r in rows:
            lo, hi = r["ttft_ms_with_cache_range"]
            assert lo <= r["ttft_ms_with_cache"] <= hi


def test_demo_without_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--root", str(tmp_path / "d"), "--users", "1", "--turns", "2", "--no-model"]) == 0
    text = capsys.readouterr().out
    assert "warm restart" in text and "reference engine" not in text
    # It says where its data went, and cleaned up.
    assert f"store directory {tmp_path / 'd'} (" in text and "removed; `--keep` keeps it" in text
    assert not (tmp_path / "d").exists()


def test_demo_keep_says_how_to_look_and_remove(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--root", str(tmp_path / "d"), "--users", "1", "--turns", "2", "--no-model", "--keep"]) == 0
    text = capsys.readouterr().out
    assert f"kvctl --dir {tmp_path / 'd'} tiers" in text and f"rm -rf {tmp_path / 'd'}" in text
    assert (tmp_path / "d").is_dir()


def test_a_speedup_is_shown_only_outside_the_noise() -> None:
    assert speedup([10.0, 11.0, 12.0], [2.0, 2.75, 4.0]) == 4.0
    assert speedup([10.0, 11.0, 12.0], [9.0, 10.5, 30.0]) is None  # the ranges overlap


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
