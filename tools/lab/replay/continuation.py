"""``python -m tools.lab.replay.continuation TRACE``: does anything the store or the engine sees say
whether a conversation gets another turn, and what would admission to the last tier gain by it?

Issue 18's object-tier goal (0.3 writes per hit within 1% of the hits lost) is met by an oracle
that knows one thing only: whether the request that last touched a block is *continued* (a later
request reads its last full block). This tool measures how well that is predicted from what a
request shows when it arrives: its length, its output length (the engine knows it when the turn
ends), how many turns came before it, the time since the previous turn, and the hour. Per
feature the ROC AUC (0.5: no signal), then a logistic model over all of them fitted on the first
half of the requests and scored on the second (held out). It is a measurement, not a bound.

With ``--admission SPEC`` it also replays the store (the default policy, storing everything and
recording each last-tier decision, as ``--economics`` does) and prints the exact subtree
frontier (tools/lab/replay/subtree.py) of refusing the decisions ranked by: the continuation oracle;
the held-out model's probability for the request that last read the block; the ``learned``
admission model's online score; and the product of the two. The share refused is chosen in
hindsight, per budget (``score_frontier``): what each ranking is worth, at best.
One JSON line per section with ``--json``. Exit codes: 0 ok, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from tools.lab.replay import tool
from tools.lab.replay.economics import (
    _RECORDS,
    block_parents,
    last_access_s,
    recorder_options,
    register_future,
)
from tools.lab.replay.subtree import (
    TraceTree,
    learned_scores,
    replay_refusals,
    score_frontier,
)
from tools.replay.sim import EPOCH, TierCapacity, parse_tiers, replay_store
from tools.replay.trace import Trace, load_trace

BUDGETS = (0.005, 0.01, 0.02)


@dataclass(frozen=True, slots=True)
class Turns:
    """Per request of a trace: whether it is continued, and what it shows on arrival."""

    continued: np.ndarray
    """A later request reads this request's last full block (its last block when the input is
    a whole number of blocks, else the one before)."""
    features: dict[str, np.ndarray]
    """``blocks``, ``output_tokens``, ``turns_before``, ``gap_s`` (since the previous turn; NaN
    for a first turn) and ``hour`` (of the trace's clock)."""


def turns(trace: Trace, tree: TraceTree, block_tokens: int = 512) -> Turns:
    """Continuation labels and arrival features. A request's previous turn is the latest earlier
    request that read its deepest block seen before, the shared first block (a system prompt)
    left out."""
    reqs = trace.num_requests
    off, ids = trace.offsets, trace.block_ids.astype(np.int64)
    length = np.diff(off)
    last_full = np.where(trace.input_tokens % block_tokens == 0, length - 1, length - 2).clip(0)
    has = length > 0
    last = np.where(has, ids[np.minimum(off[:-1] + last_full, max(ids.size - 1, 0))], 0)
    continued = has & (tree.next_read(last, np.arange(reqs), reqs) < reqs)
    stamps = trace.timestamps_ms.astype(np.float64)
    before = np.zeros(reqs)
    gap = np.full(reqs, np.nan)
    for r in range(reqs):
        chain = ids[off[r] : off[r + 1]]
        seen = np.flatnonzero(tree.first_req[chain] < r)
        seen = seen[seen >= 1]
        if seen.size:
            prev = int(tree.last_read(chain[seen[-1]], r - 1, reqs))
            before[r] = before[prev] + 1
            gap[r] = (stamps[r] - stamps[prev]) / 1000.0
    feats = {"blocks": length.astype(np.float64), "output_tokens": trace.output_tokens.astype(np.float64),
             "turns_before": before, "gap_s": gap, "hour": (stamps / 3.6e6) % 24}
    return Turns(continued, feats)


def auc(score: np.ndarray, label: np.ndarray) -> float:
    """ROC AUC of ``score`` for ``label`` (ties count one half; NaN scores left out); 0.5 when
    one side is empty."""
    ok = ~np.isnan(score)
    s, y = score[ok], label[ok].astype(bool)
    pos, neg = int(y.sum()), int((~y).sum())
    if not pos or not neg:
        return 0.5
    uniq, inv = np.unique(s, return_inverse=True)
    counts = np.bincount(inv)
    mid_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based average rank of each value
    return float((mid_rank[inv][y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def design(feats: dict[str, np.ndarray]) -> np.ndarray:
    """The model's columns, standardised, with an intercept."""
    gap = feats["gap_s"]
    x = np.column_stack([np.log1p(feats["blocks"]), np.log1p(feats["blocks"]) ** 2, np.log1p(feats["output_tokens"]),
                         np.minimum(feats["turns_before"], 8), np.log1p(np.nan_to_num(gap, nan=0.0)),
                         np.isnan(gap).astype(np.float64), feats["hour"]])
    x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1e-9)
    return np.column_stack([np.ones(len(x)), x])


def fit_logistic(x: np.ndarray, y: np.ndarray, ridge: float = 1e-3, steps: int = 50) -> np.ndarray:
    """Ridge logistic regression by Newton's method; the weights."""
    w = np.zeros(x.shape[1])
    yf = y.astype(np.float64)
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        grad = x.T @ (yf - p) - ridge * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + ridge * np.eye(w.size)
        step = np.linalg.solve(hess, grad)
        w += step
        if np.abs(step).max() < 1e-9:
            break
    return w


def predictability(t: Turns) -> tuple[dict[str, Any], np.ndarray]:
    """Per-feature AUCs and the held-out model's; and the model's probability per request."""
    y = t.continued
    row: dict[str, Any] = {"requests": int(y.size), "continued_share": round(float(y.mean()) if y.size else 0.0, 4)}
    row["auc"] = {k: round(auc(v, y), 4) for k, v in t.features.items()}
    x = design(t.features)
    half = y.size // 2
    w = fit_logistic(x[:half], y[:half])
    prob = 1.0 / (1.0 + np.exp(-(x @ w)))
    row["model_auc_fitted_half"] = round(auc(prob[:half], y[:half]), 4)
    row["model_auc_held_out_half"] = round(auc(prob[half:], y[half:]), 4)
    return row, prob


def _tiers(trace: Trace, spec: str) -> list[TierCapacity]:
    tiers = parse_tiers(spec, trace.unique_blocks)
    if len(tiers) < 2:
        raise ConfigError(f"--admission {spec!r}: give two tiers or more, e.g. dram=5%,nvme=25%,object=inf")
    return tiers


def admission(trace: Trace, spec: str, t: Turns, prob: np.ndarray, block_tokens: int) -> dict[str, Any]:
    """The last tier's exact subtree frontier for rankings by continuation (module docstring)."""
    tiers = _tiers(trace, spec)
    key = f"continuation:{trace.name}@{spec}"
    register_future(key, last_access_s(trace, EPOCH), trace)
    policy = StoreConfig().policy
    run = replay_store(trace, tiers, policy, block_tokens=block_tokens, admission="record",
                       admission_options=recorder_options(key, tiers))
    rec = _RECORDS.pop(key)
    assert rec.tree is not None, "the recorder ran without the trace's tree"
    tree = rec.tree[1]
    dec = rec.decisions()
    hits = int(run.hits.sum())
    # The request that last read each decision's block, at or before the decision (a decision
    # follows a read of its block, so there is one).
    last_req = tree.last_read(dec.block, dec.req, trace.num_requests)
    per_hit = max(hits, 1)

    def point(o: Any) -> dict[str, float]:
        return {"writes_per_hit": round(o.writes / per_hit, 4), "hit_loss": round(o.lost / per_hit, 4)}

    row: dict[str, Any] = {"capacity": spec, "policy": policy, "decisions": int(dec.req.size), "hits": hits,
                           "store_all_writes_per_hit": round(dec.req.size / per_hit, 4),
                           "oracle_continuation": point(replay_refusals(trace, tree, dec, ~t.continued[last_req]))}
    learned = np.minimum(learned_scores(trace, tree, dec, np.asarray(rec.times), np.asarray(rec.learned, np.float64)), 1.0)
    scores = {"model_continuation": prob[last_req], "learned": learned, "learned_x_continuation": learned * prob[last_req]}
    for name, score in scores.items():
        row[name] = [{"budget": p.budget, **point(p.outcome), "refused_share": round(p.share_of_next, 3)}
                     for p in score_frontier(trace, tree, dec, np.minimum(score, 0.999), hits, BUDGETS)]
    return row


def _emit(row: dict[str, Any], as_json: bool) -> None:
    print(json.dumps(row) if as_json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def run(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace)
    for spec in args.admission or ():
        _tiers(trace, spec)  # a mistake in the tiers is told before the work, not after
    tree = TraceTree.of(trace, block_parents(trace))
    t = turns(trace, tree, args.block_tokens)
    row, prob = predictability(t)
    _emit({"trace": trace.name, **row}, args.json)
    for spec in args.admission or ():
        print(f"replaying {trace.name} at {spec} (recording every last-tier decision)...", file=sys.stderr, flush=True)
        _emit({"trace": trace.name, **admission(trace, spec, t, prob, args.block_tokens)}, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = tool.parser("python -m tools.lab.replay.continuation", __doc__)
    p.add_argument("--admission", action="append", metavar="SPEC",
                   help="also the admission frontier at these tiers, e.g. dram=5%%,nvme=25%%,object=inf (repeatable)")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per block of the trace's hash ids (default 512)")
    p.add_argument("--json", action="store_true", help="one JSON object per section")
    return tool.run(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
