"""The ``smolbench_guest`` module that cells import inside the machine.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``).
"""

import types

from .output import mime_bundle


class GuestAPI(types.ModuleType):
    """The ``smolbench_guest`` module that cells can import inside the machine."""

    def __init__(self, agent):
        super().__init__("smolbench_guest", "Talk to smolbench from inside a machine.")
        self._agent = agent

    def report(self, reward=None, **metrics):
        """Record this branch's reward and any extra metrics (numbers or short strings)."""
        if reward is not None:
            self._agent.reported["reward"] = reward
        self._agent.reported.setdefault("metrics", {}).update(metrics)

    def display(self, *objs):
        """Show objects in the notebook, like IPython's display()."""
        for obj in objs:
            self._agent.outbox.flush()  # text printed before the display shows before it
            self._agent.send({"t": "display", "data": mime_bundle(obj)})

    def pip(self, *args):
        """Run ``python -m pip ARGS`` in this machine (installs go to its own folder on sys.path)."""
        from . import pipsite

        return pipsite.run(args)

    @property
    def node(self):
        """This machine's node id in the fork tree (e.g. ``root.3``)."""
        return self._agent.name

    @property
    def seed(self):
        """This branch's seed, or None on a machine that was never seeded."""
        return self._agent.seed

