"""Subtree refusals counted exactly (tools/lab/replay/subtree.py), on traces small enough to follow
by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tools.lab.replay import economics as E
from tools.lab.replay.cli import main
from tools.lab.replay.subtree import (
    Decisions,
    TraceTree,
    class_frontier,
    replay_refusals,
    standalone_costs,
)
from tools.replay.sim import EPOCH, expand_unlimited, parse_capacity, replay_store
from tools.replay.trace import Trace, load_trace
from tools.replay.yardsticks import unlimited


def _trace(path: Path, reqs: list[list[int]]) -> Trace:
    with path.open("w") as f:
        for t, ids in enumerate(reqs):
            f.write(json.dumps({"timestamp": 10 * t, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}) + "\n")
    return load_trace(path)


@pytest.fixture
def chat(tmp_path: Path) -> tuple[Trace, TraceTree]:
    """Request 0 reads a chain 0-1-2, request 1 an unrelated block 3, request 2 the chain again
    (dense ids equal the trace's here)."""
    trace = _trace(tmp_path / "chat_trace.jsonl", [[0, 1, 2], [3], [0, 1, 2]])
    return trace, TraceTree.of(trace, E.block_parents(trace))


def test_trace_tree(tmp_path: Path) -> None:
    # Two chains sharing block 0: 0-1-2 and 0-3; a root of its own, 4.
    trace = _trace(tmp_path / "t_trace.jsonl", [[0, 1, 2], [0, 3], [4], [0, 1]])
    tree = TraceTree.of(trace, E.block_parents(trace))
    assert sorted(tree.seen_subtree(0, 3).tolist()) == [0, 1, 2, 3]
    assert tree.seen_subtree(0, 0).tolist() == [0, 1, 2]  # block 3 is not read before request 1
    assert tree.seen_subtree(1, 3).tolist() == [1, 2]
    assert tree.seen_subtree(4, 3).tolist() == [4]
    assert tree.first_req.tolist() == [0, 0, 0, 1, 2]
    assert tree.new_after.tolist() == [3, 4, 5, 5]
    # A store holding 4 blocks is in request 1; holding 5, in request 2 (3 adds none).
    assert tree.request_at(4) == 1 and tree.request_at(5) == 2
    assert tree.next_read(np.array([0, 1, 2, 4]), 1, 4).tolist() == [3, 3, 4, 2]


def test_a_refusal_loses_the_hits_of_its_whole_subtree(chat: tuple[Trace, TraceTree]) -> None:
    trace, tree = chat
    # After request 1: block 2 leaves (written), then block 1 with its subtree (2), then 3.
    dec = Decisions(np.array([1, 1, 1]), np.array([2, 1, 3]), np.array([True, True, True]))
    store_all = replay_refusals(trace, tree, dec, np.array([False, False, False]))
    assert (store_all.writes, store_all.lost) == (3, 0)
    o = replay_refusals(trace, tree, dec, np.array([False, True, False]))
    # Request 2 misses blocks 1 and 2, both gone with the refusal (the optimistic bound counted
    # one); both are put back after their decisions had passed: one write each again.
    assert (o.lost, o.refused, o.cut, o.rewrites) == (2, 1, 1, 2)
    assert o.writes == 4  # blocks 2 and 3, then 1 and 2 again
    leaf = replay_refusals(trace, tree, dec, np.array([True, False, False]))
    assert (leaf.lost, leaf.cut, leaf.writes) == (1, 0, 3)
    # A subtree that was not free to go is written, whatever the class says.
    busy = Decisions(dec.req, dec.block, np.array([True, False, True]))
    assert replay_refusals(trace, tree, busy, np.array([False, True, False])) == store_all


def test_a_decision_about_a_block_gone_with_its_parent_is_no_write(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "gone_trace.jsonl", [[0, 1, 2], [3], [4]])  # never read again
    tree = TraceTree.of(trace, E.block_parents(trace))
    dec = Decisions(np.array([1, 2, 2]), np.array([0, 1, 2]), np.array([True, True, True]))
    o = replay_refusals(trace, tree, dec, np.array([True, False, False]))
    assert (o.writes, o.lost, o.refused, o.cut) == (0, 0, 1, 2)


def test_standalone_costs(chat: tuple[Trace, TraceTree]) -> None:
    trace, tree = chat
    dec = Decisions(np.array([1, 1, 1]), np.array([2, 1, 3]), np.array([True, True, False]))
    lost, saved = standalone_costs(trace, tree, dec)
    assert lost.tolist() == [1, 2, 0]  # block 2 alone; block 1 and its child; not free: nothing
    assert saved[2] == 0
    assert saved[0] == 0  # its write saved, one write again when it is put back


def test_class_frontier_keeps_within_the_budget(tmp_path: Path) -> None:
    # Ten chains of two blocks, each read once; chain 0 is read again at the end.
    reqs = [[2 * i, 2 * i + 1] for i in range(10)] + [[0, 1]]
    trace = _trace(tmp_path / "f_trace.jsonl", reqs)
    tree = TraceTree.of(trace, E.block_parents(trace))
    # Each chain's root decided (with its child) after request 9; class 1 for chain 0, 0 else.
    dec = Decisions(np.full(10, 9), np.arange(0, 20, 2), np.ones(10, bool))
    classes = np.array([1] + [0] * 9)
    nothing, some = class_frontier(trace, tree, dec, classes, hits=100, budgets=(0.0, 0.02))
    # Losing nothing: class 0 only (9 roots refused, their children with them).
    assert (nothing.classes_skipped, nothing.outcome.writes, nothing.outcome.lost) == (1, 1, 0)
    assert nothing.outcome.cut == 9
    # Refusing chain 0 too would save no write (it is written again when it is read back), so
    # its class is never ranked: a larger budget refuses nothing more.
    assert (some.classes_skipped, some.outcome.writes, some.outcome.lost) == (1, 1, 0)


def test_recorder_notes_requests_and_free_subtrees(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "r_trace.jsonl", [[0, 1, 2], [5, 6], [7, 8], [0, 1, 2, 3], [9]])
    tiers = parse_capacity(expand_unlimited("dram=1,nvme=2,object=inf", trace.unique_blocks), trace.unique_blocks, 1)
    E.register_future("r", E.last_access_s(trace, EPOCH), trace)
    replay_store(trace, tiers, "lru", block_tokens=512, admission="record", admission_options={"future": "r", "upper": 1})
    rec = E._RECORDS.pop("r")
    cols = rec.columns
    assert rec.blocks == [0, 1, 2, 3, 4, 5]  # every block but the last two leaves NVMe once
    # Each decision follows the request whose put made the room (a store-all run holds every
    # block, so its size says which).
    assert cols["req"] == [1, 1, 2, 2, 3, 4]
    assert cols["subtree"] == [2, 1, 0, 1, 0, 1]
    # Block 0 left NVMe while a block of its subtree was in DRAM: not free to go with it.
    assert cols["free"] == [False, True, True, True, True, True]


def test_cli_reports_the_exact_frontier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reqs = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(40)] + [[0, 1, 2]]
    _trace(tmp_path / "c_trace.jsonl", reqs)
    rc = main([str(tmp_path / "c_trace.jsonl"), "--capacity", "dram=2,nvme=4,object=inf", "--policy", "lru", "--economics",
               "--json", "--no-progress"])
    assert rc == 0
    ref = next(r for r in map(json.loads, capsys.readouterr().out.splitlines()) if r.get("policy") == "reference")
    for name in (*E.CLASS_SETS, "rule_order"):
        (point,) = ref[f"exact_subtree_{name}"]
        assert point["budget"] == 0.01
        assert point["hit_loss"] <= 0.01
        # Never more writes than storing everything (every block but the last DRAM and NVMe
        # hold reaches the object tier once).
        assert 0 <= point["writes_per_hit"] <= ref["class_bound_leaves_only_last_tier_writes_per_hit"]


def test_admission_frontier_option_reports_every_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _trace(tmp_path / "o_trace.jsonl", [[2 * i, 2 * i + 1] for i in range(20)] + [[0, 1]])
    rc = main([str(tmp_path / "o_trace.jsonl"), "--capacity", "dram=2,nvme=4,object=inf", "--policy", "lru", "--economics",
               "--admission-frontier", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if "counted exactly" in s)
    for budget in ("0.25%", "0.5%", "0.75%", "1%", "2%", "5%"):
        assert f"(budget {budget})" in line


def test_holdout_learns_on_the_first_half_and_pays_on_the_second(tmp_path: Path) -> None:
    from tools.lab.replay.subtree import holdout

    def run(last: list[int]) -> tuple[float, float]:
        # Ten two-block chains (requests 0-9), nine more (10-18), then one chain read again.
        reqs = [[2 * i, 2 * i + 1] for i in range(19)] + [last]
        trace = _trace(tmp_path / "h_trace.jsonl", reqs)
        tree = TraceTree.of(trace, E.block_parents(trace))
        # Five roots decided after request 5 (chain 0's in a class of its own), five after 15.
        blocks = np.array([0, 2, 4, 6, 8, 20, 22, 24, 26, 28])
        dec = Decisions(np.array([5] * 5 + [15] * 5), blocks, np.ones(10, bool))
        classes = np.array([1, 0, 0, 0, 0, 0, 0, 0, 0, 0])
        costs = standalone_costs(trace, tree, dec)
        h = holdout(trace, tree, dec, classes, unlimited(trace), 0.01, costs)
        return h.writes_per_hit, h.hit_loss

    # Class 0 is never read again in the first half: skipped in the second, where nothing of
    # it is read again either: no write, no loss.
    assert run([0, 1]) == (0.0, 0.0)
    # The same choice when the second half's class-0 chain 10 comes back: both its hits lost,
    # and its root written again.
    assert run([20, 21]) == (0.5, 1.0)


def _many(tmp_path: Path, tail: list[list[int]]) -> tuple[Trace, TraceTree, Decisions, np.ndarray, np.ndarray]:
    """Sixty two-block chains, each read once more two chains later when it is even (requests
    10 ms apart; ``tail`` follows); one decision per chain root, at its request."""
    reqs: list[list[int]] = []
    for i in range(60):
        reqs.append([2 * i, 2 * i + 1])
        if i >= 2 and (i - 2) % 2 == 0:
            reqs.append([2 * (i - 2), 2 * (i - 2) + 1])
    trace = _trace(tmp_path / "m_trace.jsonl", reqs + tail)
    tree = TraceTree.of(trace, E.block_parents(trace))
    first = tree.first_req[np.arange(0, 120, 2)]
    dec = Decisions(first, np.arange(0, 120, 2), np.ones(60, bool))
    times = EPOCH + trace.timestamps_ms[first] / 1000.0
    # The feature that tells the two kinds apart: the depth column (even chains "deep").
    feats = np.zeros((60, 9))
    feats[:, 1] = np.where(np.arange(60) % 2 == 0, 8.0, 0.0)
    return trace, tree, dec, times, feats


def test_learned_scores_use_only_labels_already_past(tmp_path: Path) -> None:
    from eviction.online_model import ModelConfig
    from tools.lab.replay.subtree import learned_scores, score_frontier

    cfg = ModelConfig(window=256, refit_every=4, min_samples=8)
    trace, tree, dec, times, feats = _many(tmp_path, [])
    p = learned_scores(trace, tree, dec, times, feats, horizon_s=0.1, config=cfg, batch=1)
    assert (p[:5] == 1.0).all()  # no label is 100 ms old before then
    assert p[-1] < 1.0 and p[-2] < 1.0
    assert p[-2] > 0.5 > p[-1]  # even chains are read again, odd ones not
    # The same trace with every chain read once more at its end: only labels no decision
    # waited for change (reads past the horizon), so no score does.
    more = [[2 * i, 2 * i + 1] for i in range(60)]
    trace2, tree2, dec2, times2, _ = _many(tmp_path, more)
    assert np.array_equal(p, learned_scores(trace2, tree2, dec2, times2, feats, horizon_s=0.1, config=cfg, batch=1))
    hits = int(unlimited(trace).sum())
    (point,) = score_frontier(trace, tree, dec, p, hits, (0.0,))
    assert point.outcome.lost == 0 and point.outcome.refused > 0  # the odd chains go, at no loss
    assert point.outcome.writes < 60


def test_last_read_is_the_latest_request_at_or_before(chat: tuple[Trace, TraceTree]) -> None:
    trace, tree = chat  # requests: [0, 1, 2], [3], [0, 1, 2]
    reqs = trace.num_requests
    assert tree.last_read(np.array([0, 0, 0, 3, 3]), np.array([0, 1, 2, 0, 2]), reqs).tolist() == [0, 0, 2, -1, 1]
    assert tree.last_read(np.array([2, 3]), 1, reqs).tolist() == [0, 1]
    # Its mirror: the next read after the last read at or before r is after r.
    blocks, r = np.array([0, 1, 2, 3]), 1
    assert (tree.next_read(blocks, r, reqs) > r).all()
