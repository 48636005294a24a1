"""smolbench: a Jupyter workbench for RL environments in disposable, forkable machines.

In a notebook::

    %load_ext smolbench
    %smol up

In a script (the same machines, no IPython)::

    with smolbench.Session() as s:
        s.fork(8, "reward = SEED % 3")
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from ._session import RunResult, Session  # noqa: E402
from .errors import CompositeError, RemoteError, SmolbenchError  # noqa: E402
from .ledger import Ledger  # noqa: E402
from .result import ForkResult  # noqa: E402

__all__ = ["CompositeError", "ForkResult", "Ledger", "RemoteError", "RunResult", "Session", "SmolbenchError",
           "__version__", "load_ipython_extension", "session"]

_magics: Any = None


def session() -> Session:
    """The live Session: in a notebook the one ``%smol up`` made, in a script the last one
    started. A one-line SmolbenchError when none is up."""
    from ._session import current

    return current()


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where the prebuilt JupyterLab extension lives (``jupyter labextension develop``)."""
    return [{"src": "labextension", "dest": "smolbench"}]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext smolbench``: register the ``%smol`` / ``%%smol`` magics."""
    global _magics
    from .magics import SmolMagics

    _magics = SmolMagics(ipython)
    ipython.register_magics(_magics)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext smolbench``: delete every machine this kernel created."""
    if _magics is not None:
        _magics.shutdown()
