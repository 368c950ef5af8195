"""kvreport: what the cache was worth, from its event log, as a self-contained HTML page.

    kvreport /var/lib/kvstore/events -o report.html      # a daemon's log (live or not)
    kvreport replay-log/ --json                          # a replayed trace's log; numbers only
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from kvstore.errors import UsageError
from kvstore.eventread import read_events
from kvstore.report.analyze import ReportConfig, analyze
from kvstore.report.html import gpu_time, render
from kvstore.units import parse_duration
from kvstore.version import version

EXIT_CODES = """exit codes:
  0  ok
  1  error: a log file could not be read
  2  usage: bad arguments
  4  not found: no event log there, or no requests in the chosen time range"""


def _time(text: str) -> float:
    """Epoch seconds, or an ISO date/time (UTC unless it says otherwise)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither epoch seconds nor an ISO date like 2025-01-31T12:00") from None
    return (dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)).timestamp()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvreport",
        description="Report what a kvstore cache was worth from its event log (a daemon's "
        "<data dir>/events, an in-process store's [events] dir, or a replayed trace's log): hit "
        "rate over time by tier and tenant, achieved vs an unlimited cache with the lost hits "
        "by reason, the age of hits and what each hour of TTL buys, GPU time and money saved, "
        "and DeepSeek-style usage per tenant. One self-contained HTML file (inline SVG, no "
        "script, no network); --json prints the same numbers.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("logs", nargs="*", type=Path, default=[Path("kvstore-data/events")],
                   help="event log directories or files (default ./kvstore-data/events)")
    p.add_argument("-o", "--output", type=Path, help="HTML file to write (default kvreport.html; with --json only if given)")
    p.add_argument("--json", action="store_true", help="print the report's numbers as JSON on stdout")
    p.add_argument("--since", type=_time, help="from this time (epoch seconds or ISO date)")
    p.add_argument("--until", type=_time, help="up to this time (epoch seconds or ISO date)")
    p.add_argument("--last", help="only the last DURATION of the log (e.g. 24h, 7d)")
    p.add_argument("--prefill-tps", type=float, default=25_000.0,
                   help="prefill tokens/s one GPU computes (default 25000: Llama-3-8B-like on an H200)")
    p.add_argument("--gpu-price", type=float, default=3.0, help="price of one GPU-hour (default 3.0)")
    p.add_argument("--currency", default="$", help="currency symbol (default $)")
    p.add_argument("--title", default="kvstore cache report")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        cfg = ReportConfig(prefill_tps=args.prefill_tps, gpu_price=args.gpu_price, currency=args.currency)
    except ValueError as e:
        p.error(str(e))
    for path in args.logs:
        if not path.exists():
            print(f"kvreport: no event log at {path}; pass the events directory (a daemon keeps it in "
                  "<data dir>/events; an in-process store needs [events] enabled = true)", file=sys.stderr)
            return 4
    since = args.since
    try:
        if args.last:
            last = parse_duration(args.last, "--last")
            end = max((r["t"] for r in read_events(args.logs, types=("request",))), default=0.0)
            since = max(since or 0.0, end - last)
        report = analyze(read_events(args.logs, since=since, until=args.until), cfg)
    except UsageError as e:
        p.error(str(e))
    except ValueError as e:  # no requests in range
        print(f"kvreport: {e}", file=sys.stderr)
        return 4
    except OSError as e:
        print(f"kvreport: cannot read the log: {e}", file=sys.stderr)
        return 1
    sources = [str(x) for x in args.logs]
    if args.json:
        print(json.dumps(report, indent=1))
    out = args.output or (None if args.json else Path("kvreport.html"))
    if out is not None:
        out.write_text(render(report, args.title, sources))
        if not args.json:
            lk = report["lookups"]
            looked = (f"{lk['requests']:,} lookups, token hit rate {100 * lk['token_hit_rate']:.1f}%"
                      if lk["requests"] else "no lookups")
            print(f"kvreport: wrote {out}: {report['requests']:,} loads, token hit rate "
                  f"{100 * report['token_hit_rate']:.1f}% (unlimited cache {100 * report['ideal']['token_hit_rate']:.1f}%), "
                  f"{looked}, "
                  f"{gpu_time(report['savings']['gpu_seconds'])} saved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
