"""Small inline-SVG charts for a self-contained HTML report (no library, no script, no network).

Each function returns one ``<svg class="plot">`` element with a ``<title>``, axes with their
titles and units, a legend and the data drawn as paths, dots or rectangles. Colours are given by
the caller (one per tier, one per tenant, the same in every chart: :class:`Colors`). A None value
is a gap (a bucket with no data), never a zero; a point with no neighbour is drawn as a dot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from html import escape

PALETTE = ("#2563eb", "#16a34a", "#f59e0b", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#65a30d", "#9ca3af")
W, H = 760, 300
CHAR_W = 6.2  # width of an average character of the 11 px axis font, for laying out labels
L, R, T, B = 64, 16, 46, 46  # margins; the legend has its own row under the title

Fmt = Callable[[float], str]


class Colors:
    """One colour per name, kept for the whole report: ``colors("dram")`` is the same in every
    chart. Names met first take the palette in order."""

    def __init__(self, names: Sequence[str] = (), palette: Sequence[str] = PALETTE) -> None:
        self._palette = tuple(palette)
        self._of: dict[str, str] = {}
        for n in names:
            self(n)

    def __call__(self, name: str) -> str:
        if name not in self._of:
            self._of[name] = self._palette[len(self._of) % len(self._palette)]
        return self._of[name]


def band(vals: Sequence[float], lo: float = 0.0, hi: float = 1.0) -> tuple[float, float]:
    """A y range that shows where ``vals`` lie (a 92-97% hit rate is not drawn on 0-100%),
    widened to whole ticks and kept within ``lo``..``hi``."""
    if not vals:
        return lo, hi
    a, b = min(vals), max(vals)
    pad = max((b - a) * 0.15, (hi - lo) * 0.02)
    a, b = max(lo, a - pad), min(hi, b + pad)
    ticks = _ticks(a, b)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else (hi - lo) / 5
    return max(lo, math.floor(a / step + 1e-9) * step), min(hi, math.ceil(b / step - 1e-9) * step)


def pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def num(v: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.1f}{unit}".replace(".0" + unit, unit)
    return f"{v:.0f}" if v == int(v) else f"{v:.2f}"


def duration(seconds: float) -> str:
    for unit, div in (("day", 86400), ("h", 3600), ("min", 60)):
        if seconds >= div and seconds % div == 0:
            n = int(seconds // div)
            return f"{n} {unit}" + ("s" if unit == "day" and n > 1 else "")
    return f"{seconds:g} s"


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _time_ticks(t0: float, t1: float) -> list[tuple[float, str]]:
    span = max(t1 - t0, 1.0)
    steps = ((1, "%H:%M:%S"), (10, "%H:%M:%S"), (60, "%H:%M"), (600, "%H:%M"), (3600, "%H:%M"),
             (6 * 3600, "%d %H:%M"), (86400, "%b %d"), (7 * 86400, "%b %d"))
    step, fmt = next((s for s in steps if span / s[0] <= 8), steps[-1])
    first = math.ceil(t0 / step) * step
    return [(t, datetime.fromtimestamp(t, UTC).strftime(fmt)) for t in _frange(first, t1, step)]


def _frange(a: float, b: float, step: float) -> list[float]:
    return [a + i * step for i in range(int((b - a) / step) + 1)]


class _Frame:
    def __init__(self, title: str, x0: float, x1: float, y0: float, y1: float) -> None:
        self.x0, self.x1 = x0, (x1 if x1 > x0 else x0 + 1)
        self.y0, self.y1 = y0, (y1 if y1 > y0 else y0 + 1)
        self.parts = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" '
                      f'width="{W}" height="{H}" role="img" aria-label="{escape(title)}">',
                      f"<title>{escape(title)}</title>",
                      f'<text x="{L}" y="20" class="t">{escape(title)}</text>']

    def x(self, v: float) -> float:
        return L + (v - self.x0) / (self.x1 - self.x0) * (W - L - R)

    def y(self, v: float) -> float:
        return H - B - (v - self.y0) / (self.y1 - self.y0) * (H - T - B)

    def axes(self, yfmt: Fmt, xticks: Sequence[tuple[float, str]], xlabel: str = "", ylabel: str = "") -> None:
        p = self.parts
        for v in _ticks(self.y0, self.y1):
            if v <= self.y1 + 1e-9:
                yy = self.y(v)
                p.append(f'<line x1="{L}" x2="{W - R}" y1="{yy:.1f}" y2="{yy:.1f}" class="g"/>')
                p.append(f'<text x="{L - 6}" y="{yy + 4:.1f}" class="a" text-anchor="end">{escape(yfmt(v))}</text>')
        for v, label in xticks:
            xx = self.x(v)
            p.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{H - B}" y2="{H - B + 4}" class="ax"/>')
            p.append(f'<text x="{xx:.1f}" y="{H - B + 17}" class="a" text-anchor="middle">{escape(label)}</text>')
        p.append(f'<line x1="{L}" x2="{W - R}" y1="{H - B}" y2="{H - B}" class="ax"/>')
        p.append(f'<line x1="{L}" x2="{L}" y1="{T}" y2="{H - B}" class="ax"/>')
        if xlabel:
            p.append(f'<text x="{(L + W - R) / 2}" y="{H - 8}" class="a" text-anchor="middle">{escape(xlabel)}</text>')
        if ylabel:
            cy = (T + H - B) / 2
            p.append(f'<text x="14" y="{cy:.1f}" class="a" text-anchor="middle" '
                     f'transform="rotate(-90 14 {cy:.1f})">{escape(ylabel)}</text>')

    def legend(self, names: Sequence[str], colors: Sequence[str], *, lines: bool = False,
               dashed: Sequence[str] = ()) -> None:
        """One swatch per series: a box (areas, bars) or, with ``lines``, a short stroke drawn as
        the series is (dashed where it is), so that two series of one colour stay apart."""
        x = W - R
        for name, color in reversed(list(zip(names, colors, strict=True))):
            x -= 22 + 7 * len(name) + 12
            if lines:
                dash = ' stroke-dasharray="5 3"' if name in dashed else ""
                swatch = (f'<line x1="{x}" x2="{x + 18}" y1="31" y2="31" stroke="{color}" stroke-width="2"{dash} '
                          f'class="swatch" data-name="{escape(name)}"/>')
            else:
                swatch = (f'<rect x="{x + 4}" y="26" width="10" height="10" fill="{color}" class="swatch" '
                          f'data-name="{escape(name)}"/>')
            self.parts.append(swatch + f'<text x="{x + 22}" y="35" class="a">{escape(name)}</text>')

    def svg(self) -> str:
        return "".join(self.parts) + "</svg>"


def _xticks(xs: Sequence[float], time_axis: bool) -> list[tuple[float, str]]:
    if time_axis:
        return _time_ticks(xs[0], xs[-1])
    return [(v, num(v)) for v in _ticks(xs[0], xs[-1], 8)]


TIME_LABEL = "time (UTC)"


def _runs(xs: Sequence[float], ys: Sequence[float | None]) -> list[list[tuple[float, float]]]:
    """The runs of consecutive points that have a value (a None splits them)."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, v in zip(xs, ys, strict=True):
        if v is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((x, float(v)))
    return [r for r in runs if r]


def line_chart(title: str, xs: Sequence[float], series: Sequence[tuple[str, Sequence[float | None]]], *,
               yfmt: Fmt = pct, ymax: float | None = None, yrange: tuple[float, float] | None = None,
               time_axis: bool = True, xlabel: str = "", ylabel: str = "",
               colors: Sequence[str] | None = None, dashed: Sequence[str] = (),
               marks: Sequence[tuple[float, str]] = ()) -> str:
    """Lines over ``xs`` (epoch seconds when ``time_axis``); None leaves a gap, and a point
    with no neighbour is a dot. ``yrange``: the y axis (default 0 to ``ymax`` or the data's top);
    ``dashed``: names of series drawn dashed (a reference line beside measured ones)."""
    vals = [v for _, ys in series for v in ys if v is not None]
    y0, y1 = yrange if yrange is not None else (0.0, ymax if ymax is not None else max(vals, default=1.0) * 1.1 or 1.0)
    f = _Frame(title, xs[0], xs[-1], y0, y1)
    f.axes(yfmt, _xticks(xs, time_axis), xlabel or (TIME_LABEL if time_axis else ""), ylabel)
    colors = list(colors) if colors is not None else [PALETTE[i % len(PALETTE)] for i in range(len(series))]
    for (name, ys), color in zip(series, colors, strict=True):
        runs = _runs(xs, ys)
        d = " ".join("M" + " L".join(f"{f.x(x):.1f},{f.y(v):.1f}" for x, v in run) for run in runs if len(run) > 1)
        dash = ' stroke-dasharray="5 3"' if name in dashed else ""
        if d:
            f.parts.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="2"{dash} class="series"/>')
        for run in runs:
            if len(run) == 1:  # no neighbour to draw a line to: a dot
                (x, v), = run
                f.parts.append(f'<circle cx="{f.x(x):.1f}" cy="{f.y(v):.1f}" r="3" fill="{color}" class="series"/>')
    for x, label in marks:
        xx = f.x(x)
        f.parts.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{T}" y2="{H - B}" class="m"/>'
                       f'<text x="{xx + 3:.1f}" y="{T + 10}" class="a">{escape(label)}</text>')
    f.legend([n for n, _ in series], colors, lines=True, dashed=dashed)
    return f.svg()


def stacked_area(title: str, xs: Sequence[float], series: Sequence[tuple[str, Sequence[float]]], *,
                 yfmt: Fmt = num, time_axis: bool = True, ylabel: str = "",
                 colors: Sequence[str] | None = None) -> str:
    """Areas stacked bottom-up in the order given (e.g. hit tokens by tier, fastest first)."""
    acc = [0.0] * len(xs)
    layers = []
    for _, ys in series:
        lower = acc[:]
        acc = [a + float(v) for a, v in zip(acc, ys, strict=True)]
        layers.append((lower, acc[:]))
    f = _Frame(title, xs[0], xs[-1], 0.0, max(acc, default=1.0) * 1.1 or 1.0)
    f.axes(yfmt, _xticks(xs, time_axis), TIME_LABEL if time_axis else "", ylabel)
    colors = list(colors) if colors is not None else [PALETTE[i % len(PALETTE)] for i in range(len(series))]
    if len(xs) == 1:  # one bucket: a bar, so that the area is visible
        xs = [xs[0] - 0.5, xs[0] + 0.5]
        f.x0, f.x1 = xs[0], xs[1]
        layers = [([lo[0]] * 2, [hi[0]] * 2) for lo, hi in layers]
    for (lower, upper), color in zip(layers, colors, strict=True):
        pts = [f"{f.x(x):.1f},{f.y(v):.1f}" for x, v in zip(xs, upper, strict=True)]
        pts += [f"{f.x(x):.1f},{f.y(v):.1f}" for x, v in reversed(list(zip(xs, lower, strict=True)))]
        f.parts.append(f'<path d="M{" L".join(pts)} Z" fill="{color}" fill-opacity="0.85" stroke="none" class="series"/>')
    f.legend([n for n, _ in series], colors)
    return f.svg()


def bar_chart(title: str, bars: Sequence[tuple[str, float, str | None]], *, fmt: Fmt = num,
              total: float | None = None) -> str:
    """Horizontal bars, one per (label, value, color); ``total`` adds each bar's share."""
    rows = len(bars)
    height = T + 24 * rows + 20
    top = max((v for _, v, _ in bars), default=1.0) or 1.0
    # The labels end at the bars: room for the longest (11 px text, CHAR_W per character).
    left = min(max(120, 24 + int(CHAR_W * max((len(b[0]) for b in bars), default=0))), W - 300)
    right = W - 150
    parts = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {height}" width="{W}" '
             f'height="{height}" role="img" aria-label="{escape(title)}"><title>{escape(title)}</title>',
             f'<text x="16" y="20" class="t">{escape(title)}</text>']
    for i, (label, v, color) in enumerate(bars):
        y = T + 24 * i
        w = (right - left) * v / top
        share = f" ({100 * v / total:.1f}%)" if total else ""
        parts.append(f'<text x="{left - 8}" y="{y + 14}" class="a" text-anchor="end">{escape(label)}</text>'
                     f'<rect x="{left}" y="{y}" width="{max(w, 1):.1f}" height="18" fill="{color or PALETTE[i % len(PALETTE)]}" class="series"/>'
                     f'<text x="{left + w + 6:.1f}" y="{y + 14}" class="a">{escape(fmt(v) + share)}</text>')
    return "".join(parts) + "</svg>"
