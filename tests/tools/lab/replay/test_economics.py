"""Tier economics of the replay, on traces small enough to follow by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tools.lab.replay import economics as E
from tools.lab.replay.bounds import (
    ClassSegments,
    _packing_dual,
    age_grid,
    class_bound,
    holdout_window_hits,
    instant_window_bound,
    keep_until_occupancy,
    policy_class_segments,
    priority_order_hits,
    window_bound,
)
from tools.lab.replay.cli import main
from tools.replay.sim import EPOCH, expand_unlimited, parse_capacity, replay_store
from tools.replay.trace import Trace, load_trace
from tools.replay.yardsticks import unlimited


def _write(path: Path, reqs: list[tuple[int, list[int]]]) -> Path:
    with path.open("w") as f:
        for t, ids in reqs:
            f.write(json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}) + "\n")
    return path


@pytest.fixture
def three(tmp_path: Path) -> Path:
    """Three one-block requests, then the first again: with one block of DRAM and one of NVMe,
    block 0 is written to the object tier at the third request and hit there at the fourth;
    block 1, pushed down then, is never read again."""
    return _write(tmp_path / "three_trace.jsonl", [(0, [0]), (10, [1]), (20, [2]), (30, [0])])


def _tiers(trace: Trace, spec: str = "dram=1,nvme=1,object=inf") -> list:
    return parse_capacity(expand_unlimited(spec, trace.unique_blocks), trace.unique_blocks, 1)


def test_store_everything_figures(three: Path) -> None:
    trace = load_trace(three)
    tiers = _tiers(trace)
    run = replay_store(trace, tiers, "lru", block_tokens=512)
    f = E.tier_figures(tiers, run, block_bytes=100)
    assert f["hit_blocks"] == 1
    assert f["hit_share_by_tier"] == {"dram": 0.0, "nvme": 0.0, "object": 1.0}
    assert f["hit_bytes_by_tier"] == {"dram": 0, "nvme": 0, "object": 100}
    # DRAM: three puts and the promotion of block 0; NVMe: the three demotions from DRAM;
    # object: block 0 (third request) and block 1 (pushed down by the promotion).
    assert f["writes_by_tier"] == {"dram": 4, "nvme": 3, "object": 2}
    assert f["last_tier_writes_per_hit"] == 2.0
    assert f["skipped_writes"] == 0


def test_oracle_writes_only_what_is_read_again(three: Path) -> None:
    trace = load_trace(three)
    tiers = _tiers(trace)
    E.register_future("three", E.last_access_s(trace, EPOCH))
    run = replay_store(trace, tiers, "lru", block_tokens=512, admission="oracle", admission_options={"future": "three"})
    f = E.tier_figures(tiers, run, block_bytes=1)
    assert f["hit_blocks"] == 1  # no hit lost
    assert f["writes_by_tier"]["object"] == 1  # block 0 only; block 1 is never read again
    assert f["skipped_writes"] == 1


def test_admission_class_bound() -> None:
    classes = np.array([0, 0, 1, 1, 2])
    reused = np.array([False, False, True, False, True])
    assert E.admission_class_bound(classes, reused, 0) == 3  # class 0 (never read again) skipped
    assert E.admission_class_bound(classes, reused, 0.5) == 3  # class 1 would lose a whole hit
    assert E.admission_class_bound(classes, reused, 1) == 1  # classes 0 and 1
    leaf = np.array([True, False, True, True, True])  # block 1 must be written
    assert E.admission_class_bound(classes, reused, 0, leaf) == 4
    assert E.admission_class_bound(classes[:0], reused[:0], 1) == 0


def test_subtree_class_bound_frees_what_a_refusal_cuts_off(tmp_path: Path) -> None:
    # Decisions about blocks 0, 1 (child of 0), 2 (child of 1) and 3 (a root of its own).
    classes = np.array([0, 1, 1, 1])
    reused = np.array([False, True, False, False])
    blocks = np.array([0, 1, 2, 3])
    parent = np.array([-1, 0, 1, -1])
    assert E.admission_class_bound(classes, reused, 0) == 3  # class 0 skipped, class 1 written
    # Skipping block 0 cuts off 1 and 2: only block 3 is written.
    assert E.subtree_class_bound(classes, reused, 0, blocks, parent) == 1
    # A descendant decided before its ancestor was refused was written all the same.
    assert E.subtree_class_bound(classes[::-1], reused[::-1], 0, blocks[::-1], parent) == 3
    assert E.subtree_class_bound(classes[:0], reused[:0], 1, blocks[:0], parent) == 0
    trace = load_trace(_write(tmp_path / "t_trace.jsonl", [(0, [5, 6, 7]), (1, [5, 8]), (2, [9])]))
    # dense ids in order of first use: 5 -> 0, 6 -> 1, 7 -> 2, 8 -> 3, 9 -> 4
    assert E.block_parents(trace).tolist() == [-1, 0, 1, 0, -1]


def test_belady_first_tier(tmp_path: Path) -> None:
    trace = load_trace(_write(tmp_path / "b_trace.jsonl", [(0, [0, 1]), (1, [2]), (2, [0, 1]), (3, [2]), (4, [0, 3])]))
    served = unlimited(trace)
    assert served.tolist() == [0, 0, 2, 1, 1]
    # Two blocks of DRAM: Belady keeps 0 and 1 (used at request 2) and drops 2 (used at 3);
    # at request 3, block 2 misses DRAM (the object tier serves it); block 0 stays for request 4.
    hits = E.belady_tier_hits(trace, 2, served)
    assert hits.tolist() == [0, 0, 2, 0, 1]


def test_cli_prints_economics_and_references(three: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([str(three), "--capacity", "dram=1,nvme=1,object=inf", "--policy", "lru", "--economics", "--json", "--no-progress"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    econ = [r for r in rows if "writes_by_tier" in r]
    ref = [r for r in rows if r.get("policy") == "reference"]
    assert econ[0]["last_tier_writes_per_hit"] == 2.0
    assert econ[0]["admission"] == "reuse"  # the store's default, compared with storing everything
    assert econ[0]["hit_loss"] == 0.0
    assert ref[0]["oracle_last_tier_writes_per_hit"] == 1.0
    assert ref[0]["belady_first_tier_hit_share"] == 1.0  # block 0 stays: used again, 1 and 2 never
    # Blocks 0 and 1 reach the object tier in one class (never hit, depth 0, idle 20 s), one of
    # them read again: skipping the class would lose the only hit.
    assert ref[0]["class_bound_last_tier_writes_per_hit"] == 2.0
    assert ref[0]["class_bound_leaves_only_last_tier_writes_per_hit"] == 2.0
    assert ref[0]["subtree_class_bound_last_tier_writes_per_hit"] == 2.0
    # One block of DRAM for the one reuse (block 0, 3 accesses later, in a class of three new
    # blocks): keeping the class until age 3 costs 9 block-accesses of the 4 there are, so 4/9
    # of the hit; holding it only around age 3 (evict, then prefetch) costs almost nothing.
    assert ref[0]["class_bound_first_tier_hit_share"] == pytest.approx(4 / 9, abs=1e-3)  # ages on a grid
    assert ref[0]["window_bound_first_tier_hit_share"] == 1.0
    assert ref[0]["rich_window_bound_first_tier_hit_share"] == 1.0
    # At density's own age resolution the window around age 3 is [2.46, 3.32): still room.
    assert ref[0]["window_bound_by_age_ratio_first_tier_hit_share"] == {"1.35": 1.0, "1.15": 1.0, "1.05": 1.0}
    # Held to the room at every access: block 0 alone is in that window at its reuse.
    assert ref[0]["instant_window_bound_first_tier_hit_share"] == pytest.approx(1.0, abs=0.01)
    assert ref[0]["instant_window_bound_halves_first_tier_hit_share"] == pytest.approx(1.0, abs=0.01)
    assert ref[0]["instant_window_feasible_first_tier_hit_share"] <= ref[0]["instant_window_bound_first_tier_hit_share"]
    assert ref[0]["priority_order_first_tier_hit_share"] == 1.0
    # The second half (accesses 3 and 4) starts no segment that is reused: nothing to score.
    assert ref[0]["holdout_window_by_age_ratio_first_tier_hit_share"] == {"1.35": 0.0, "1.15": 0.0, "1.05": 0.0, "fine": 0.0}
    occ = ref[0]["keep_until_occupancy_first_tier_blocks"]
    assert set(occ) == {"q10", "q50", "q90", "max"} and 0 <= occ["q10"] <= occ["q50"] <= occ["q90"] <= occ["max"]
    assert 0 <= ref[0]["keep_until_over_capacity_share"] <= 1


def test_admission_rule_reports_its_hit_loss(three: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([str(three), "--capacity", "dram=1,nvme=1,object=inf", "--policy", "lru", "--admission", "reuse",
               "--economics", "--json", "--no-progress"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    econ = next(r for r in rows if "writes_by_tier" in r)
    # Too few decisions to learn a class: everything is stored, nothing is lost.
    assert econ["hit_loss"] == 0.0
    assert econ["store_all_last_tier_writes_per_hit"] == econ["last_tier_writes_per_hit"] == 2.0
    assert np.isclose(econ["hit_share_by_tier"]["object"], 1.0)


def test_window_bound_prices_each_age_window() -> None:
    # One class: a block reused at age 50,000 and three never reused, over 100,000 accesses.
    seg = ClassSegments([np.array([50_000.0, np.inf, np.inf, np.inf])], 100_000)
    # Keeping the class until age 50,000 costs 4 x 50,000 = 2 x the room of one block: half the hit.
    assert class_bound(seg, 1) == pytest.approx(0.5, abs=1e-3)  # ages on a grid
    # Holding the blocks only in the age window around 50,000 costs 4 x its width: the whole hit.
    assert window_bound(seg, 1) == pytest.approx(1.0, abs=1e-3)
    # Two classes: the window bound takes the better hits per space first, and never falls
    # below the keep-until bound.
    two = ClassSegments([np.array([10.0, 20.0]), np.array([5_000.0, np.inf])], 10_000)
    for cap in (1, 2):
        assert window_bound(two, cap) >= class_bound(two, cap) - 1e-9


def test_window_bound_on_a_coarser_age_grid_bounds_fewer_rules() -> None:
    seg = ClassSegments([np.array([50_000.0, np.inf, np.inf, np.inf])], 100_000)
    # Ratio 4: the reuse at 50,000 lies in [16,384, 65,536); holding that cell costs the reused
    # block 33,616 and each other 49,152, 181,072 in all against room for 100,000.
    assert window_bound(seg, 1, ratio=4.0) == pytest.approx(100_000 / 181_072)
    # Ratio 2, the cell [32,768, 65,536): 17,232 + 3 x 32,768 = 115,536.
    assert window_bound(seg, 1, ratio=2.0) == pytest.approx(100_000 / 115_536)
    # Nested grids (every ratio-4 cell is two ratio-2 cells): the coarser class is smaller.
    assert window_bound(seg, 1, ratio=4.0) <= window_bound(seg, 1, ratio=2.0) <= window_bound(seg, 1) + 1e-9
    assert age_grid(10, 2.0).tolist() == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0]
    with pytest.raises(ValueError, match="ratio"):
        age_grid(10, 1.0)


def test_holdout_window_keeps_the_cells_the_first_half_paid_for() -> None:
    def segments(late_gap: float) -> ClassSegments:
        # Class 0: ten blocks reused 100 accesses later in each half (the second half's at
        # ``late_gap``); class 1: ten blocks never reused in each half.
        first, second = np.arange(1_000, 1_010), np.arange(11_000, 11_010)
        g0 = np.concatenate([np.full(10, 100.0), np.full(10, late_gap)])
        g1 = np.full(20, np.inf)
        starts = np.concatenate([first, second])
        return ClassSegments([g0, g1], 20_000, [starts, starts])

    # The same ages in both halves: the cell [64, 128) of class 0, fitted on the first half,
    # catches all ten reuses of the second.
    assert holdout_window_hits(segments(100.0), 1, ratio=2.0) == (10.0, 10)
    # The second half's reuses come at 5,000: the cells paid for first (ages up to 4,096) are
    # worth nothing there, and the room runs out before the one that would be.
    assert holdout_window_hits(segments(5_000.0), 1, ratio=2.0) == (0.0, 10)
    # With every reuse statistic known (the bound), the window at 5,000 is found.
    assert window_bound(segments(5_000.0), 1, ratio=2.0) >= 10


def test_keep_until_occupancy_meets_the_capacity_on_average_only() -> None:
    # Two blocks accessed at ticks 1 and 2, each reused 10 accesses later, over 20 accesses:
    # room for one block on average (20 block-accesses) keeps both until their reuse.
    seg = ClassSegments([np.array([10.0, 10.0])], 20, [np.array([1, 2])])
    assert class_bound(seg, 1) == pytest.approx(2.0)
    occ = keep_until_occupancy(seg, 1)
    assert occ.tolist() == [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1] + [0] * 9
    assert occ.mean() == pytest.approx(1.0)  # the capacity, on average; twice it for 9 accesses


def test_instant_window_bound_holds_the_capacity_at_every_tick() -> None:
    # keep_until_occupancy's example: two blocks accessed at ticks 1 and 2, each reused 10
    # accesses later. On average one block of room keeps both; at ticks 11 both wait in the age
    # cell (8, 16] of their reuse, so a table over that cell holds at most half of each.
    seg = ClassSegments([np.array([10.0, 10.0])], 20, [np.array([1, 2])])
    assert window_bound(seg, 1, ratio=2.0) == pytest.approx(2.0)
    got = instant_window_bound(seg, 1, ratio=2.0, step=1)
    assert got.feasible - 1e-6 <= 1.0 <= got.bound + 1e-6
    assert got.bound == pytest.approx(1.0, abs=0.02)
    assert (got.cells, got.rows) == (1, 20)
    # Merging ticks into rows relaxes the capacity (here to the average): a bound still, higher.
    assert instant_window_bound(seg, 1, ratio=2.0, step=20).bound == pytest.approx(2.0, abs=0.02)
    # A table per epoch is a larger family: never lower.
    assert instant_window_bound(seg, 1, ratio=2.0, step=1, epochs=4).bound >= got.bound - 0.02
    with pytest.raises(ValueError, match="epochs"):
        instant_window_bound(seg, 1, epochs=0)


def test_instant_window_bound_is_above_every_table_that_fits(tmp_path: Path) -> None:
    # Every 0/1 table over the cells of a small trace that never holds more than the capacity
    # (checked tick by tick, by brute force) hits at most the bound; the average bound is higher.
    rng = np.random.default_rng(3)
    reqs = [(t, [int(b) for b in rng.choice(5, size=rng.integers(1, 3), replace=False)]) for t in range(14)]
    seg = policy_class_segments(load_trace(_write(tmp_path / "r_trace.jsonl", reqs)))
    horizons = age_grid(seg.accesses, 3.0)
    cells = []  # (class, cell index): ticks held, reuse ticks
    for g, s in zip(seg.gaps, seg.starts, strict=True):
        for j in range(horizons.size - 1):
            lo, hi = np.floor(horizons[j]), np.floor(horizons[j + 1])
            held = [int(s0 + a) for s0, g0 in zip(s, g, strict=True) for a in range(int(lo) + 1, int(hi) + 1)
                    if a <= min(g0, seg.accesses - s0)]
            reused = [int(s0 + g0) for s0, g0 in zip(s, g, strict=True) if np.isfinite(g0) and lo < g0 <= hi]
            if reused:
                cells.append((held, reused))
    assert 2 <= len(cells) <= 14
    for capacity in (1, 2, 3):
        best = 0
        for mask in range(1 << len(cells)):
            chosen = [c for k, c in enumerate(cells) if mask >> k & 1]
            load = np.bincount([t for held, _ in chosen for t in held], minlength=seg.accesses + 1)
            if load.max(initial=0) <= capacity:
                best = max(best, sum(len(r) for _, r in chosen))
        got = instant_window_bound(seg, capacity, ratio=3.0, step=1)
        assert best - 1e-6 <= got.bound <= window_bound(seg, capacity, ratio=3.0) + 1e-6
        assert got.feasible <= got.bound + 1e-6
    assert instant_window_bound(seg, 1, ratio=3.0, step=1).bound < window_bound(seg, 1, ratio=3.0) - 1  # it bites


def test_packing_dual_brackets_the_optimum() -> None:
    # Two cells sharing one row of room 1 (max x0 + 2 x1, x0 + x1 <= 1): the optimum is 2.
    bound, feasible = _packing_dual(np.array([1.0, 2.0]), np.array([[1.0], [1.0]]), 2_000)
    assert feasible <= 2.0 + 1e-9 <= bound + 2e-9
    assert bound == pytest.approx(2.0, abs=0.01) and feasible == pytest.approx(2.0, abs=0.01)
    # No row: every cell is held.
    assert _packing_dual(np.array([1.0, 2.0]), np.zeros((2, 0)), 10) == (3.0, 3.0)


def test_priority_order_moves_its_cut_with_the_load() -> None:
    # One class, two blocks reused at age 10 (ticks 11 and 12) and nothing else: with room for
    # one block, the only cell ranks first and a random half of its two waiting blocks is held
    # at tick 11 (both wait), the whole of the one left at tick 12: 1.5 hits in expectation,
    # above the table bound of 1 (a table cannot hold more of the cell when it empties).
    seg = ClassSegments([np.array([10.0, 10.0])], 20, [np.array([1, 2])])
    assert priority_order_hits(seg, 1, ratio=2.0) == pytest.approx(1.5)
    assert priority_order_hits(seg, 2, ratio=2.0) == pytest.approx(2.0)


def test_policy_class_segments(tmp_path: Path) -> None:
    # Request 0 puts blocks 0, 1; request 1 reads 0 and 1 again and extends the chain with 2.
    trace = load_trace(_write(tmp_path / "p_trace.jsonl", [(0, [0, 1]), (1, [0, 1, 2])]))
    seg = policy_class_segments(trace)
    assert seg.accesses == 5
    gaps = sorted(g.tolist() for g in seg.gaps)
    # (0 hits, extended): block 0, reused 2 accesses later; (0 hits, not extended): block 1,
    # reused 2 later, and block 2, never; (1 hit, extended): blocks 0 and 1 (2 extends 1), never.
    assert gaps == [[2.0], [2.0, np.inf], [np.inf, np.inf]]
