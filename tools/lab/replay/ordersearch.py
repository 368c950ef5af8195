"""A search over *priority orders* of eviction/density.py's cells: how many hits can one
static order serve, with each cell's exact statistics and free prefetch?

:func:`tools.lab.replay.bounds.priority_order_hits` scores one order over the (class, age cell)s of
``policy_class_segments`` at ``density``'s age resolution (ratio 1.35): at every access tick the
rule holds the blocks of the best-ranked cells up to the tier's capacity (the edge cell in a
fractional share), so a reuse ``r`` of cell ``k`` at tick ``t`` is served with the share
``clip((capacity - above_r) / N_r, 0, 1)``, where ``above_r`` is the load (blocks held) of the
cells ranked above ``k`` at ``t`` and ``N_r`` the load of ``k`` itself. That rule ranks the
cells by whole-trace reuses per unit of space-time; this module looks for better orders.

Only the loads at the reuse ticks matter, so :func:`build` keeps a cells x reuses matrix ``L``
(reuses grouped by cell) instead of the cells x ticks occupancy. :class:`OrderState` keeps
``above_r`` for the current order and scores moving one cell to another rank incrementally:
only the reuses of the cells it passes (the moved cell's load joins or leaves their
``above``) and its own reuses (their ``above`` gains or loses the loads of the cells passed)
change. :meth:`OrderState.insertion_gains` scores every target rank of one cell at once.

:func:`search` is an iterated local search (best-insertion hill climbing over single-cell
moves, then random kicks of the best order, re-climbed), seeded and bounded in wall-clock time
and moves. It is a **search, not a bound**: its answer is the hits of one order it found, a
lower bound on the best static priority order's hits, never an upper bound.

CLI: ``python -m tools.lab.replay.ordersearch TRACE --capacity 5% --seconds 600 --seed 0 --json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tools.lab.replay import tool
from tools.lab.replay.bounds import (
    ClassSegments,
    _cell_occupancy,
    age_grid,
    class_segments,
    policy_class_segments,
)
from tools.replay.trace import load_trace
from tools.replay.yardsticks import unlimited

RATIO = 1.35
"""``density``'s age-bucket ratio (eviction/density.py's ``RATIO``), as in economics.py."""


@dataclass(frozen=True, slots=True)
class Instance:
    """What the hits of an order depend on: per reuse (grouped by cell), the loads of all cells."""

    loads: np.ndarray
    """Cells x reuses (float32, whole block counts, so exact): blocks each cell holds at the tick
    of each reuse."""
    own: np.ndarray
    """Per reuse, ``max(N_r, 1)``: the load of the reused block's own cell at its tick."""
    bounds: np.ndarray
    """Cell ``k``'s reuses are columns ``bounds[k]:bounds[k + 1]``."""
    space: np.ndarray
    """Per cell, its space-time over the whole trace (blocks held summed over every tick)."""

    @property
    def cells(self) -> int:
        return int(self.loads.shape[0])

    @property
    def reuses(self) -> np.ndarray:
        return np.diff(self.bounds)


def build(segments: ClassSegments, ratio: float | None = RATIO, chunk: int = 64) -> Instance:
    """The :class:`Instance` of ``segments``' cells at ``ratio`` (``_cell_occupancy`` at one
    row per tick, gathered at the reuse ticks a few cells at a time, then dropped)."""
    load, hit_cell, hit_tick = _cell_occupancy(segments, age_grid(segments.accesses, ratio), 1)
    return _gather(load, hit_cell, hit_tick - 1, slice(None), chunk)


def build_halves(segments: ClassSegments, ratio: float | None = RATIO, chunk: int = 64) -> tuple[Instance, Instance]:
    """Two instances over the same cells: the reuses of the first half of the trace's ticks
    (and each cell's space-time there), and those of the second half. An order searched on the
    first and scored on the second is what the statistics are worth *fitted on the past*."""
    load, hit_cell, hit_tick = _cell_occupancy(segments, age_grid(segments.accesses, ratio), 1)
    mid = load.shape[1] // 2
    tick = hit_tick - 1
    early = tick < mid
    first = _gather(load, hit_cell[early], tick[early], slice(0, mid), chunk)
    return first, _gather(load, hit_cell[~early], tick[~early], slice(mid, None), chunk)


def _gather(load: np.ndarray, hit_cell: np.ndarray, tick: np.ndarray, span: slice, chunk: int) -> Instance:
    """The instance of the reuses ``(hit_cell, tick)``, with space-time summed over ``span``."""
    by_cell = np.argsort(hit_cell, kind="stable")
    tick, cell = tick[by_cell], hit_cell[by_cell]
    loads = np.empty((load.shape[0], tick.size), dtype=np.float32)
    for first in range(0, load.shape[0], chunk):
        loads[first : first + chunk] = load[first : first + chunk][:, tick]
    space = load[:, span].sum(axis=1)
    own = np.maximum(load[cell, tick], 1.0)
    bounds = np.concatenate([[0], np.cumsum(np.bincount(cell, minlength=loads.shape[0]))]).astype(np.int64)
    return Instance(loads, own, bounds, space)


def default_order(inst: Instance) -> np.ndarray:
    """``priority_order_hits``' order: whole-trace reuses per unit of space-time, best first."""
    return np.argsort(-inst.reuses / np.maximum(inst.space, 1.0), kind="stable")


def reuse_tick_order(inst: Instance) -> np.ndarray:
    """Reuses per unit of load summed over the reuse ticks only (where the capacity binds)."""
    at_reuses = inst.loads.sum(axis=1, dtype=np.float64)
    return np.argsort(-inst.reuses / np.maximum(at_reuses, 1.0), kind="stable")


def _above(inst: Instance, order: np.ndarray) -> np.ndarray:
    """Per reuse, the load of the cells ranked above its own cell, from scratch."""
    above = np.zeros(inst.own.size)
    for rank, k in enumerate(order):
        lo, hi = inst.bounds[k], inst.bounds[k + 1]
        if rank and hi > lo:
            above[lo:hi] = inst.loads[order[:rank], lo:hi].sum(axis=0, dtype=np.float64)
    return above


def _shares(inst: Instance, above: np.ndarray, capacity: float) -> np.ndarray:
    return np.clip((capacity - above) / inst.own, 0.0, 1.0)


def order_hits(inst: Instance, order: np.ndarray, capacity: float) -> float:
    """The (expected) block hits of the priority order ``order`` (cells, best first) holding
    ``capacity`` blocks at every tick: ``priority_order_hits`` for any order."""
    return float(_shares(inst, _above(inst, np.asarray(order)), capacity).sum())


def _per_cell(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Per cell, the sum of its reuses' ``values`` (0 for a cell with none: ``np.add.reduceat``
    would give a neighbour's value there)."""
    run = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    return run[bounds[1:]] - run[bounds[:-1]]


class OrderState:
    """One order, its ``above`` per reuse, and incremental scores of single-cell moves."""

    def __init__(self, inst: Instance, order: np.ndarray, capacity: float) -> None:
        self.inst, self.capacity = inst, float(capacity)
        self.cell_of = np.repeat(np.arange(inst.cells), inst.reuses)
        self.set_order(order)

    def set_order(self, order: np.ndarray) -> None:
        self.order = np.array(order, dtype=np.int64)
        self.rank = np.empty_like(self.order)
        self.rank[self.order] = np.arange(self.order.size)
        self.above = _above(self.inst, self.order)
        self.share = _shares(self.inst, self.above, self.capacity)

    @property
    def hits(self) -> float:
        return float(self.share.sum())

    def _move_effect(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, slice, np.ndarray]:
        """The reuses of the passed cells, their new ``above``, the moved cell's reuses and
        their new ``above``, for moving the cell at rank ``a`` to rank ``b``."""
        inst, c = self.inst, int(self.order[a])
        lo, hi = (b, a - 1) if b < a else (a + 1, b)
        passed = self.order[lo : hi + 1]
        r_rank = self.rank[self.cell_of]
        hit = np.flatnonzero((r_rank >= lo) & (r_rank <= hi))
        mine = slice(int(inst.bounds[c]), int(inst.bounds[c + 1]))
        sign = 1.0 if b < a else -1.0  # moving up: c's load joins the passed cells' above
        others = self.above[hit] + sign * inst.loads[c, hit]
        own = self.above[mine] - sign * inst.loads[passed, mine].sum(axis=0, dtype=np.float64)
        return hit, others, mine, own

    def move_gain(self, a: int, b: int) -> float:
        """The change in hits if the cell at rank ``a`` moved to rank ``b`` (others shift)."""
        if a == b:
            return 0.0
        hit, others, mine, own = self._move_effect(a, b)
        cap, inst = self.capacity, self.inst
        gain = np.clip((cap - others) / inst.own[hit], 0.0, 1.0).sum() - self.share[hit].sum()
        gain += np.clip((cap - own) / inst.own[mine], 0.0, 1.0).sum() - self.share[mine].sum()
        return float(gain)

    def move(self, a: int, b: int) -> None:
        """Move the cell at rank ``a`` to rank ``b``, updating ``above`` incrementally."""
        if a == b:
            return
        hit, others, mine, own = self._move_effect(a, b)
        self.above[hit], self.above[mine] = others, own
        self.share[hit] = np.clip((self.capacity - others) / self.inst.own[hit], 0.0, 1.0)
        self.share[mine] = np.clip((self.capacity - own) / self.inst.own[mine], 0.0, 1.0)
        c = self.order[a]
        self.order = np.insert(np.delete(self.order, a), b, c)
        self.rank[self.order] = np.arange(self.order.size)

    def insertion_gains(self, a: int) -> np.ndarray:
        """For every rank ``b``, the change in hits if the cell at rank ``a`` moved there."""
        inst, cap, c = self.inst, self.capacity, int(self.order[a])
        rest = np.delete(self.order, a)
        # Every other reuse, with c's load taken out of its above: served without c above it
        # (c placed below its cell) or with it (c placed above).
        below_c = self.rank[self.cell_of] > a
        bare = self.above - np.where(below_c, inst.loads[c], 0.0)
        without = np.clip((cap - bare) / inst.own, 0.0, 1.0)
        with_c = np.clip((cap - bare - inst.loads[c]) / inst.own, 0.0, 1.0)
        per_without = _per_cell(without, inst.bounds)[rest]
        per_with = _per_cell(with_c, inst.bounds)[rest]
        # c at rank b: the cells rest[:b] above it keep `without`, rest[b:] get `with`.
        pre_without = np.concatenate([[0.0], np.cumsum(per_without)])
        pre_with = np.concatenate([[0.0], np.cumsum(per_with)])
        others = pre_without + (pre_with[-1] - pre_with)
        lo, hi = int(inst.bounds[c]), int(inst.bounds[c + 1])
        mine = np.zeros(rest.size + 1)
        if hi > lo:
            step = max(1, 4_000_000 // (hi - lo))
            run = np.zeros(hi - lo)
            own = inst.own[lo:hi]
            mine[0] = np.clip(cap / own, 0.0, 1.0).sum()
            for first in range(0, rest.size, step):  # c's above as it passes rest[:b], a block of ranks at a time
                part = np.cumsum(inst.loads[rest[first : first + step], lo:hi], axis=0, dtype=np.float64) + run
                mine[first + 1 : first + 1 + part.shape[0]] = np.clip((cap - part) / own, 0.0, 1.0).sum(axis=1)
                run = part[-1]
        total = others + mine
        return total - total[a]


@dataclass(slots=True)
class SearchResult:
    """:func:`search`'s answer. ``hits`` is re-evaluated from scratch for ``order``."""

    order: np.ndarray
    hits: float
    start_hits: float
    moves: int
    """Single-cell moves scored (each target rank of each insertion scan counts once)."""
    accepted: int
    seconds: float
    climbs: int
    best_at: list[tuple[float, float]] = field(default_factory=list)
    """(seconds, best hits) at every improvement of the best order."""


def _climb(state: OrderState, rng: np.random.Generator, deadline: float, budget: int,
           count: list[int]) -> None:
    """Best-insertion hill climbing: scan the cells in random order, move each to its best rank
    if that gains, until a whole scan gains nothing (or the time or move budget runs out)."""
    m = state.order.size
    while True:
        improved = False
        for c in rng.permutation(m):
            if time.monotonic() > deadline or count[0] >= budget:
                return
            a = int(state.rank[c])
            gains = state.insertion_gains(a)
            count[0] += m - 1
            b = int(np.argmax(gains))
            if gains[b] > 1e-9:
                state.move(a, b)
                count[1] += 1
                improved = True
        if not improved:
            return


def _kick(order: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random perturbation: a few cells moved a few ranks, or a short run reversed."""
    order = order.copy()
    m = order.size
    if m < 2:
        return order
    for _ in range(int(rng.integers(1, 5))):
        a = int(rng.integers(m))
        if rng.random() < 0.7:
            b = int(np.clip(a + rng.integers(-12, 13), 0, m - 1))
            order = np.insert(np.delete(order, a), b, order[a])
        else:
            b = min(m, a + int(rng.integers(2, 6)))
            order[a:b] = order[a:b][::-1]
    return order


def search(inst: Instance, capacity: float, seconds: float = 60.0, seed: int = 0, max_moves: int = 10**12,
           progress: float = 30.0, label: str = "") -> SearchResult:
    """Iterated local search for the order of ``inst``'s cells with the most hits at
    ``capacity``: climb from each start (``default_order``, ``reuse_tick_order``), then kick the
    best order found and climb again, accepting a kicked optimum that is no worse than the
    current one (or, rarely, a little worse), until ``seconds`` or ``max_moves`` run out. A
    search: the hits of the best order *found*, not the best order's."""
    rng = np.random.default_rng(seed)
    t0 = time.monotonic()
    deadline = t0 + seconds
    count = [0, 0]  # moves scored, moves made
    state = OrderState(inst, default_order(inst), capacity)
    start = state.hits
    best_order, best = state.order.copy(), start
    current, current_hits = best_order, start
    best_at = [(0.0, start)]
    last_note = t0
    climbs = 0

    def note(state: OrderState) -> None:
        nonlocal best_order, best, last_note
        if state.hits > best + 1e-9:
            best_order, best = state.order.copy(), state.hits
            best_at.append((round(time.monotonic() - t0, 1), best))
        if progress and time.monotonic() - last_note >= progress:
            last_note = time.monotonic()
            print(f"{label} {last_note - t0:.0f}s best {best:.1f} moves {count[0]} made {count[1]} climbs {climbs}",
                  file=sys.stderr, flush=True)

    for first in (None, reuse_tick_order(inst)):  # the default order first: the state holds it
        if first is not None:
            state.set_order(first)
        _climb(state, rng, deadline, max_moves, count)
        climbs += 1
        note(state)
        if state.hits >= best - 1e-9:
            current, current_hits = state.order.copy(), state.hits
    while time.monotonic() < deadline and count[0] < max_moves and inst.cells > 1:
        state.set_order(_kick(current, rng))  # from scratch: no drift however long it runs
        _climb(state, rng, deadline, max_moves, count)
        climbs += 1
        note(state)
        if state.hits >= current_hits - 1e-9 or rng.random() < 0.05:
            current, current_hits = state.order.copy(), state.hits
        if rng.random() < 0.1:  # return to the best now and then
            current, current_hits = best_order.copy(), best
    final = order_hits(inst, best_order, capacity)
    return SearchResult(best_order, final, start, count[0], count[1], time.monotonic() - t0, climbs, best_at)


def first_tier_blocks(spec: str, unique_blocks: int) -> int:
    """The first tier's blocks of a capacity string, as the replay reads it (``5%``, ``2000``,
    ``dram=5%,nvme=25%,object=inf``)."""
    from tools.replay.sim import parse_tiers

    return parse_tiers(spec, unique_blocks)[0].blocks


CLASSES = {"density": policy_class_segments, "rich": class_segments}
"""The cells searched: `density`'s (hits x extended, the default), or the richer classes of
:func:`tools.lab.replay.bounds.class_segments` (hits, partial tail, last reuse gap, new, depth)."""


def main(argv: list[str] | None = None) -> int:
    p = tool.parser(
        "python -m tools.lab.replay.ordersearch",
        "Search for a static priority order over eviction/density.py's (class, age cell)s "
        "(ratio 1.35) that serves the most reuses from a first tier of the given capacity, with exact "
        "whole-trace statistics and free prefetch (tools.lab.replay.bounds.priority_order_hits' rule for any "
        "order). A search, not a bound: 'best' is the share of one order found, a lower bound on the best "
        "order's. Shares are of unlimited(trace).sum(), the served hits of --economics. Prints one line per "
        "capacity; progress on stderr. Exit codes: 0 ok, 2 bad input.")
    p.add_argument("--capacity", action="append", default=None,
                   help="first tier's capacity, as the replay reads it (5%%, 2000, or dram=5%%,nvme=25%%,"
                   "object=inf: its first tier); repeatable (default 5%%)")
    p.add_argument("--classes", choices=sorted(CLASSES), default="density",
                   help="density: the policy's own cells (default); rich: the richer classes of the bounds")
    p.add_argument("--holdout", action="store_true",
                   help="also search on the first half of the trace and score that order on the second half "
                   "(beside the second half's own search): what the statistics are worth fitted on the past")
    p.add_argument("--seconds", type=float, default=60.0, help="wall-clock budget per search (default 60)")
    p.add_argument("--moves", type=int, default=10**12, help="budget of single-cell moves scored per search")
    p.add_argument("--seed", type=int, default=0, help="numpy Generator seed (default 0)")
    p.add_argument("--progress", type=float, default=30.0, help="seconds between progress lines (0: none)")
    p.add_argument("--json", action="store_true", help="JSON lines (the default prints them too, as text)")
    return tool.run(_run, p.parse_args(argv))


def _run(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace)
    name = Path(args.trace).name
    specs = [(spec, first_tier_blocks(spec, trace.unique_blocks)) for spec in args.capacity or ["5%"]]
    served = float(unlimited(trace).sum())
    segments = CLASSES[args.classes](trace)
    inst = build(segments)
    halves = build_halves(segments) if args.holdout else None
    for spec, blocks in specs:
        got = search(inst, blocks, args.seconds, args.seed, args.moves, args.progress, f"{name} {spec}")
        row = {"trace": name, "classes": args.classes, "capacity": spec, "capacity_blocks": blocks,
               "served": served, "cells": inst.cells, "reuses": int(inst.own.size),
               "start_share": round(got.start_hits / max(served, 1.0), 6),
               "best_share": round(got.hits / max(served, 1.0), 6), "moves": got.moves, "accepted": got.accepted,
               "climbs": got.climbs, "seconds": round(got.seconds, 1), "seed": args.seed,
               "best_share_at_s": [[t, round(h / max(served, 1.0), 6)] for t, h in got.best_at],
               "best_order": got.order.tolist()}
        if halves is not None:
            first, second = halves
            fit = search(first, blocks, args.seconds, args.seed, args.moves, args.progress, f"{spec} first half")
            own = search(second, blocks, args.seconds, args.seed, args.moves, args.progress, f"{spec} second half")
            n1, n2 = max(first.own.size, 1), max(second.own.size, 1)
            row["holdout"] = {"first_half_reuses": int(first.own.size), "second_half_reuses": int(second.own.size),
                              "fitted_on_first_scored_on_first": round(fit.hits / n1, 6),
                              "fitted_on_first_scored_on_second": round(order_hits(second, fit.order, blocks) / n2, 6),
                              "fitted_on_second_scored_on_second": round(own.hits / n2, 6)}
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            held = row.get("holdout")
            print(f"{row['trace']} {spec} ({blocks} blocks, {args.classes} cells): start {row['start_share']:.4f} best "
                  f"{row['best_share']:.4f} ({got.moves} moves, {got.seconds:.0f} s)"
                  + (f"; fitted on the first half, the second half's share {held['fitted_on_first_scored_on_second']:.4f}"
                     f" (its own fit {held['fitted_on_second_scored_on_second']:.4f})" if held else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
