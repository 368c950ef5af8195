"""Hit rate against capacity, one line per policy, as a dependency-free SVG file."""

from __future__ import annotations

from html import escape
from pathlib import Path

_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
_W, _H, _L, _R, _T, _B = 640, 400, 60, 150, 30, 50


def write_svg(path: str | Path, title: str, series: dict[str, list[tuple[float, float]]]) -> None:
    """``series``: name -> [(capacity share of unique blocks, block hit rate)], drawn in order;
    names starting with ``"~"`` (bounds) are dashed, the ``~`` dropped from the legend."""
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    x_max = max(xs, default=1.0) or 1.0
    y_max = max(max(ys, default=1.0) * 1.1, 0.05)
    pw, ph = _W - _L - _R, _H - _T - _B

    def px(x: float) -> float:
        return _L + pw * x / x_max

    def py(y: float) -> float:
        return _T + ph * (1 - y / y_max)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" font-family="sans-serif" font-size="12">',
        f'<rect width="{_W}" height="{_H}" fill="white"/>',
        f'<text x="{_L}" y="18" font-size="14">{escape(title)}</text>',
        f'<line x1="{_L}" y1="{_T + ph}" x2="{_L + pw}" y2="{_T + ph}" stroke="black"/>',
        f'<line x1="{_L}" y1="{_T}" x2="{_L}" y2="{_T + ph}" stroke="black"/>',
        f'<text x="{_L + pw / 2}" y="{_H - 10}" text-anchor="middle">capacity (% of unique blocks)</text>',
        f'<text x="15" y="{_T + ph / 2}" transform="rotate(-90 15 {_T + ph / 2})" text-anchor="middle">block hit rate</text>',
    ]
    for i in range(6):
        x, y = x_max * i / 5, y_max * i / 5
        out.append(f'<text x="{px(x):.1f}" y="{_T + ph + 16}" text-anchor="middle">{100 * x:.0f}</text>')
        out.append(f'<text x="{_L - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
        out.append(f'<line x1="{_L}" y1="{py(y):.1f}" x2="{_L + pw}" y2="{py(y):.1f}" stroke="#eee"/>')
    for i, (name, pts) in enumerate(series.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        dashed = name.startswith("~")
        label = name.removeprefix("~")
        pts = sorted(pts)
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>')
        ly = _T + 16 * i + 8
        out.append(f'<line x1="{_L + pw + 12}" y1="{ly}" x2="{_L + pw + 32}" y2="{ly}" stroke="{colour}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{_L + pw + 38}" y="{ly + 4}">{escape(label)}</text>')
    out.append("</svg>")
    Path(path).write_text("\n".join(out) + "\n")
