"""Output for people: tables, sizes, durations, and a progress line on stderr (only on a TTY)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def size(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def duration(s: float | None) -> str:
    """``4d 3h``, ``2h 5m``, ``42s``; ``-`` for None; negative durations get a minus sign."""
    if s is None:
        return "-"
    sign, s = ("-" if s < 0 else ""), abs(float(s))
    d, rem = divmod(int(s), 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    if d:
        return f"{sign}{d}d {h}h"
    if h:
        return f"{sign}{h}h {m}m"
    if m:
        return f"{sign}{m}m {sec}s"
    return f"{sign}{s:.0f}s" if s >= 1 else f"{sign}{s * 1000:.0f}ms"


def when(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], out: TextIO | None = None,
          right: Sequence[int] = ()) -> None:
    """A plain aligned table; columns in ``right`` are right-aligned (numbers)."""
    out = out or sys.stdout
    cells = [[str(h) for h in headers], *[["-" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()

    print(fmt(cells[0]), file=out)
    print("  ".join("-" * w for w in widths).rstrip(), file=out)
    for r in cells[1:]:
        print(fmt(r), file=out)


class Progress:
    """``progress(what, count)`` for long scans: one updating line on stderr, only when stderr is
    a terminal (never in pipes, logs or tests), at most ten updates a second."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = 0.0
        self._shown = False

    def __call__(self, what: str, count: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and count:
            return
        self._last = now
        self.stream.write(f"\r\x1b[K{what}: {count:,}")
        self.stream.flush()
        self._shown = True

    def done(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False
