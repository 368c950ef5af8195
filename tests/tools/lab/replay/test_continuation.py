"""Whether a turn is continued, and what predicting it is worth (tools/lab/replay/continuation.py),
on traces small enough to follow by hand."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from tools.lab.replay import economics as E
from tools.lab.replay.continuation import auc, design, fit_logistic, main, turns
from tools.lab.replay.subtree import TraceTree
from tools.replay.trace import Trace, load_trace


def _trace(path: Path, reqs: list[tuple[int, int, list[int]]]) -> Trace:
    """(timestamp ms, input tokens, hash ids) per request."""
    with path.open("w") as f:
        for t, tokens, ids in reqs:
            f.write(json.dumps({"timestamp": t, "input_length": tokens, "output_length": 7, "hash_ids": ids}) + "\n")
    return load_trace(path)


def test_turns_label_continued_requests_and_their_previous_turn(tmp_path: Path) -> None:
    # Block 0 is a system prompt every request shares. Request 0: turn one of a chat (two
    # whole blocks after the prompt); request 2 extends it (turn two, its last block partial);
    # request 3 extends request 2 through its last *full* block (3), so request 2 is continued
    # although its partial last block 4 is never read again. Request 1 is never continued.
    trace = _trace(tmp_path / "t_trace.jsonl", [
        (0, 3 * 512, [0, 1, 2]),
        (1_000, 2 * 512, [0, 9]),
        (5_000, 4 * 512 + 100, [0, 1, 2, 3, 4]),
        (9_000, 5 * 512, [0, 1, 2, 3, 5]),
    ])
    t = turns(trace, TraceTree.of(trace, E.block_parents(trace)))
    assert t.continued.tolist() == [True, False, True, False]
    assert t.features["turns_before"].tolist() == [0, 0, 1, 2]
    gap = t.features["gap_s"]
    assert np.isnan(gap[0]) and np.isnan(gap[1])  # the shared prompt alone is not a previous turn
    assert gap[2:].tolist() == [5.0, 4.0]
    assert t.features["blocks"].tolist() == [3, 2, 5, 5]


def _brute_auc(score: np.ndarray, label: np.ndarray) -> float:
    pos, neg = score[label], score[~label]
    pairs = [(p > n) + 0.5 * (p == n) for p, n in itertools.product(pos, neg)]
    return float(np.mean(pairs))


def test_auc_counts_ordered_pairs_and_ties() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        score = rng.integers(0, 5, 30).astype(float)  # many ties
        label = rng.random(30) < 0.4
        assert auc(score, label) == pytest.approx(_brute_auc(score, label))
    assert auc(np.array([1.0, 2.0]), np.array([True, True])) == 0.5  # one side empty
    assert auc(np.array([np.nan, 1.0, 2.0]), np.array([True, False, True])) == 1.0  # NaN left out


def test_the_logistic_model_recovers_a_planted_signal() -> None:
    rng = np.random.default_rng(1)
    n = 4_000
    feats = {"blocks": rng.integers(1, 60, n).astype(float), "output_tokens": rng.integers(1, 900, n).astype(float),
             "turns_before": rng.integers(0, 5, n).astype(float), "gap_s": rng.exponential(60, n), "hour": rng.random(n) * 24}
    logit = 2.5 * (np.log1p(feats["blocks"]) - np.log1p(feats["blocks"]).mean())
    y = rng.random(n) < 1 / (1 + np.exp(-logit))
    x = design(feats)
    w = fit_logistic(x[: n // 2], y[: n // 2])
    held = auc(x[n // 2 :] @ w, y[n // 2 :])
    assert held > 0.75  # the planted signal is found on data it was not fitted on
    assert held == pytest.approx(auc(logit[n // 2 :], y[n // 2 :]), abs=0.03)  # about as well as the truth ranks


def test_cli_prints_predictability_and_the_admission_frontier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Forty two-turn chats: each first turn is continued by a second turn much later.
    reqs = [(100 * i, 1024, [0, 10 + 2 * i]) for i in range(40)]
    reqs += [(10_000 + 100 * i, 1536, [0, 10 + 2 * i, 11 + 2 * i]) for i in range(40)]
    path = tmp_path / "c_trace.jsonl"
    _trace(path, reqs)
    assert main([str(path), "--admission", "dram=2,nvme=4,object=inf", "--json"]) == 0
    head, frontier = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert head["requests"] == 80
    assert head["continued_share"] == 0.5
    assert set(head["auc"]) == {"blocks", "output_tokens", "turns_before", "gap_s", "hour"}
    assert head["auc"]["blocks"] == 0.0  # the short first turns are the continued ones
    # The oracle refuses only blocks of turns that are never continued: no hit lost.
    assert frontier["oracle_continuation"]["hit_loss"] == 0.0
    assert frontier["oracle_continuation"]["writes_per_hit"] < frontier["store_all_writes_per_hit"]
    for name in ("model_continuation", "learned", "learned_x_continuation"):
        for point in frontier[name]:
            assert point["hit_loss"] <= point["budget"]


def test_cli_rejects_a_single_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s_trace.jsonl"
    _trace(path, [(0, 512, [0]), (1, 512, [0])])
    assert main([str(path), "--admission", "4"]) == 2
    out = capsys.readouterr()
    assert "two tiers or more" in out.err
    assert out.out == ""  # told before any work
