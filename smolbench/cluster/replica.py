"""A warm parent on another node: its recorded path replayed there, checked by a state fingerprint.

The path is what the ledger recorded: the Smolfile's init commands, then each machine's
cells from the root down (a branch's seed applied where it was forked). The fingerprint
hashes the names, types and reprs of a namespace's public variables (memory addresses
blanked; not ``random``'s state nor ``SEED``, which every branch sets anew); parent and replica must agree,
or the replica is not used and its branches run on the parent's node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import SmolbenchError

FINGERPRINT_CODE = r"""
def _smolbench_fingerprint():
    import hashlib, re, types
    h = hashlib.sha256()
    g = globals()
    for k in sorted(g):
        if k.startswith('_') or k in ('In', 'Out', 'exit', 'quit', 'get_ipython', 'SEED'):
            continue
        v = g[k]
        if isinstance(v, (types.ModuleType, types.FunctionType, type)):
            r = type(v).__name__ + ':' + getattr(v, '__name__', '')
        else:
            try:
                r = repr(v)[:65536]
            except Exception:
                r = type(v).__name__
        h.update(k.encode() + b'=' + re.sub(r'0x[0-9a-fA-F]+', '0x', r).encode('utf-8', 'replace') + b';')
    return h.hexdigest()[:16]
_smolbench_fingerprint()
"""


@dataclass
class Recipe:
    """How to rebuild a machine's state from scratch: ``steps`` of ("cell", code, seed) or ("seed", seed)."""

    node: str
    key: tuple[str, int]  # (node, cells run): a replica is good while the parent's key is unchanged
    steps: list[tuple[Any, ...]] = field(default_factory=list)
    pushed: list[str] = field(default_factory=list)  # nodes whose cells used --push (values not recorded)

    @property
    def code_bytes(self) -> int:
        """What the replay ships to the node: the recorded cells' code."""
        return sum(len(str(s[1]).encode()) for s in self.steps if s[0] == "cell")


def recipe(wb: Any, node_id: str) -> Recipe:
    """The recorded path of ``node_id`` in workbench ``wb`` (its tree, ledger and Smolfile)."""
    from ..workbench import _init_code

    path = wb.tree.path(node_id)
    root = path[0]
    # a restored root (r1-NAME) has no recorded path; a root that was only checkpointed still has one
    if not (root.id == "root" or root.id.startswith(("fresh", "ep"))):
        raise SmolbenchError(f"{node_id} starts from {root.id}, which has no recorded path (a restored checkpoint): "
                             "it can only be forked on its own node")
    out = Recipe(node_id, (node_id, wb.tree[node_id].cells))
    out.steps = [("cell", _init_code(cmd), None) for cmd in wb.spec.init]
    for i, step in enumerate(path):
        if i > 0:
            out.steps.append(("seed", step.seed))
        cells = wb.ledger.cells(wb.session, step.id)
        upto = path[i + 1].forked_at if i + 1 < len(path) else step.cells
        for c in cells[:upto]:
            if c.get("pushed"):  # the ledger's list of names the user pushed
                out.pushed.append(step.id)
            out.steps.append(("cell", c["code"], c["seed"] if step.parent is None else None))
    return out
