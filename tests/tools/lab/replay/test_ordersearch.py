"""tools/lab/replay/ordersearch.py: the fast evaluation of priority orders and the search over them."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from tools.lab.replay import ordersearch as O
from tools.lab.replay.bounds import ClassSegments, policy_class_segments, priority_order_hits
from tools.replay.synth import generate, write_trace
from tools.replay.trace import load_trace


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ordersearch") / "multi_turn_trace.jsonl"
    write_trace(path, generate("multi-turn", 150, seed=3))
    return path


def _random_instance(rng: np.random.Generator, cells: int, per: int) -> O.Instance:
    """A made instance: ``per`` reuses per cell, whole-block loads, each reuse's own cell holding
    at least its block."""
    n = cells * per
    loads = rng.integers(0, 6, size=(cells, n)).astype(np.float32)
    cell = np.repeat(np.arange(cells), per)
    loads[cell, np.arange(n)] += 1
    return O.Instance(loads, loads[cell, np.arange(n)].astype(np.float64), np.arange(0, n + 1, per),
                      rng.integers(1, 100, size=cells).astype(np.float64))


def test_evaluation_equals_priority_order_hits(made: Path) -> None:
    seg = policy_class_segments(load_trace(made))
    inst = O.build(seg)
    assert inst.cells > 5
    for capacity in (3, 20, 80):
        ref = priority_order_hits(seg, capacity, O.RATIO)
        assert O.order_hits(inst, O.default_order(inst), capacity) == pytest.approx(ref, rel=1e-6)
        assert O.OrderState(inst, O.default_order(inst), capacity).hits == pytest.approx(ref, rel=1e-6)


def test_evaluation_on_the_bounds_example() -> None:
    # test_priority_order_moves_its_cut_with_the_load's example (tests/tools/lab/replay/test_economics.py).
    seg = ClassSegments([np.array([10.0, 10.0])], 20, [np.array([1, 2])])
    inst = O.build(seg, ratio=2.0)
    assert O.order_hits(inst, O.default_order(inst), 1) == pytest.approx(1.5)
    assert O.order_hits(inst, O.default_order(inst), 2) == pytest.approx(2.0)


def test_incremental_moves_equal_a_fresh_evaluation() -> None:
    rng = np.random.default_rng(7)
    inst = _random_instance(rng, 9, 12)
    state = O.OrderState(inst, rng.permutation(9), capacity=14)
    for _ in range(200):
        a, b = (int(x) for x in rng.integers(9, size=2))
        gains = state.insertion_gains(a)
        before = state.hits
        gain = state.move_gain(a, b)
        assert gains[b] == pytest.approx(gain, abs=1e-9)
        state.move(a, b)
        fresh = O.order_hits(inst, state.order, 14)
        assert state.hits == pytest.approx(fresh, abs=1e-9)
        assert fresh - before == pytest.approx(gain, abs=1e-9)
        assert np.array_equal(state.above, O.OrderState(inst, state.order, 14).above)


def test_cells_without_reuses_score_like_the_others() -> None:
    # A split of a trace (fitted on its first half) leaves cells with no reuse there, at the
    # ends and between others: their moves must be scored as exactly as any.
    rng = np.random.default_rng(3)
    counts = np.array([0, 3, 0, 0, 5, 2, 0, 4, 0])
    bounds = np.concatenate([[0], np.cumsum(counts)])
    n, cells = int(bounds[-1]), counts.size
    loads = rng.integers(0, 6, size=(cells, n)).astype(np.float32)
    cell = np.repeat(np.arange(cells), counts)
    loads[cell, np.arange(n)] += 1
    inst = O.Instance(loads, loads[cell, np.arange(n)].astype(np.float64), bounds, np.ones(cells))
    state = O.OrderState(inst, rng.permutation(cells), capacity=9)
    for _ in range(100):
        a, b = (int(x) for x in rng.integers(cells, size=2))
        assert state.insertion_gains(a)[b] == pytest.approx(state.move_gain(a, b), abs=1e-9)
        state.move(a, b)
        assert state.hits == pytest.approx(O.order_hits(inst, state.order, 9), abs=1e-9)


def test_search_finds_the_best_order_of_a_tiny_instance() -> None:
    rng = np.random.default_rng(1)
    found = 0
    for trial in range(4):
        inst = _random_instance(rng, 6, 5)
        capacity = float(rng.integers(4, 15))
        best = max(O.order_hits(inst, np.array(p), capacity) for p in itertools.permutations(range(6)))
        got = O.search(inst, capacity, seconds=60.0, seed=trial, max_moves=3_000, progress=0)
        assert got.hits <= best + 1e-9  # a search: never above the best order
        assert got.hits == pytest.approx(O.order_hits(inst, got.order, capacity))
        assert got.hits >= got.start_hits - 1e-9
        found += got.hits == pytest.approx(best, abs=1e-9)
    assert found == 4


def test_cli_prints_one_line_per_capacity(made: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert O.main([str(made), "--capacity", "5%", "--capacity", "dram=10%,nvme=25%,object=inf",
                   "--seconds", "0.5", "--moves", "2000", "--progress", "0", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    trace = load_trace(made)
    assert [r["capacity_blocks"] for r in rows] == [int(0.05 * trace.unique_blocks), int(0.1 * trace.unique_blocks)]
    for r in rows:
        assert r["start_share"] <= r["best_share"] <= 1.0
        assert r["seed"] == 0 and r["moves"] > 0


def test_the_halves_split_the_reuses_of_the_whole(made: Path) -> None:
    seg = policy_class_segments(load_trace(made))
    whole = O.build(seg)
    first, second = O.build_halves(seg)
    assert first.cells == second.cells == whole.cells
    assert first.own.size + second.own.size == whole.own.size
    assert first.own.size > 0 and second.own.size > 0
    assert np.allclose(first.space + second.space, whole.space)
    rng = np.random.default_rng(5)
    for capacity in (3, 20):
        for _ in range(3):
            order = rng.permutation(whole.cells)
            # The same order serves each reuse the same share, in the whole or in its half.
            assert O.order_hits(first, order, capacity) + O.order_hits(second, order, capacity) == pytest.approx(
                O.order_hits(whole, order, capacity))


def test_cli_holdout_and_rich_classes(made: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert O.main([str(made), "--classes", "rich", "--holdout", "--seconds", "0.3", "--moves", "2000",
                   "--progress", "0", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["classes"] == "rich"
    assert row["cells"] > O.build(policy_class_segments(load_trace(made))).cells  # finer than density's
    held = row["holdout"]
    assert held["first_half_reuses"] + held["second_half_reuses"] == row["reuses"]
    for key in ("fitted_on_first_scored_on_first", "fitted_on_first_scored_on_second", "fitted_on_second_scored_on_second"):
        assert 0.0 <= held[key] <= 1.0


def test_cli_tells_a_bad_capacity(made: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert O.main([str(made), "--capacity", "lots", "--progress", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "lots" in err
