"""Reward plots: one fan-out (:func:`reward_figure`) and a whole fork tree (:func:`tree_figure`).

Both return a :class:`SmolFigure`: a plotly figure displayed through plotly's own MIME type
(interactive in JupyterLab, Notebook 7 and VS Code; the figure travels inside the output, so a
saved notebook redraws it without a kernel) plus a static SVG copy for nbconvert and GitHub.
Not a ``FigureWidget``: a widget needs a live comm and a view that measures itself when it
renders, and on "Run All" JupyterLab renders outputs of cells scrolled out of view into
detached nodes, which plotly drew as empty plots. ``widget=True`` still gives a FigureWidget.

Colours work on light and dark themes: transparent backgrounds, and the font family starts
with "smolbench" so the widgets' stylesheet can give the text the theme's colour.
"""

from __future__ import annotations

import html
import json
import random
from typing import Any

from ..gate import figures, frames

STATUS_COLORS = {
    "ok": "#1a7f37",
    "error": "#cf222e",
    "timeout": "#bf8700",
    "cancelled": "#818b98",
    "running": "#0969da",
    "starting": "#54aeff",
    "idle": "#8250df",
}
BEST_COLOR = "#d4a72c"
FONT = "smolbench, 'Open Sans', verdana, arial, sans-serif"  # the marker tree.css looks for
GRID = "rgba(128,128,128,0.28)"
THEME = {
    "template": "plotly_white",
    "paper_bgcolor": "rgba(0,0,0,0)",
    "plot_bgcolor": "rgba(0,0,0,0)",
    "font": {"family": FONT, "color": "#6e7781"},
    "legend": {"bgcolor": "rgba(0,0,0,0)"},
}
MIME = "application/vnd.plotly.v1+json"


def _themed(fig: Any) -> None:
    fig.update_layout(**THEME)
    fig.update_xaxes(gridcolor=GRID, zerolinecolor=GRID, linecolor=GRID)
    fig.update_yaxes(gridcolor=GRID, zerolinecolor=GRID, linecolor=GRID)


def _figure_class() -> Any:
    import plotly.graph_objects as go

    class SmolFigure(go.Figure):
        """A plotly figure shown as plotly JSON plus a static SVG (see the module docstring)."""

        def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, **kw: Any) -> Any:
            spec = json.loads(self.to_json())
            spec["config"] = {"displaylogo": False, "responsive": True, "typesetMath": False}  # text holds machine data
            data = {MIME: spec, "text/plain": self._smol_text}
            svg = getattr(self, "_smol_svg", None)
            if svg is not None:
                try:
                    data["image/svg+xml"] = svg()
                except Exception:  # a broken static copy must not hide the plot
                    pass
            return data

        def _ipython_display_(self) -> None:  # plotly's own would pick its renderers instead
            from IPython.display import display

            display(self._repr_mimebundle_(), raw=True)

    return SmolFigure


def _metrics_text(metrics: Any) -> str:
    if not metrics:
        return ""
    if isinstance(metrics, str):
        try:
            metrics = frames.loads(metrics)
        except ValueError:
            return _short(metrics)
    if not isinstance(metrics, dict):
        return _short(metrics)
    return "<br>".join(f"{_short(k)}: {_short(v)}" for k, v in list(metrics.items())[:12])


def _short(v: Any) -> str:
    """A value for hover text, cut short and HTML-escaped (metrics and errors come from machines)."""
    if isinstance(v, float):
        return f"{v:.6g}"
    text = str(v)
    return html.escape(text if len(text) <= 60 else text[:57] + "…")


def as_widget(fig: Any, widget: bool | None = None, svg: Any = None, text: str = "") -> Any:
    """``fig`` as a :class:`SmolFigure` (``svg()`` its static copy), or a ``FigureWidget``
    when asked with ``widget=True`` and widgets work here; either way through the gate's
    figure check first: its titles and hover text hold machine text (a branch's error, its
    metrics' names), which plotly draws as its own markup, ``style`` and links included."""
    import plotly.graph_objects as go

    spec = figures.figure(json.loads(fig.to_json()))
    fig = go.Figure({k: v for k, v in spec.items() if k != "config"})
    if widget:
        try:
            return go.FigureWidget(fig)
        except Exception:  # no ipywidgets / anywidget, or no comm to the frontend
            pass
    out = _figure_class()(fig)
    out._smol_svg = svg
    out._smol_text = text or "smolbench plot"
    return out


def reward_figure(result: Any, *, widget: bool | None = None, title: str | None = None) -> Any:
    """Rewards of one fork or batch of episodes: per branch (sorted, coloured by status) and
    against the seed. Hover shows the branch, its seed, status, wall time and metrics."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = list(result.rows.values())
    best = result.best
    scored = sorted((r for r in rows if r["reward"] is not None), key=lambda r: -float(r["reward"]))
    unscored = [r for r in rows if r["reward"] is None]
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.6, 0.4],
        horizontal_spacing=0.1,
        subplot_titles=("reward per branch (best first)", "reward vs seed"),
    )

    def hover(r: dict[str, Any]) -> str:
        wall = "" if r.get("wall") is None else f"<br>wall: {r['wall']:.3f} s"
        extra = _metrics_text(r.get("metrics"))
        err = f"<br>error: {_short(r['error'])}" if r.get("error") else ""
        reward = "—" if r["reward"] is None else _short(float(r["reward"]))
        return (
            f"<b>{r['branch']}</b><br>seed: {r['seed']}<br>status: {r['status']}"
            f"<br>reward: {reward}"
            f"{wall}{err}" + (f"<br>{extra}" if extra else "")
        )

    ordered = scored + unscored
    fig.add_trace(
        go.Bar(
            x=[r["branch"] for r in ordered],
            y=[float(r["reward"]) if r["reward"] is not None else 0.0 for r in ordered],
            marker_color=[STATUS_COLORS.get(r["status"], "#818b98") for r in ordered],
            marker_line_color=[
                BEST_COLOR
                if best is not None and r["branch"] == best["branch"]
                else "rgba(0,0,0,0)"
                for r in ordered
            ],
            marker_line_width=2,
            text=[r["status"] if r["reward"] is None else "" for r in ordered],
            textposition="outside",
            hovertext=[hover(r) for r in ordered],
            hoverinfo="text",
            name="reward",
            showlegend=False,
        ),
        row=1,
        col=1,
    )
    by_status: dict[str, list[dict[str, Any]]] = {}
    for r in scored:
        by_status.setdefault(r["status"], []).append(r)
    for status, group in sorted(by_status.items()):
        fig.add_trace(
            go.Scatter(
                x=[r["seed"] for r in group],
                y=[float(r["reward"]) for r in group],
                mode="markers",
                marker={"color": STATUS_COLORS.get(status, "#818b98"), "size": 8},
                hovertext=[hover(r) for r in group],
                hoverinfo="text",
                name=status,
            ),
            row=1,
            col=2,
        )
    if best is not None:
        fig.add_trace(
            go.Scatter(
                x=[best["seed"]],
                y=[float(best["reward"])],
                mode="markers",
                name="best",
                marker={
                    "color": "rgba(0,0,0,0)",
                    "size": 15,
                    "line": {"color": BEST_COLOR, "width": 2.5},
                },
                hovertext=[hover(best)],
                hoverinfo="text",
            ),
            row=1,
            col=2,
        )
    fig.update_xaxes(title_text="branch", type="category", row=1, col=1)
    fig.update_xaxes(title_text="seed", row=1, col=2)
    fig.update_yaxes(title_text="reward", row=1, col=1)
    _themed(fig)
    heading = title or result.summary(reasons=False)  # an error is the machine's text: in hover, escaped
    fig.update_layout(
        title=title or html.escape(heading),
        height=380,
        bargap=0.15,
        margin={"l": 50, "r": 20, "t": 70, "b": 50},
        legend={"title": {"text": "status"}},
    )

    def svg() -> str:
        from .svgplot import bars_and_scatter

        bars = [
            (str(r["branch"]), float(r["reward"]) if r["reward"] is not None else 0.0,
             STATUS_COLORS.get(r["status"], "#818b98"), best is not None and r["branch"] == best["branch"])
            for r in ordered
        ]
        points = [
            (float(r["seed"]), float(r["reward"]), STATUS_COLORS.get(r["status"], "#818b98"))
            for r in scored
            if isinstance(r["seed"], (int, float))
        ]
        mark = (float(best["seed"]), float(best["reward"])) if best is not None and best["seed"] is not None else None
        return bars_and_scatter(bars, points, mark, heading)

    return as_widget(fig, widget, svg, f"reward plots: {heading}")


def tree_figure(workbench: Any, *, widget: bool | None = None, title: str | None = None) -> Any:
    """Rewards across a whole (nested) fork tree: every node by its depth, parent-to-child
    edges, and the path to the best node highlighted."""
    import plotly.graph_objects as go

    nodes = list(workbench.tree.nodes.values())
    best_path = workbench.tree.best_path()
    rng = random.Random(0)  # the same jitter every time
    pos: dict[str, tuple[float, float]] = {}
    for n in nodes:
        if n.reward is not None:
            pos[n.id] = (n.depth + rng.uniform(-0.18, 0.18), float(n.reward))
    fig = go.Figure()
    ex: list[float | None] = []
    ey: list[float | None] = []
    for n in nodes:
        if n.parent in pos and n.id in pos:
            (x0, y0), (x1, y1) = pos[n.parent], pos[n.id]
            ex += [x0, x1, None]
            ey += [y0, y1, None]
    if ex:
        fig.add_trace(
            go.Scatter(
                x=ex,
                y=ey,
                mode="lines",
                line={"color": "rgba(130,130,130,0.35)", "width": 1},
                hoverinfo="skip",
                name="fork",
                showlegend=False,
            )
        )
    by_status: dict[str, list[Any]] = {}
    for n in nodes:
        if n.id in pos:
            by_status.setdefault(n.status, []).append(n)
    for status, group in sorted(by_status.items()):
        fig.add_trace(
            go.Scatter(
                x=[pos[n.id][0] for n in group],
                y=[pos[n.id][1] for n in group],
                mode="markers",
                marker={
                    "color": STATUS_COLORS.get(status, "#818b98"),
                    "size": 8,
                    "symbol": ["circle" if n.alive else "circle-open" for n in group],
                },
                hovertext=[_node_hover(n) for n in group],
                hoverinfo="text",
                name=status,
            )
        )
    path = [i for i in best_path if i in pos]
    if path:
        fig.add_trace(
            go.Scatter(
                x=[pos[i][0] for i in path],
                y=[pos[i][1] for i in path],
                mode="lines+markers",
                name="best path",
                line={"color": BEST_COLOR, "width": 2.5},
                marker={"size": 11, "color": BEST_COLOR},
                hovertext=[_node_hover(workbench.tree[i]) for i in path],
                hoverinfo="text",
            )
        )
    depths = sorted({n.depth for n in nodes}) or [0]
    scored = sum(1 for n in nodes if n.reward is not None)
    fig.update_xaxes(
        title_text="depth (0 = root)", tickvals=depths, range=[min(depths) - 0.5, max(depths) + 0.5]
    )
    fig.update_yaxes(title_text="reward")
    _themed(fig)
    heading = title or f"reward by depth · {scored} of {len(nodes)} nodes rewarded"
    fig.update_layout(
        title=heading,
        height=420,
        margin={"l": 50, "r": 20, "t": 60, "b": 50},
        legend={"title": {"text": "status"}},
    )

    def svg() -> str:
        from .svgplot import depth_scatter

        points = [(pos[n.id][0], pos[n.id][1], STATUS_COLORS.get(n.status, "#818b98"), bool(n.alive))
                  for n in nodes if n.id in pos]
        edges = [(*pos[n.parent], *pos[n.id]) for n in nodes if n.parent in pos and n.id in pos]
        return depth_scatter(points, edges, [pos[i] for i in path], heading)

    return as_widget(fig, widget, svg, f"reward plot: {heading}")


def _node_hover(n: Any) -> str:
    wall = "" if n.wall is None else f"<br>wall: {n.wall:.3f} s"
    extra = _metrics_text(n.metrics)
    return (
        f"<b>{n.id}</b><br>seed: {n.seed}<br>status: {n.status}<br>reward: {_short(n.reward)}{wall}"
        + ("<br>alive" if n.alive else "")
        + (f"<br>{extra}" if extra else "")
    )
