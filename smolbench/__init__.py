"""smolbench: a Jupyter workbench for RL environments in disposable, forkable machines.

In a notebook::

    %load_ext smolbench
    %smol up
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from .errors import CompositeError, RemoteError, SmolbenchError  # noqa: E402
from .ledger import Ledger  # noqa: E402

__all__ = ["CompositeError", "Ledger", "RemoteError", "SmolbenchError", "__version__", "load_ipython_extension"]

_magics: Any = None


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
