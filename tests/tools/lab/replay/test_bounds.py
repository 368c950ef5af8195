"""The class bounds and the holdout of tools/lab/replay/bounds.py and holdout.py, and the lab
replay's ``--class-bound``, on a trace small enough to follow by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.lab.replay.cli import main
from tools.replay.trace import load_trace


def test_class_bound_is_between_nothing_and_every_reuse(small: Path) -> None:
    from tools.lab.replay.bounds import class_bound, class_segments

    seg = class_segments(load_trace(small))
    assert seg.accesses == 18
    bounds = [class_bound(seg, c) for c in (0, 1, 2, 4, 100)]
    assert bounds[0] == 0 and bounds == sorted(bounds)
    assert bounds[-1] == pytest.approx(10)  # room for everything: every reuse (here all prefix hits)

def test_finer_classes_never_lower_the_class_bound(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Request features split the classes further: the bound of the finer partition is at least
    that of the coarser one at every capacity, and the CLI rejects unknown features."""
    from tools.lab.replay.bounds import EXTRA_FEATURES, class_bound, class_segments

    trace = load_trace(small)
    coarse, fine = class_segments(trace), class_segments(trace, extra=EXTRA_FEATURES)
    assert len(fine.gaps) >= len(coarse.gaps) and fine.accesses == coarse.accesses
    for c in (1, 2, 4):
        assert class_bound(fine, c) >= class_bound(coarse, c) - 1e-9
    assert main([str(small), "--capacity", "4", "--policy", "lru", "--json", "--class-bound", "--class-features", "length,turn"]) == 0
    assert 0 <= json.loads(capsys.readouterr().out)["class_bound_block_hit_rate"] <= 1
    assert main([str(small), "--capacity", "4", "--class-bound", "--class-features", "colour"]) == 2
    assert "colour" in capsys.readouterr().err

def test_holdout_learns_on_the_first_half_and_scores_the_second(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tools.lab.replay.bounds import class_segments, holdout_class_hits
    from tools.lab.replay.holdout import main as holdout

    seg = class_segments(load_trace(small))
    late = seg.accesses - seg.accesses // 2
    rates = [holdout_class_hits(seg, c) / late for c in (1, 4, 100)]
    assert rates == sorted(rates) and rates[0] >= 0 and rates[-1] <= 1
    assert holdout_class_hits(seg, 0) == 0
    assert holdout([str(small), "--capacity", "4", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["capacity_blocks"] == 4 and {"lru", "opt", "holdout_base", "holdout_all"} <= set(row)
    assert 0 <= row["lru"] <= row["opt"] <= 1
    assert holdout([str(small / "missing.jsonl")]) == 2
