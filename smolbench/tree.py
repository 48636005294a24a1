"""The fork tree as pure data: nodes with ids like ``root.7.2``."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

TERMINAL = ("ok", "error", "timeout", "cancelled", "lost")  # lost: its machine was killed or its kernel died
STATUSES = ("starting", "running", "idle", *TERMINAL)
RENDER_INDENT = 64  # levels of a tree's text drawn indented (Tree.render); deeper ones start "… "
# Ended episodes kept in memory, the newest: a training loop of `Session.episodes` ends millions
# (~0.8 KiB a node). Older ones leave the tree (`%smol tree`, the plots), not the ledger.
KEPT_ENDED = 10_000


@dataclass
class Node:
    """One machine's place in the exploration tree and what it produced."""

    id: str
    parent: str | None = None
    seed: int | None = None
    status: str = "starting"  # one of STATUSES
    alive: bool = True  # its machine still exists
    kept: bool = False  # kept alive after its fork finished
    reward: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    started: float | None = None
    ended: float | None = None
    run_id: str | None = None
    checkpoint: str | None = None
    error: str | None = None
    output: str = ""
    cells: int = 0  # cells run on this machine (including the fork cell)
    forked_at: int = 0  # parent's cell count when this node was forked
    where: str | None = None  # the Ray node its machine runs on (cluster backend), else None
    where_kind: str | None = None  # that node's backend (sandbox, process, smol)
    where_host: str | None = None  # that node's host name
    moved_from: str | None = None  # the Ray node it was lost with, before it was rebuilt on ``where``

    @property
    def wall(self) -> float | None:
        """Seconds the node's cell ran, once it finished."""
        if self.started is None or self.ended is None:
            return None
        return self.ended - self.started

    @property
    def depth(self) -> int:
        """0 for a root, 1 for its branches, and so on."""
        return self.id.count(".")


class Tree:
    """All nodes of one kernel session, by id."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self._issued: dict[str, int] = {}  # per node: the next child number, never given out before
        self._ended: collections.deque[str] = collections.deque()  # episodes' ended nodes, oldest first

    def __contains__(self, node_id: object) -> bool:
        return node_id in self.nodes

    def __getitem__(self, node_id: str) -> Node:
        return self.nodes[node_id]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, node: Node) -> Node:
        """Insert a node (its parent, if any, must exist)."""
        if node.parent is not None and node.parent not in self.nodes:
            raise KeyError(node.parent)
        self.nodes[node.id] = node
        if node.parent is not None and node.id.startswith(node.parent + "."):
            k = node.id[len(node.parent) + 1:]
            if k.isascii() and k.isdigit():
                self._issued[node.parent] = max(self._issued.get(node.parent, 0), int(k) + 1)
        return node

    def let_go_ended(self, node_ids: Iterable[str], keep: int | None = None) -> None:
        """Episodes' nodes that ended: kept until ``keep`` (:data:`KEPT_ENDED`) newer ones did."""
        self._ended.extend(node_ids)
        keep = KEPT_ENDED if keep is None else keep
        while len(self._ended) > keep:
            self.forget(self._ended.popleft())

    def forget(self, node_id: str) -> bool:
        """Let an ended leaf go from memory (its ledger row stays): a long training run's
        episodes would otherwise grow the kernel without bound. False if it can't go (it
        runs, or children were given ids under it)."""
        node = self.nodes.get(node_id)
        if node is None or node.status in ("running", "starting", "idle") or node_id in self._issued:
            return False
        del self.nodes[node_id]
        return True

    def children(self, node_id: str) -> list[Node]:
        """Direct children, in creation order."""
        return [n for n in self.nodes.values() if n.parent == node_id]

    def next_child_ids(self, node_id: str, count: int) -> list[str]:
        """Ids for ``count`` new children of ``node_id``, given out now: never one given before,
        whether its node was added, is still to come (a fork laid out, not run yet) or was
        let go of (:meth:`forget`)."""
        start = self._issued.get(node_id, 0)
        self._issued[node_id] = start + count
        return [f"{node_id}.{i}" for i in range(start, start + count)]

    def path(self, node_id: str) -> list[Node]:
        """Nodes from the root down to ``node_id``."""
        out = []
        cur: str | None = node_id
        while cur is not None:
            node = self.nodes[cur]
            out.append(node)
            cur = node.parent
        return out[::-1]

    def subtree(self, node_id: str) -> list[Node]:
        """``node_id`` and all its descendants, parents before children (depth first, each
        node's children in creation order)."""
        kids = self._kids()
        out = []
        stack = [self.nodes[node_id]]  # not a call per level: a ledger's chain can be 20,000 deep
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(kids.get(node.id, ())))
        return out

    def _kids(self) -> dict[str, list[Node]]:
        """Every node's direct children (:meth:`children`), in creation order, in one pass."""
        kids: dict[str, list[Node]] = {}
        for node in self.nodes.values():
            if node.parent is not None:
                kids.setdefault(node.parent, []).append(node)
        return kids

    def best_path(self) -> list[str]:
        """Ids on the path to the node with the highest reward (empty if none)."""
        scored = [n for n in self.nodes.values() if n.reward is not None and n.status == "ok"]
        if not scored:
            return []
        best = min(scored, key=lambda n: best_key(n.id, n.reward))
        return [n.id for n in self.path(best.id)]

    def render(self, active: str | None = None) -> str:
        """The tree as indented text (what ``%smol tree`` prints). Below RENDER_INDENT levels
        the indent stops growing and a line starts ``… `` (a ledger's chain of 20,000 nodes
        drawn in full was 600 MB of indent)."""
        lines: list[str] = []
        best = set(self.best_path())
        kids = self._kids()
        held = 3 * RENDER_INDENT  # characters of indent drawn
        # depth first, each node's children in creation order; a stack, not a call per level
        stack = [(root, "", True, True) for root in reversed([n for n in self.nodes.values() if n.parent is None])]
        while stack:
            node, prefix, last, top = stack.pop()
            bits = [node.id]
            if node.seed is not None:
                bits.append(f"seed={node.seed}")
            bits.append(node.status)
            if node.reward is not None:
                bits.append(f"reward={node.reward:.4g}")
            if node.alive:
                bits.append("alive")
            if node.where:
                bits.append("@" + where_text(node.where, node.where_kind, node.where_host, node.moved_from))
            if node.checkpoint:
                bits.append(f"checkpoint={node.checkpoint}")
            mark = " *" if node.id in best else ""
            here = " <- active" if node.id == active else ""
            branch = "" if top else ("└─ " if last else "├─ ")
            lines.append(f"{prefix}{branch}{'  '.join(bits)}{mark}{here}")
            children = kids.get(node.id, [])
            ext = "" if top else ("   " if last else "│  ")
            under = prefix + ext
            if len(under) > held:
                under = under[:held] + "… "
            for i in range(len(children) - 1, -1, -1):
                stack.append((children[i], under, i == len(children) - 1, False))
        return "\n".join(lines)


def id_key(node_id: str) -> tuple[tuple[int, int | str], ...]:
    """A node id's natural order: root.2 before root.10, ep3 before ep10."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in node_id.replace("-", ".").split("."))


def best_key(node_id: str, reward: float | None) -> tuple[float, tuple[tuple[int, int | str], ...]]:
    """The one rule for "best" (``min`` of this): the highest reward, and on a tie the branch
    first in natural order. ★best, Replay, ``%smol use best`` and ``--keep best`` all use it;
    the sidebar's tree.ts and the server's run summary follow it too."""
    return (-(reward if reward is not None else float("-inf")), id_key(node_id))


def where_text(where: str | None, kind: str | None = None, host: str | None = None,
               moved_from: str | None = None) -> str:
    """Where a cluster machine runs, short: ``3f2a9c1b (sandbox on host; moved from 0a1b2c3d)``."""
    about = " on ".join(str(x) for x in (kind, host) if x)
    if moved_from:
        about += f"{'; ' if about else ''}moved from {str(moved_from)[:8]}"
    return str(where or "?")[:8] + (f" ({about})" if about else "")


# What `%smol replay` refuses, in one place: Workbench.replay says it, the server's ledger
# API sends it (the sidebar's Replay buttons are disabled with it as their tooltip).
GYM_RUN = "gym"  # the ledger's runs.kind of a smolbench.gym env; its run id is "<session>/gym-<warm parent>"
GYM_EPISODE = "an episode of a smolbench.gym env, whose actions are not recorded"


def gym_episode(metrics: dict[str, Any] | None, run_id: str | None) -> bool:
    """Whether a node (its metrics and run id) is an episode of a smolbench.gym env
    (smolbench/gym/record.py's): replay refuses it, its actions came from the trainer and
    are not recorded (only its seed, return and length)."""
    return "sub_env" in (metrics or {}) and f"/{GYM_RUN}-" in (run_id or "")


def node_replay_refused(metrics: dict[str, Any] | None, run_id: str | None) -> str | None:
    """Why replay refuses this node (:func:`gym_episode`), in one line; None if it doesn't."""
    return f"can't replay: it is {GYM_EPISODE}" if gym_episode(metrics, run_id) else None


def replay_refused(kind: object) -> str | None:
    """Why a run of this kind (the ledger's ``runs.kind``) can't have its best branch
    replayed, in one line; None if it can. A gym run's rewarded branches are all episodes."""
    return f"can't replay: its best branch is {GYM_EPISODE}" if kind == GYM_RUN else None
