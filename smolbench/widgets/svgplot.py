"""Small static SVG charts: the saved-notebook copy of smolbench's plots (no browser, no kaleido).

nbconvert, GitHub and any viewer without plotly's renderer show these; every label is
escaped (branch names and metrics can come from a machine).
"""

from __future__ import annotations

import html
import math
from typing import Any

W, H = 900, 360
TEXT = "#1f2328"
GRID = "#d1d9e0"


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0]
    if hi <= lo:
        hi = lo + 1.0
    half = hi * 0.5 - lo * 0.5  # finite for any finite ends (hi - lo overflows past 1.8e308)
    if half < 1e-300:  # ends a subnormal apart (0 and 5e-324): no step between them
        return [lo, hi]
    raw = half / n * 2
    step = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * step:
            step *= m
            break
    start = math.floor(lo / step) * step
    if not math.isfinite(start):  # a step of 1e308 below -1.7e308
        start = lo
    out: list[float] = []
    v = start
    while math.isfinite(v) and v <= hi + step * 0.5 and len(out) < 12:
        out.append(round(v, 10))
        v += step
    return out


CHAR_W = 6.5  # width of one tick-label character at font-size 11 (DejaVu Sans digits)


def _fmt(v: float) -> str:
    return f"{v:.4g}"


class Panel:
    """One plot area inside the SVG: axes, grid and marks in data coordinates."""

    def __init__(self, x: float, y: float, w: float, h: float, title: str) -> None:
        self.x, self.y, self.w, self.h, self.title = x, y, w, h, title
        self.parts: list[str] = []

    def frame(self, xlo: float, xhi: float, ylo: float, yhi: float, xlabel: str, ylabel: str,
              xticks: bool = True, below: float = 0.0) -> None:
        """Axes, grid and titles; ``below``: how far labels drawn under the axis reach down, so
        the x title goes under them."""
        yt = _ticks(ylo, yhi)
        self.ylo, self.yhi = min(ylo, yt[0]), max(yhi, yt[-1])
        pad = (xhi * 0.5 - xlo * 0.5) * 0.1 or 0.5
        self.xlo, self.xhi = xlo - pad, xhi + pad
        p = self.parts
        p.append(f'<text x="{self.x + self.w / 2:.1f}" y="{self.y - 8:.1f}" text-anchor="middle" '
                 f'font-size="13">{_e(self.title)}</text>')
        for v in yt:
            yy = self.py(v)
            p.append(f'<line x1="{self.x:.1f}" x2="{self.x + self.w:.1f}" y1="{yy:.1f}" y2="{yy:.1f}" '
                     f'stroke="{GRID}"/>')
            p.append(f'<text x="{self.x - 6:.1f}" y="{yy + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
        if xticks:
            for v in _ticks(xlo, xhi):
                if self.xlo <= v <= self.xhi:
                    xx = self.px(v)
                    p.append(f'<text x="{xx:.1f}" y="{self.y + self.h + 14:.1f}" text-anchor="middle">'
                             f'{_fmt(v)}</text>')
        p.append(f'<text x="{self.x + self.w / 2:.1f}" y="{self.y + self.h + max(32.0, below + 14):.1f}" '
                 f'text-anchor="middle">{_e(xlabel)}</text>')
        # the y title clears the widest tick label (about 6.5 px a character at 11 px)
        tick_w = max((len(_fmt(v)) for v in yt), default=1) * CHAR_W
        p.append(f'<text transform="translate({self.x - 6 - tick_w - 8:.1f},{self.y + self.h / 2:.1f}) rotate(-90)" '
                 f'text-anchor="middle">{_e(ylabel)}</text>')

    def px(self, v: float) -> float:
        return self.x + _share(v, self.xlo, self.xhi) * self.w

    def py(self, v: float) -> float:
        return self.y + self.h - _share(v, self.ylo, self.yhi) * self.h


def _share(v: float, lo: float, hi: float) -> float:
    """Where ``v`` is between ``lo`` and ``hi`` (0 to 1), in halves so that no difference of
    two finite floats overflows (rewards of -1.7e308 and 1.7e308 made every mark NaN)."""
    return (v * 0.5 - lo * 0.5) / ((hi * 0.5 - lo * 0.5) or 1)


def _svg(parts: list[str], title: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        f'font-family="DejaVu Sans, Verdana, sans-serif" font-size="11" fill="{TEXT}">'
        f'<rect width="{W}" height="{H}" fill="#ffffff"/>'
        f'<text x="12" y="20" font-size="14" font-weight="bold">{_e(title)}</text>'
        + "".join(parts) + "</svg>"
    )


def bars_and_scatter(
    bars: list[tuple[str, float, str, bool]],
    points: list[tuple[float, float, str]],
    best_point: tuple[float, float] | None,
    title: str,
) -> str:
    """Left: one bar per (label, value, colour, is_best); right: (x, y, colour) points."""
    left = Panel(70, 60, 470, 230, "reward per branch (best first)")
    right = Panel(610, 60, 270, 230, "reward vs seed")
    values = [b[1] for b in bars] or [0.0]
    # branch labels hang under the bars at 45 degrees (9 px font: about 5.3 px a character)
    longest = max((len(b[0]) for b in bars), default=0) if len(bars) <= 24 else 0
    left.frame(0, max(len(bars) - 1, 1), min(0.0, *values), max(0.0, *values), "branch", "reward",
               xticks=False, below=8 + longest * 5.3 * 0.71 + 9)
    bw = left.w / max(len(bars), 1) * 0.8
    for i, (label, value, color, best) in enumerate(bars):
        cx = left.x + (i + 0.5) * left.w / max(len(bars), 1)
        y0, y1 = left.py(0.0), left.py(value)
        stroke = ' stroke="#bf8700" stroke-width="2.5"' if best else ""
        left.parts.append(f'<rect x="{cx - bw / 2:.1f}" y="{min(y0, y1):.1f}" width="{bw:.1f}" '
                          f'height="{abs(y1 - y0):.1f}" fill="{color}"{stroke}><title>{_e(label)}: '
                          f'{_fmt(value)}</title></rect>')
        if len(bars) <= 24:
            left.parts.append(f'<text transform="translate({cx:.1f},{left.y + left.h + 8:.1f}) rotate(45)" '
                              f'font-size="9">{_e(label)}</text>')
    xs = [p[0] for p in points] or [0.0]
    ys = [p[1] for p in points] or [0.0]
    right.frame(min(xs), max(xs), min(ys), max(ys), "seed", "reward")
    for x, y, color in points:
        right.parts.append(f'<circle cx="{right.px(x):.1f}" cy="{right.py(y):.1f}" r="4" fill="{color}"/>')
    if best_point is not None:
        right.parts.append(f'<circle cx="{right.px(best_point[0]):.1f}" cy="{right.py(best_point[1]):.1f}" '
                           'r="7.5" fill="none" stroke="#bf8700" stroke-width="2.5"/>')
    return _svg(left.parts + right.parts, title)


def depth_scatter(
    points: list[tuple[float, float, str, bool]],
    edges: list[tuple[float, float, float, float]],
    path: list[tuple[float, float]],
    title: str,
) -> str:
    """Rewards by depth: (x, y, colour, alive) points, parent-child edges, the best path."""
    panel = Panel(70, 50, 800, 250, "")
    xs = [p[0] for p in points] or [0.0]
    ys = [p[1] for p in points] or [0.0]
    panel.frame(min(xs), max(xs), min(ys), max(ys), "depth (0 = root)", "reward")
    for x0, y0, x1, y1 in edges:
        panel.parts.append(f'<line x1="{panel.px(x0):.1f}" y1="{panel.py(y0):.1f}" x2="{panel.px(x1):.1f}" '
                           f'y2="{panel.py(y1):.1f}" stroke="#8c959f" stroke-opacity="0.5"/>')
    for x, y, color, alive in points:
        fill = color if alive else "none"
        panel.parts.append(f'<circle cx="{panel.px(x):.1f}" cy="{panel.py(y):.1f}" r="4" fill="{fill}" '
                           f'stroke="{color}" stroke-width="1.5"/>')
    if len(path) > 1:
        pts = " ".join(f"{panel.px(x):.1f},{panel.py(y):.1f}" for x, y in path)
        panel.parts.append(f'<polyline points="{pts}" fill="none" stroke="#bf8700" stroke-width="2.5"/>')
    return _svg(panel.parts, title)
