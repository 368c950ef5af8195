"""``python -m tools.lab.replay TRACE``: the replay of ``python -m tools.replay`` with the research
references beside it, from the same replays.

* ``--class-bound`` (with ``--class-features``): the best hit rate of any policy that ranks by
  block class and age with perfect statistics (:func:`tools.lab.replay.bounds.class_bound`);
* ``--economics`` (with ``--admission-frontier``): hits and writes by tier, Belady on the first
  tier, the admission oracle and the class and subtree bounds of admission
  (:mod:`tools.lab.replay.economics`).

Every other argument and the exit codes are the product replay's (:mod:`tools.replay.cli`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvstore.errors import UsageError
from tools.lab.replay import economics
from tools.lab.replay.bounds import EXTRA_FEATURES, ClassSegments, class_bound, class_segments
from tools.replay import cli
from tools.replay.sim import TierCapacity
from tools.replay.trace import Trace

FRONTIER_BUDGETS = (0.0025, 0.005, 0.0075, 0.01, 0.02, 0.05)


def parser() -> argparse.ArgumentParser:
    p = cli.parser("python -m tools.lab.replay")
    p.add_argument("--class-bound", action="store_true", help="also the best hit rate of any policy that ranks by block class and age with perfect statistics (an upper bound for learned policies; slower)")
    p.add_argument("--class-features", default="", metavar="F,F", help=f"with --class-bound: request features added to the class ({', '.join(EXTRA_FEATURES)}); finer classes are partly memorised, see docs/eviction.md")
    p.add_argument("--economics", action="store_true", help="also hits and writes by tier, with Belady-first-tier and admission-oracle references (tools/lab/replay/economics.py)")
    p.add_argument("--admission-frontier", action="store_true", help="with --economics: the exact subtree-refusal frontier at hit losses of 0.25/0.5/0.75/1/2/5%% (tools/lab/replay/subtree.py; default: at 1%% only)")
    return p


class Research:
    """The references of ``--class-bound`` and ``--economics`` (:class:`tools.replay.cli.Extras`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.features = tuple(f.strip() for f in args.class_features.split(",") if f.strip())
        if self.features and not args.class_bound:
            raise UsageError("--class-features needs --class-bound")
        self._segments: ClassSegments | None = None

    def bounds(self, trace: Trace, capacity_blocks: int) -> dict[str, float]:
        if not self.args.class_bound:
            return {}
        if self._segments is None:
            try:
                self._segments = class_segments(trace, self.args.block_tokens, self.features)
            except ValueError as e:
                raise UsageError(str(e)) from None
        n = max(trace.num_blocks, 1)
        return {"class_bound_block_hit_rate": min(class_bound(self._segments, capacity_blocks) / n, 1.0)}

    def after(self, trace: Trace, spec: str, tiers: list[TierCapacity], runs: dict[str, Any],
              replay: Any, args: argparse.Namespace, block_bytes: int) -> None:
        if args.economics:
            budgets = FRONTIER_BUDGETS if args.admission_frontier else (0.01,)
            economics.report(trace, spec, tiers, runs, replay, args.admission, block_bytes, args.json, budgets)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        research = Research(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return cli.run_cli(args, research)
