"""``python -m tools.lab.replay.holdout TRACE``: are richer block classes learnable, or memorised?

The class bound (``--class-bound``) assumes each class's reuse statistics are known in advance;
with many classes that knowledge is partly the trace itself. Here each class's keep-age is
fitted on the first half of the trace (by block accesses) and applied to the second, for
several feature sets, beside LRU, the store's default policy and OPT measured on the same
second half (those three replay the whole trace; only the second half's hits are counted).
One JSON line per capacity with ``--json``. Exit codes: 0 ok, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from kvstore.config import StoreConfig
from tools.lab.replay import tool
from tools.lab.replay.bounds import EXTRA_FEATURES, class_segments, holdout_class_hits
from tools.replay.sim import parse_capacity, replay_store
from tools.replay.trace import load_trace
from tools.replay.yardsticks import belady

FEATURE_SETS: dict[str, tuple[str, ...]] = {"base": (), "length": ("length",), "all": EXTRA_FEATURES}


def run(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace)
    per_request = np.diff(trace.offsets)
    late = np.cumsum(per_request) > trace.num_blocks // 2  # requests that end in the second half
    late_blocks = int(per_request[late].sum())
    segments = {name: class_segments(trace, args.block_tokens, f) for name, f in FEATURE_SETS.items()}
    policy = StoreConfig().policy
    for spec in args.capacity or ["1%", "5%", "10%"]:
        (tier,) = parse_capacity(spec, trace.unique_blocks, 1)
        row: dict[str, Any] = {"capacity": spec, "capacity_blocks": tier.blocks}

        def rate(hits: np.ndarray) -> float:
            return round(float(hits[late].sum()) / late_blocks, 4)

        row["lru"] = rate(replay_store(trace, [tier], "lru", block_tokens=args.block_tokens).hits)
        row[policy] = rate(replay_store(trace, [tier], policy, block_tokens=args.block_tokens).hits)
        row["opt"] = rate(belady(trace, tier.blocks))
        for name, seg in segments.items():
            second = seg.accesses - seg.accesses // 2
            row[f"holdout_{name}"] = round(holdout_class_hits(seg, tier.blocks) / second, 4)
            row[f"classes_{name}"] = len(seg.gaps)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = tool.parser("python -m tools.lab.replay.holdout", __doc__)
    p.add_argument("--capacity", action="append", metavar="SPEC", help="a share of unique blocks or a block count (default: 1%%, 5%%, 10%%; repeatable)")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per block of the trace's hash ids (default 512)")
    p.add_argument("--json", action="store_true", help="one JSON object per capacity")
    return tool.run(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
