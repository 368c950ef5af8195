"""What the replay's analysis tools (``python -m tools.lab.replay.holdout``, ``.continuation``,
``.ordersearch``) share on their command line: a parser with ``--version`` and the trace, and
exit code 2 with a one-line message for a user's mistake (a bad trace or capacity)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kvstore.errors import ConfigError
from kvstore.version import version
from tools.replay.trace import TraceError


def parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """A tool's parser, with ``--version`` and the positional ``trace``; ``description`` may be
    a module docstring, whose second paragraph (the first after its title line) is used."""
    if description and "\n\n" in description:
        description = description.split("\n\n")[1].replace("\n", " ")
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("trace", help="Mooncake-format JSONL trace file (.jsonl, or .jsonl.gz read compressed)")
    return p


def run(body: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``body(args)``, or 2 after ``error: ...`` on stderr for a bad trace or configuration."""
    try:
        return body(args)
    except (TraceError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
