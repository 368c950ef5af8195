"""``python -m tools.replay TRACE``: hit rates of eviction policies on a request trace.

Every figure is printed beside its yardsticks from the same run: LRU through the same store at
the same capacity, Belady's offline optimum (OPT) and an unlimited cache, and the share of the
LRU-to-OPT gap the policy closes. Exit codes: 0 ok, 2 bad input (missing trace, bad capacity,
unknown policy), 1 a replay failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from eviction.cost import MODELS, CostModel
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, KVStoreError, UsageError
from kvstore.registry import POLICIES, build_config, policy_class
from kvstore.units import parse_duration
from kvstore.version import version
from tools.replay.plot import write_svg
from tools.replay.sim import TierCapacity, parse_tiers, replay_store, summarize
from tools.replay.trace import Trace, TraceError, load_trace
from tools.replay.yardsticks import belady, unlimited

EPILOG = """\
capacity: a share of the trace's unique blocks ('5%'), a number of blocks ('2000') or bytes
('64GiB', at --model's KV bytes per block); several tiers, fastest first: 'dram=1%,nvme=5%'.
Repeat --capacity (or give --sweep) for several capacities.

examples:
  python -m tools.replay traces/mooncake/conversation_trace.jsonl --capacity 5% --policy density --json
  python -m tools.replay TRACE --sweep --policy all --plot hit-rates.svg
"""


def parser(prog: str = "python -m tools.replay") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Replay a request trace (Mooncake JSONL: timestamp ms, input_length, "
        "output_length, hash_ids) through the store's real index, tier manager and eviction "
        "code, metadata only, on the trace's clock. Each request looks up its blocks "
        "(longest-prefix hits), then stores the rest. Reports block and token hit rates and "
        "the prefill compute saved, beside LRU, Belady (OPT) and an unlimited cache.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("trace", help="Mooncake-format JSONL trace file (.jsonl, or .jsonl.gz read compressed)")
    p.add_argument("--capacity", action="append", metavar="SPEC", help="tier capacities (default 5%%)")
    p.add_argument("--sweep", action="store_true", help="capacities 1%%, 5%%, 10%% and 25%%")
    p.add_argument(
        "--policy", action="append", metavar="NAME",
        help=f"policy to replay, or 'all' (known: {', '.join(sorted(POLICIES))}; default: the store's default)",
    )
    p.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE", help="an option of the policy's Config")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per block of the trace's hash ids (default 512)")
    p.add_argument("--model", default="llama-3-8b", choices=sorted(MODELS), help="model shape for the cost model")
    p.add_argument("--ttl", default="72h", help="namespace TTL on the trace's clock (default 72h)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="replay only the first N requests")
    p.add_argument("--opt-ties", choices=("deep", "shallow"), default="deep", help="Belady tie-break (shallow reproduces traces/README.md exactly; deep is the prefix-closed optimum)")
    p.add_argument("--admission", default=StoreConfig().admission,
                   help="admission rule of the last tier (all, reuse, learned; eviction/admission.py; default: the store's default, %(default)s)")
    p.add_argument("--admission-option", action="append", default=[], metavar="KEY=VALUE", help="an option of the admission rule's Config")
    p.add_argument("--json", action="store_true", help="one JSON object per (policy, capacity) on stdout")
    p.add_argument("--plot", metavar="FILE.svg", help="write hit rate against capacity, one line per policy")
    p.add_argument("--events", metavar="DIR", help="write each replay's store event log under DIR/<policy>-<capacity> (for python -m kvstore.report)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)")
    return p


class Extras(Protocol):
    """More figures beside each capacity's rows, from the same replays (``tools/lab/replay/cli.py``:
    class bounds, tier economics)."""

    def bounds(self, trace: Trace, capacity_blocks: int) -> dict[str, float]:
        """More yardsticks for every row at this capacity (``<name>_block_hit_rate``)."""
        ...

    def after(self, trace: Trace, spec: str, tiers: list[TierCapacity], runs: dict[str, Any],
              replay: Any, args: argparse.Namespace, block_bytes: int) -> None:
        """Called once this capacity's rows are out; ``replay(policy, ...)`` replays again."""
        ...


class _Progress:
    """A one-line bar on stderr, redrawn about a hundred times per replay; only on a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.label, self.total, self.step = "", 1, 1

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.step = label, max(total, 1), max(total // 100, 1)

    def __call__(self, i: int) -> None:
        if self.enabled and (i % self.step == 0 or i + 1 == self.total):
            done = (i + 1) / self.total
            bar = "#" * int(30 * done)
            sys.stderr.write(f"\r{self.label:<28} [{bar:<30}] {100 * done:5.1f}%")
            if i + 1 == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--policy-option {pair!r}: write KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def _policy_options(name: str, given: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The options ``name``'s Config accepts: the trace's block size and the model are passed
    to a policy that has those fields, and ``given`` is validated now (exit 2, not mid-run)."""
    cls = policy_class(name)
    fields = getattr(cls.Config, "__dataclass_fields__", {})
    opts = {k: v for k, v in (("block_tokens", args.block_tokens), ("model", args.model)) if k in fields}
    opts.update({k: v for k, v in given.items() if k in fields})
    build_config(cls.Config, opts, f"policy {name!r}")
    return opts


def _row(
    trace: Trace, spec: str, tiers: list[TierCapacity], policy: str, run: Any, metrics: dict[str, float],
    bounds: dict[str, float],
) -> dict[str, Any]:
    lru, opt = bounds["lru_block_hit_rate"], bounds["opt_block_hit_rate"]
    gap = opt - lru
    return {
        "trace": trace.name,
        "requests": trace.num_requests,
        "blocks": trace.num_blocks,
        "unique_blocks": trace.unique_blocks,
        "policy": policy,
        "capacity": spec,
        "capacity_blocks": sum(t.blocks for t in tiers),
        "tiers": {t.name: t.blocks for t in tiers},
        **{k: round(v, 6) for k, v in metrics.items()},
        **{k: round(v, 6) for k, v in bounds.items()},
        "gap_closed": round((metrics["block_hit_rate"] - lru) / gap, 4) if gap > 1e-9 else None,
        "hits_by_tier": run.stats.get("hits_by_tier", {}),
        "evictions": run.stats.get("evictions", 0),
        "seconds": round(run.seconds, 3),
        "cpu_seconds": round(run.cpu_seconds, 3),
    }


def run(args: argparse.Namespace, extras: Extras | None = None) -> int:
    if args.block_tokens <= 0:
        raise UsageError(f"--block-tokens must be positive, got {args.block_tokens}")
    if args.limit is not None and args.limit <= 0:
        raise UsageError(f"--limit must be positive, got {args.limit}")
    trace = load_trace(args.trace, args.limit)
    cost = CostModel.for_model(args.model, args.block_tokens)
    ttl = parse_duration(args.ttl, "--ttl")
    specs = args.capacity or (["1%", "5%", "10%", "25%"] if args.sweep else ["5%"])
    names = args.policy or [StoreConfig().policy]
    if "all" in names:
        names = sorted(POLICIES)
    given = _options(args.policy_option)
    options = {name: _policy_options(name, given, args) for name in names}
    capacities = [(spec, parse_tiers(spec, trace.unique_blocks, cost.block_bytes)) for spec in specs]
    progress = _Progress(not args.no_progress)
    plot: dict[str, list[tuple[float, float]]] = {}
    started = time.perf_counter()
    for spec, tiers in capacities:
        total = sum(t.blocks for t in tiers)
        share = total / trace.unique_blocks

        def replay(name: str, tiers: list[TierCapacity] = tiers, spec: str = spec, admission: str = args.admission,
                   admission_options: dict[str, Any] | None = None) -> Any:
            progress.start(f"{name} @ {spec}", trace.num_requests)
            events = Path(args.events) / f"{name}-{spec.replace('%', 'pct').replace(',', '+')}" if args.events else None
            return replay_store(
                trace, tiers, name, block_tokens=args.block_tokens,
                policy_options=options.get(name, {}), ttl_s=ttl, progress=progress, events_dir=events,
                admission=admission,
                admission_options=_options(args.admission_option) if admission_options is None else admission_options,
            )

        lru = replay("lru") if "lru" not in names else None
        runs = {name: replay(name) for name in names}
        lru = lru or runs["lru"]
        n = max(trace.num_blocks, 1)
        bounds = {
            "lru_block_hit_rate": summarize(trace, lru.hits, args.block_tokens, cost)["block_hit_rate"],
            "opt_block_hit_rate": float(belady(trace, total, args.opt_ties).sum() / n),
            "infinite_block_hit_rate": float(unlimited(trace).sum() / n),
        }
        if extras is not None:
            bounds.update(extras.bounds(trace, total))
        for name, r in runs.items():
            metrics = summarize(trace, r.hits, args.block_tokens, cost)
            row = _row(trace, spec, tiers, name, r, metrics, bounds)
            _emit(row, args.json)
            plot.setdefault(name, []).append((share, metrics["block_hit_rate"]))
        if extras is not None:
            extras.after(trace, spec, tiers, runs, replay, args, cost.block_bytes)
        yardsticks = [("opt_block_hit_rate", "~OPT"), ("infinite_block_hit_rate", "~unlimited")]
        if "lru" not in names:
            yardsticks.append(("lru_block_hit_rate", "lru"))
        for key, label in yardsticks:
            plot.setdefault(label, []).append((share, bounds[key]))
    if args.plot:
        write_svg(args.plot, f"{trace.name}: block hit rate", plot)
    if not args.json:
        print(f"total {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


def _emit(row: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
        return
    gap = row["gap_closed"]
    print(
        f"{row['trace']:<14} {row['capacity']:>10} {row['policy']:<9} block hit {row['block_hit_rate']:.3f}"
        f"  (LRU {row['lru_block_hit_rate']:.3f}, OPT {row['opt_block_hit_rate']:.3f}, unlimited "
        f"{row['infinite_block_hit_rate']:.3f}; gap closed {'-' if gap is None else f'{100 * gap:.0f}%'})"
        f"  token hit {row['token_hit_rate']:.3f}  compute saved {row['compute_saved_fraction']:.3f}"
        f"  {row['seconds']:.1f} s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    return run_cli(parser().parse_args(argv))


def run_cli(args: argparse.Namespace, extras: Extras | None = None) -> int:
    """:func:`run` with the exit codes of the module docstring."""
    try:
        return run(args, extras)
    except (TraceError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KVStoreError as e:
        print(f"replay failed: {e}", file=sys.stderr)
        return 1
