"""Shared helpers for benchmarks: every result is a figure *and* its same-run baseline."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any


def result(bench: str, metric: str, value: float, unit: str, baseline: float, **extra: Any) -> dict[str, Any]:
    """One JSON line: ``ratio`` = value / baseline, both in ``unit``."""
    ratio = value / baseline if baseline else float("nan")
    out = {
        "bench": bench,
        "metric": metric,
        "value": round(value, 6),
        "unit": unit,
        "baseline": round(baseline, 6),
        "ratio": round(ratio, 4),
    }
    out.update(extra)
    return out


# Upper bounds on the value, by the goal's key (``goal_ms=1.0``: at most 1 ms).
_UPPER = {"goal_ms": "ms", "goal_us": "us", "goal_s": "s", "goal_bytes": "B"}


def missed_goals(row: dict[str, Any]) -> list[str]:
    """What ``row`` misses of the goals it states, one sentence each (empty: every goal met).

    ``goal_ms`` / ``goal_us`` / ``goal_s`` / ``goal_bytes``: the value may be at most this;
    ``goal_speedup``: ``speedup`` at least this; ``goal_ratio``: value / baseline at least this
    for a rate (a unit ending in ``/s``) and at most this otherwise (a time, a size). A goal of
    None states none. An unknown ``goal_*`` key is a bug in the benchmark, not a pass.
    """
    out = []
    value, unit = row["value"], row["unit"]
    for key, goal in row.items():
        if not key.startswith("goal_") or goal is None:
            continue
        if key in _UPPER:
            if not value <= goal:
                out.append(f"{value:g} {unit} > goal {goal:g} {_UPPER[key]}")
        elif key == "goal_speedup":
            if not row["speedup"] >= goal:
                out.append(f"speedup {row['speedup']:g} < goal {goal:g}")
        elif key == "goal_ratio":
            rate = unit.endswith("/s")
            ratio = row["ratio"]
            if not (ratio >= goal if rate else ratio <= goal):
                out.append(f"ratio {ratio:g} {'<' if rate else '>'} goal {goal:g} (value / baseline)")
        else:
            raise ValueError(f"{row['bench']}/{row['metric']}: unknown goal {key!r}; known: "
                             f"{', '.join([*_UPPER, 'goal_speedup', 'goal_ratio'])}")
    return out


def best_of(fn: Callable[[], Any], repeat: int = 5) -> float:
    """Fastest wall time of ``repeat`` calls, in seconds (the least noisy estimate)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def rotating_trials(sides: list[tuple[str, Callable[[], Any]]], rounds: int, gb: float) -> dict[str, list[float]]:
    """Rates (``gb`` / seconds) of every side, ``rounds`` trials each, after one untimed call of
    each (the warm-up). Each trial calls every side once, starting one side later than the trial
    before, so no side always runs first or right after another."""
    for _, fn in sides:
        fn()
    rates: dict[str, list[float]] = {name: [] for name, _ in sides}
    for r in range(rounds):
        k = r % len(sides)
        for name, fn in sides[k:] + sides[:k]:
            t0 = time.perf_counter()
            fn()
            rates[name].append(gb / (time.perf_counter() - t0))
    return rates


def median_trial(trials: list[tuple[float, float]]) -> tuple[float, float, list[float]]:
    """The trial whose ratio is the median: ``(value, baseline, every trial's ratio)``.

    A trial is ``(value, baseline)``, two rates measured back to back. A noisy neighbour that hits
    a few trials moves their ratios, not the median one, and the median trial's value and
    baseline come from the same moments, so ``value / baseline`` is the reported ratio. With an
    even count the lower of the two middle ratios is taken (never a flattering mean of two).
    """
    if not trials:
        raise ValueError("median_trial of no trials")
    ratios = [v / b if b else float("nan") for v, b in trials]
    order = sorted(range(len(trials)), key=lambda i: ratios[i])
    value, baseline = trials[order[(len(order) - 1) // 2]]
    return value, baseline, [round(r, 4) for r in ratios]


def emit(row: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
    else:
        extra = {k: v for k, v in row.items() if k not in ("bench", "metric", "value", "unit", "baseline", "ratio")}
        print(
            f"{row['bench']:>6} {row['metric']:<28} {row['value']:>12.4f} {row['unit']:<8} "
            f"baseline {row['baseline']:>12.4f}  ratio {row['ratio']:.3f}  {extra or ''}",
            file=sys.stdout,
            flush=True,
        )
