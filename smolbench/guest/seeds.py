"""Seeding a machine: ``SEED``, random, numpy and torch (if imported), SMOLBENCH_SEED.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``).
"""

import os
import sys


class Seeds:
    """The agent's seeding (a part of ``serving.Agent``)."""

    def apply_seed(self, seed, name=None):
        """Seed this machine: ``SEED``, random, numpy (if imported), SMOLBENCH_SEED."""
        if name and name != self.name:  # a new node (a branch, a restore): a `reward` it holds is not its own
            self.name = name
            self.inherited_reward = (self.ns["reward"],) if "reward" in self.ns else None
        self.seed = seed
        self.ns["SEED"] = seed
        if seed is None:
            return
        import random  # not on the ready path: a machine without a seed never needs it

        os.environ["SMOLBENCH_SEED"] = str(seed)
        random.seed(seed)
        np = sys.modules.get("numpy")
        if np is not None:
            try:
                np.random.seed(seed % (2**32))
            except Exception:
                pass
        torch = sys.modules.get("torch")
        if torch is not None:
            try:
                torch.manual_seed(seed)
            except Exception:
                pass
