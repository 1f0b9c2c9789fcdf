"""A line plot as SVG text: the benchmarks' figures without a plotting library (none is a dependency).

SVG renders in any browser and on GitHub, and diffs as text. A path ending in ``.png`` writes the SVG beside it
and rasterises it with ``rsvg-convert`` (librsvg, ``apt-get install librsvg2-bin``), where a PNG is asked for.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
from pathlib import Path
from xml.sax.saxutils import escape

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 720, 440, 70, 170, 40, 50


@dataclasses.dataclass(frozen=True)
class Series:
    label: str
    xs: list[float]
    ys: list[float]
    color: str
    dashed: bool = False


def _ticks(low: float, high: float, count: int = 6) -> list[float]:
    span = (high - low) or 1.0
    step = 10 ** math.floor(math.log10(span / count))
    for factor in (1, 2, 5, 10):
        if span / (step * factor) <= count:
            step *= factor
            break
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def line_plot(series: list[Series], path: str | Path, title: str, xlabel: str, ylabel: str) -> None:
    """Write ``series`` (solid or dashed lines with points) to ``path`` as an SVG file (and a PNG, for a ``.png``
    path: see the module's docstring); y starts at 0."""
    xs = [x for s in series for x in s.xs]
    ys = [y for s in series for y in s.ys]
    x0, x1, y0, y1 = min(xs), max(xs), 0.0, max(ys) * 1.05
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / ((x1 - x0) or 1.0) * plot_w

    def py(y: float) -> float:
        return TOP + plot_h - (y - y0) / ((y1 - y0) or 1.0) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" stroke="black"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="black"/>',
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">{escape(xlabel)}</text>',
        f'<text x="16" y="{TOP + plot_h / 2}" text-anchor="middle" transform="rotate(-90 16 {TOP + plot_h / 2})">{escape(ylabel)}</text>',
    ]
    for t in _ticks(x0, x1):
        out.append(
            f'<line x1="{px(t):.1f}" y1="{TOP + plot_h}" x2="{px(t):.1f}" y2="{TOP + plot_h + 5}" stroke="black"/>'
        )
        out.append(f'<text x="{px(t):.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">{t:,.0f}</text>')
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{LEFT}" y1="{py(t):.1f}" x2="{LEFT + plot_w}" y2="{py(t):.1f}" stroke="#e0e0e0"/>')
        out.append(f'<text x="{LEFT - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{t:,.0f}</text>')
    for i, s in enumerate(series):
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(s.xs, s.ys))
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        out.append(f'<polyline points="{points}" fill="none" stroke="{s.color}" stroke-width="2"{dash}/>')
        if not s.dashed:
            out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{s.color}"/>' for x, y in zip(s.xs, s.ys)]
        ly = TOP + 10 + i * 20
        out.append(
            f'<line x1="{WIDTH - RIGHT + 12}" y1="{ly}" x2="{WIDTH - RIGHT + 36}" y2="{ly}" stroke="{s.color}" stroke-width="2"{dash}/>'
        )
        out.append(f'<text x="{WIDTH - RIGHT + 42}" y="{ly + 4}">{escape(s.label)}</text>')
    out.append("</svg>")
    target = Path(path)
    svg = target.with_suffix(".svg")
    svg.write_text("\n".join(out) + "\n")
    if target.suffix.lower() == ".png":
        to_png(svg, target)


def to_png(svg: Path, png: Path) -> None:
    """Rasterise ``svg`` to ``png`` with ``rsvg-convert``; a clear error where it is not installed."""
    tool = shutil.which("rsvg-convert")
    if tool is None:
        raise SystemExit(f"{png}: a PNG needs rsvg-convert (apt-get install librsvg2-bin); {svg} is written")
    subprocess.run([tool, "--format", "png", "--background-color", "white", "-o", str(png), str(svg)], check=True)
