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


def best_of(fn: Callable[[], Any], repeat: int = 5) -> float:
    """Fastest wall time of ``repeat`` calls, in seconds (the least noisy estimate)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


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
