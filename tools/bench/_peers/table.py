"""Several runs of the peer bench as the markdown tables of docs/benchmarks.md, with spreads.

``python -m tools.bench._peers.table run1.jsonl run2.jsonl run3.jsonl``: one table per request
size (a cell is ``min–max`` over the runs that have the figure, with the run count when it is
not all of them), then the goal rows (kvstore against each peer, ratio spread, met in how many
runs).
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from tools.bench._peers import PEERS


def load(paths: list[str]) -> list[list[dict[str, Any]]]:
    return [[json.loads(line) for line in Path(p).read_text().splitlines() if line.strip()] for p in paths]


def spread(xs: list[float], runs: int, digits: int = 2) -> str:
    if not xs:
        return "—"
    lo, hi = min(xs), max(xs)
    cell = f"{lo:.{digits}f}" if round(lo, digits) == round(hi, digits) else f"{lo:.{digits}f}–{hi:.{digits}f}"
    return cell if len(xs) == runs else f"{cell} ({len(xs)} of {runs} runs)"


def tables(runs: list[list[dict[str, Any]]]) -> str:
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rows in runs:
        for r in rows:
            by[r["metric"]].append(r)
    n = len(runs)
    sizes = sorted({r["tokens"] for rows in runs for r in rows if "tokens" in r})
    out = []
    for tokens in sizes:
        size = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
        out.append(f"\n{tokens:,}-token requests ({n} runs; min–max):\n")
        out.append("| store | store GB/s | retrieve GB/s | memcpy GB/s (same process) | memcpy GB/s, several threads | "
                   "lookup ms | retrieve p99 ms, 8 clients | retrieve ms alone (p50) |")
        out.append("|---|---|---|---|---|---|---|---|")
        for peer in PEERS:
            st, rt = by.get(f"{peer}_{size}_store", []), by.get(f"{peer}_{size}_retrieve", [])
            if not st:
                gone = [r for k, v in by.items() if k.startswith(f"{peer}_{size}_") and k.endswith(("unavailable", "failed")) for r in v]
                if gone:
                    why = gone[0]["error"].split("; log:")[0].splitlines()[0][:160].replace("|", "/")
                    out.append(f"| {peer} | {gone[0]['status']} ({len(gone)} of {n} runs): {why} | | | | | | |")
                continue
            lk = by.get(f"{peer}_{size}_lookup", [])
            mt = by.get(f"{peer}_{size}_store_vs_mt_memcpy", []) + by.get(f"{peer}_{size}_retrieve_vs_mt_memcpy", [])
            threads = sorted({r["memcpy_threads"] for r in mt})
            mt_cell = f"{spread([r['baseline'] for r in mt], len(mt))} ({'/'.join(map(str, threads))} threads)" if mt else "—"
            p99 = [r for k, v in by.items() if k.startswith(f"{peer}_{size}_retrieve_p99_") and not k.endswith("skipped") for r in v]
            skipped = [r for k, v in by.items() if k.startswith(f"{peer}_{size}_retrieve_p99_") and k.endswith("skipped") for r in v]
            why = "not run (long requests)" if any("long" in r["error"] for r in skipped) else "skipped (one call at a time)"
            bad = [r for r in st + rt if not r.get("verified", True)]
            name = peer + (" (lost cached requests: missing tokens)" if any(r["missing_tokens"] for r in bad) else "")
            name += " (WRONG BYTES)" if any(r["wrong_chunks"] for r in bad) else ""
            out.append(f"| {name} | {spread([r['value'] for r in st], n)} | {spread([r['value'] for r in rt], n)} | "
                       f"{spread([r['baseline'] for r in st + rt], 2 * len(st))} | {mt_cell} | {spread([r['value'] for r in lk], n, 3)} | "
                       f"{spread([r['value'] for r in p99], n, 0) if p99 else why} | "
                       f"{spread([r['baseline'] for r in p99], n, 0) if p99 else '—'} |")
        out.append("\n| kvstore against | store: ratio | retrieve: ratio | goal | runs meeting it (store, retrieve) |")
        out.append("|---|---|---|---|---|")
        for k in sorted(by):
            if not k.endswith(f"_{size}_store") or "_vs_" not in k:
                continue
            pair = k[: -len(f"_{size}_store")]
            s_all, r_all = by[k], by.get(f"{pair}_{size}_retrieve", [])
            s, r = ([x for x in xs if "ratio" in x and math.isfinite(x["ratio"]) and x["baseline"]] for xs in (s_all, r_all))
            goal = s_all[0].get("goal_ratio")
            met = f"{sum(x['ratio'] >= goal for x in s)} of {len(s)}, {sum(x['ratio'] >= goal for x in r)} of {len(r)}" if goal else ""
            lost = len(s_all) + len(r_all) - len(s) - len(r)
            note = f" ({lost} not comparable: a store lost cached requests)" if lost else ""
            out.append(f"| {pair.replace('_vs_', ' vs ')}{note} | {spread([x['ratio'] for x in s], n)} | "
                       f"{spread([x['ratio'] for x in r], n)} | {'≥ ' + str(goal) if goal else ''} | {met} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(tables(load(sys.argv[1:])))
