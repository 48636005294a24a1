"""IPython's ``display`` and ``clear_output`` in a machine: the agent's own, as in a Jupyter kernel.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``). A cell's
``from IPython.display import display, HTML`` replaced the machine's ``display`` with
IPython's, which with no IPython shell only prints ``<IPython.core.display.HTML object>``.
The agent never imports IPython itself: once a cell's code does, its ``display`` and
``clear_output`` (in ``IPython.core.display_functions``, or ``IPython.core.display`` before
IPython 7.23) are replaced, before anything can import them by name, with ones that show
through the agent. ``update_display`` and ``DisplayHandle`` call the module's ``display``,
so they come along: a display made with ``display_id`` can be updated in place, as a live
plot redrawn with ``clear_output(wait=True)`` can. The ids are the machine's words: the
host gives each one an id of its own (``smolbench.gate``), so they never name the host's.
"""

import sys
import uuid

from .output import mime_bundle, raw_bundle

HOMES = ("IPython.core.display_functions", "IPython.core.display")

_agent = None
_handles = {}  # type: dict  # the module whose DisplayHandle a display with an id returns


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
    clear = getattr(module, "clear_output", None)
    if clear is not None and getattr(clear, "__module__", None) in HOMES:
        clear_output.__doc__ = clear.__doc__
        module.clear_output = clear_output
    if getattr(module, "DisplayHandle", None) is not None:
        _handles["module"] = module


def display(*objs, include=None, exclude=None, metadata=None, transient=None, display_id=None, raw=False,
            clear=False, **kwargs):
    """IPython's ``display(*objs)``, shown in the notebook through the machine's agent (``raw``:
    each object is a MIME bundle already). ``display_id`` (True: a new one) returns a
    ``DisplayHandle`` whose ``update`` redraws it in place; ``clear``: the cell's output is
    cleared first, as ``clear_output(wait=True)`` does. ``transient`` is not kept."""
    if _agent is None:
        return None
    update = bool(kwargs.get("update"))
    if display_id is True:
        display_id = uuid.uuid4().hex
    if update and not display_id:
        raise TypeError("display_id required for update_display")
    if not objs and display_id:  # an empty output to update later, as IPython makes
        objs, raw = ({},), True
    if clear:
        clear_output(wait=True)
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
        msg = {"t": "display", "data": data}
        if display_id:
            msg["id"] = str(display_id)
            if update:
                msg["update"] = True
        _agent.outbox.flush()  # text printed before the display shows before it
        _agent.send(msg)
    if display_id and not update and "module" in _handles:
        return _handles["module"].DisplayHandle(display_id)
    return None


def clear_output(wait=False):
    """Clear the cell's output (``wait``: when the next output comes, so a redrawn plot doesn't flicker)."""
    if _agent is None:
        return
    _agent.outbox.flush()
    _agent.send({"t": "clear", "wait": bool(wait)})
