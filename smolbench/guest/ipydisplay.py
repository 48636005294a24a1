"""IPython's ``display`` in a machine: the agent's own, as in a Jupyter kernel.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``). A cell's
``from IPython.display import display, HTML`` replaced the machine's ``display`` with
IPython's, which with no IPython shell only prints ``<IPython.core.display.HTML object>``.
The agent never imports IPython itself: once a cell's code does, its ``display`` (in
``IPython.core.display_functions``, or ``IPython.core.display`` before IPython 7.23) is
replaced, before anything can import it by name, with one that shows through the agent.
"""

import sys

from .output import mime_bundle, raw_bundle

HOMES = ("IPython.core.display_functions", "IPython.core.display")

_agent = None


def watch(agent):
    """At start-up: IPython's display, once a cell imports it, is the agent's."""
    global _agent
    _agent = agent
    from . import imports

    for name in HOMES:
        imports.after(name, _patch)
        if name in sys.modules:  # (imported before the agent started: not by a cell)
            _patch(sys.modules[name])


def _patch(module):
    own = getattr(module, "display", None)
    if own is None or getattr(own, "__module__", None) not in HOMES:
        return  # not IPython's own (ours already, or a re-export)
    display.__doc__ = own.__doc__
    module.display = display


def display(*objs, include=None, exclude=None, metadata=None, transient=None, display_id=None, raw=False,
            clear=False, **kwargs):
    """IPython's ``display(*objs)``, shown in the notebook through the machine's agent (``raw``:
    each object is a MIME bundle already). ``display_id``, ``transient`` and ``clear`` are not
    kept: each call is a new output."""
    if _agent is None:
        return None
    for obj in objs:
        if raw:
            data = raw_bundle(obj)
            if data is None:
                continue
        else:
            data = mime_bundle(obj)
        if include:
            data = {k: v for k, v in data.items() if k in include or k == "text/plain"}
        if exclude:
            data = {k: v for k, v in data.items() if k not in exclude or k == "text/plain"}
        _agent.outbox.flush()  # text printed before the display shows before it
        _agent.send({"t": "display", "data": data})
    return None
