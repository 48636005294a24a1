"""Matplotlib figures shown as Jupyter's inline backend shows them: PNG.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``). Nothing here imports
matplotlib: it is looked at only once the cell's own code imported it (``sys.modules``).

- a Figure's MIME bundle has ``image/png`` (``png``: savefig to bytes, ``bbox_inches="tight"``),
  so a Figure as a cell's last value, or ``display(fig)``, shows the plot, not its repr;
- ``matplotlib.pyplot`` gets this agent's own backend (``mplbackend.py``) when it is first
  imported and no backend was chosen (or the kernel's inline one came with the environment):
  ``plt.show()`` displays the open figures and closes them;
- figures still open when a cell ends are displayed and closed (``flush``), but the cell's own
  value (shown as its result) and those the cell displayed already.
"""

import io
import sys

BACKEND = "module://%s.mplbackend" % __name__.rpartition(".")[0]
# backends we replace: none chosen yet, or a Jupyter kernel's inline one (the process backend
# inherits the kernel's MPLBACKEND), which would print the figure's repr here
REPLACE = ("module://matplotlib_inline.backend_inline", "inline")

_agent = None
_shown = set()  # type: set[int]  # ids of the figures this cell displayed already


def watch(agent):
    """At start-up: pyplot, when a cell imports it, gets this agent's backend."""
    global _agent
    _agent = agent
    from . import imports

    imports.after("matplotlib.pyplot", _choose_backend, before=True)


def _choose_backend(_module=None):
    mpl = sys.modules.get("matplotlib")
    if mpl is None:
        return
    try:
        from matplotlib import rcsetup

        chosen = dict.__getitem__(mpl.rcParams, "backend")
        if chosen is getattr(rcsetup, "_auto_backend_sentinel", None) or chosen in REPLACE:
            mpl.rcParams["backend"] = BACKEND
    except Exception:  # an old or odd matplotlib: its own backend stays
        pass


def _figure_class():
    mod = sys.modules.get("matplotlib.figure")
    return getattr(mod, "Figure", None) if mod is not None else None


def is_figure(value):
    cls = _figure_class()
    return cls is not None and isinstance(value, cls)


def png(fig):
    """A Figure as PNG bytes, as IPython's inline backend makes them; None for an empty one."""
    if not fig.axes and not fig.lines:
        return None
    buf = io.BytesIO()
    fig.canvas.print_figure(buf, format="png", bbox_inches="tight", dpi=fig.dpi,
                            facecolor=fig.get_facecolor(), edgecolor=fig.get_edgecolor())
    if "matplotlib.pyplot" in sys.modules:
        _shown.add(id(fig))
    return buf.getvalue()


def show(close=True):
    """``plt.show()``: every open figure displayed, then closed."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None or _agent is None:
        return
    try:
        figs = [plt.figure(n) for n in plt.get_fignums()]
    except Exception:
        return
    try:
        for fig in figs:
            if fig.axes or fig.lines:
                _agent.guest.display(fig)
    finally:
        if close:
            plt.close("all")


def flush(value=None):
    """A cell ended: its open figures displayed (not ``value``, its result, nor one it displayed
    already) and closed; only where the cell's code imported pyplot."""
    plt = sys.modules.get("matplotlib.pyplot")
    try:
        if plt is None or _agent is None or not plt.get_fignums():
            return
        for n in plt.get_fignums():
            fig = plt.figure(n)
            if fig is value or id(fig) in _shown or not (fig.axes or fig.lines):
                continue
            _agent.guest.display(fig)
        plt.close("all")
    finally:
        _shown.clear()
