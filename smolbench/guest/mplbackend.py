"""The machine's matplotlib backend (``module://_smolbench_guest.mplbackend``), as Jupyter's
inline one: Agg drawing, and ``plt.show()`` displays the open figures in the notebook and
closes them (``figures.py``).

Imported by matplotlib only, once a cell's code imported pyplot (never by the agent itself).
"""

from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from . import figures

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def show(*args, **kwargs):
    """``plt.show()``: the open figures displayed, then closed."""
    figures.show(close=True)
