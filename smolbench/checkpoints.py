"""Checkpoints and replay: the part of the Workbench that saves, restores and re-runs nodes.

:class:`CheckpointsMixin` is mixed into :class:`smolbench.workbench.Workbench`,
which provides the machines, the fork tree and the ledger it works on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import signing
from ._aio import _made_in_thread, _to_the_end
from ._filehash import sha256_fd
from ._pkgtrust import open_root, untrusted
from ._wbparts import WorkbenchPart
from .backends.base import CellRequest, CellResult, Event, MachineRef
from .errors import LIVE, NOT_UP, MachineLost, SmolbenchError, reworded
from .gate import passes, restoring, terminal
from .gate.ckptpaths import SUFFIX, suggested_name, valid_name
from .shelf import AGENTHOST, IMPORTED, Adopted, Shelf
from .tree import GYM_EPISODE, Node, gym_episode

BranchEvent = Callable[[str, Event], None]


# The sessions of this process's Workbenches: the only ones whose checkpoints the process
# backend (no isolation) restores, whatever a ledger row claims.
SESSIONS_HERE: set[str] = set()


class CheckpointsMixin(WorkbenchPart):
    """``%smol checkpoint save/restore/rm`` and ``%smol replay`` for a Workbench."""

    active: str | None
    checkpoint_dir: Path
    shelf: Shelf
    restore_notes: list[str]  # what the last restore did besides restoring (a file added to this folder)
    baseline: str  # this Workbench's baseline (the spec's), recorded with its saves and compared on restores
    _busy: set[str]

    if TYPE_CHECKING:  # provided by Workbench
        def _release(self, node_id: str) -> None: ...
        def _changed(self, *nodes: Node) -> None: ...
        async def _init(self, ref: MachineRef) -> None: ...
        def _claim(self, node_id: str) -> None: ...
        def _touch(self, node_id: str) -> None: ...
        def _record(self, node: Node, **extra: Any) -> None: ...
        async def _lost(self, node_id: str, why: str) -> SmolbenchError: ...

    # -- replay ---------------------------------------------------------------------------

    async def replay(self, node_id: str, on_event: BranchEvent) -> dict[str, Any]:
        """Rebuild a node's path from its nearest ancestor that is alive or checkpointed, and compare rewards.

        Re-runs the recorded cells with the recorded seeds in temporary
        branches, which are deleted afterwards.
        """
        if node_id not in self.tree:
            raise SmolbenchError(f"unknown node {node_id!r}: see `%smol tree` (replay works on this session's nodes)",
                                 api=f"unknown node {node_id!r}: replay works on this session's nodes "
                                 "(`Session.ledger().nodes()`)")
        target = self.tree[node_id]
        if gym_episode(target.metrics, target.run_id):
            raise SmolbenchError(f"can't replay {node_id}: it is {GYM_EPISODE} (only its seed, return and length)")
        path = self.tree.path(node_id)
        notes: list[str] = []
        risks: list[str] = []  # what could make the replay differ
        temps: list[MachineRef] = []
        # Start from the nearest ancestor that is alive or has a checkpoint.
        start_idx = next((i for i in range(len(path) - 2, -1, -1)
                          if path[i].id in self.machines or path[i].checkpoint), None)
        cur: MachineRef | None = None
        try:
            if start_idx is None:
                if target.parent is None and target.run_id and target.id.startswith("ep"):
                    start_idx = -1  # an episode: a fresh machine from the baseline
                    cur = await self.backend.create(self.spec, f"replay-{node_id}")
                    temps.append(cur)
                    await self._init(cur)
                else:
                    why = f"can't replay {node_id}: no ancestor is alive and none has a checkpoint; keep a branch"
                    raise SmolbenchError(f"{why} (--keep) or checkpoint one (`%smol checkpoint save`) to make replays "
                                         "possible", api=f"{why} (keep='all') or checkpoint one "
                                         "(`Session.checkpoint_save(name, node=node)`) to make replays possible")
            elif path[start_idx].id in self.machines:
                cur = self.machines[path[start_idx].id]
                start = path[start_idx]
                if start.cells > path[start_idx + 1].forked_at:
                    risks.append(f"{start.id} ran {start.cells - path[start_idx + 1].forked_at} more cell(s) after the fork")
            else:
                anc = path[start_idx]
                rec = self.ledger.checkpoint(anc.checkpoint or "")
                if rec is None or self.shelf.store.usable(rec.get("path")) is not None:
                    raise SmolbenchError(f"can't replay {node_id}: the checkpoint {anc.checkpoint!r} of {anc.id} is gone")
                cur = await self._restore_file(rec, f"replay-{anc.id}")
                temps.append(cur)
                notes.append(f"started from checkpoint {anc.checkpoint}")
                if int(rec.get("cells") or 0) != path[start_idx + 1].forked_at:
                    risks.append(f"checkpoint {anc.checkpoint} was saved after {rec.get('cells')} cell(s) of {anc.id}, "
                                 f"the fork after {path[start_idx + 1].forked_at}")
            steps = path[start_idx + 1:]
            res: CellResult | None = None
            for k, step in enumerate(steps):
                if step.parent is None:  # the episode itself, seeded per cell
                    seed_now: int | None = step.seed
                else:
                    kid = (await self.backend.branch(cur, [f"replay{k}-{step.id}"], [step.seed]))[0]
                    temps.append(kid)
                    cur = kid
                    seed_now = None
                cells = self.ledger.cells(self.session, step.id)
                upto = steps[k + 1].forked_at if k + 1 < len(steps) else len(cells)
                for i, c in enumerate(cells[:upto]):
                    if c.get("pushed"):
                        risks.append(f"a cell of {step.id} used --push {c['pushed']}; those values were not recorded")
                    # the branch's first cell reseeded what the fork did (its "reseeded" metric says what)
                    again = i == 0 and bool((step.metrics or {}).get("reseeded"))
                    res = await self.backend.exec_cell(cur, CellRequest(c["code"], seed=seed_now, reseed=again),
                                                       _forward(on_event, step.id))
                    if res.status != "ok":
                        err = res.error or {}
                        said = terminal.one_line(f"{err.get('ename')}: {err.get('evalue')}")  # the machine's words
                        raise SmolbenchError(f"replay of {step.id} failed in a recorded cell: {said}")
            reward = res.reward if res is not None else None
        finally:
            for ref in reversed(temps):
                with contextlib.suppress(Exception):
                    await _to_the_end(self.backend.delete(ref))
        match = reward == target.reward
        # risks: what could make a replay differ; said as a caveat only when it did differ
        if match:
            verdict = "identical" + (f" ({'; '.join(notes + risks)})" if notes or risks else "")
        else:
            why = f"; it may differ because {'; '.join(risks)}" if risks else ""
            verdict = "DIFFERENT" + (f" ({'; '.join(notes)}{why})" if notes else (f" ({why[2:]})" if why else ""))
        msg = f"replay of {node_id}: reward {reward} vs recorded {target.reward}: {verdict}"
        return {"node": node_id, "reward": reward, "recorded": target.reward, "match": match,
                "notes": notes + risks, "message": msg}

    # -- checkpoints ---------------------------------------------------------------------

    async def checkpoint_save(self, name: str | None = None, node_id: str | None = None, force: bool = False) -> dict[str, Any]:
        """Save a live node's whole machine under ``name``."""
        node_id = node_id or self.active
        if node_id is None:
            raise SmolbenchError("no machine is up: run `%smol up` first", api=NOT_UP)
        if node_id not in self.tree:
            self.live(node_id)  # the one line for a node that never was, naming the live ones
        if node_id not in self.machines:
            dead = f"node {node_id!r} is not alive, so it can't be checkpointed: pick a live node"
            raise SmolbenchError(f"{dead} (`%smol tree`)", api=f"{dead} ({LIVE})")
        name = name or f"{node_id}-{time.strftime('%H%M%S')}"
        _check_name(name)
        existing = self.ledger.checkpoint(name)
        if existing is not None and not force:
            raise SmolbenchError(f"a checkpoint named {name!r} exists: pick another name or add --force to replace it",
                                 api=f"a checkpoint named {name!r} exists: pick another name or pass force=True "
                                 "to replace it")
        unsigned = signing.key_or_why()  # made now, or its file's problem said, before anything is saved
        store = self.shelf.store
        try:
            store.ensure()
            store.sweep_parts()
        except (OSError, SmolbenchError) as exc:
            raise SmolbenchError(f"can't create the checkpoint folder {store.directory} ({exc}): check the path and its permissions") from None
        fname = f"{name}{SUFFIX}"
        path = store.absolute(fname)  # absolute: still valid after a chdir
        self._claim(node_id)
        self._touch(node_id)
        try:
            info = await self.backend.checkpoint(self.machines[node_id], path)
        except BaseException as exc:
            if existing is None:  # a failed --force save must not remove the checkpoint it was replacing
                with contextlib.suppress(OSError):
                    os.unlink(path)
            if not isinstance(exc, Exception):
                raise
            why = str(exc) if isinstance(exc, SmolbenchError) else f"{type(exc).__name__}: {exc}"
            api = None
            if isinstance(exc, MachineLost):
                self._busy.discard(node_id)
                lost = await self._lost(node_id, why)
                why, api = lost.for_magics(), lost.api
            kept = "" if existing is None else f"; the old {name!r} is unchanged"
            raise SmolbenchError(f"saving checkpoint {name!r} of {node_id} failed ({why}): nothing was saved{kept}",
                                 api=api and f"saving checkpoint {name!r} of {node_id} failed ({api}): nothing was "
                                 f"saved{kept}") from None
        finally:
            self._release(node_id)
        node = self.tree[node_id]
        if store.usable(fname) is not None and info.backend in AGENTHOST:  # a backend's reply is checked too
            raise SmolbenchError(f"saving checkpoint {name!r} of {node_id} failed ({store.usable(fname)}): nothing was saved")
        if unsigned is not None:
            info.warnings.append(unsigned)
        # signed over its file's SHA-256: hashed on a thread (a microVM's file is GBs)
        await _to_the_end(asyncio.to_thread(self.shelf.add, name, self.session, node_id, fname, info.backend, info.size,
                                            node.cells, info.warnings, baseline=self.baseline,
                                            machine=self.spec.machine()))
        node.checkpoint = name
        self._record(node)
        return {"name": name, "node": node_id, "path": info.path, "size": info.size, "warnings": info.warnings}

    async def checkpoint_restore(self, name: str) -> Node:
        """Create a new machine from a checkpoint and make it active.

        ``name``: a checkpoint of this folder (a ledger row, or a file in its checkpoint
        folder), or the path of a ``.smolcheckpoint`` file anywhere, which is first added to
        this folder (copied in and checked; ``notes`` says so)."""
        self.restore_notes = []
        added: Adopted | None = None
        # adopting copies and checks a file from elsewhere (seconds of gzip for a big one): off the loop
        if self.shelf.names_file(name):
            added = await self._adopt(name)
        else:
            rec = self.shelf.row(name)
            if rec.get("dropped"):
                added = await self._adopt(self.shelf.store.absolute(f"{name}{SUFFIX}"))
        if added is not None:
            rec = added.row
            self.restore_notes.append(added.note)
        typed, name = name, str(rec["name"])
        restored = [n for n in self.tree if n.parent is None and n.id.split("-", 1)[0][1:].isdigit() and n.id[0] == "r"]
        base = f"r{len(restored) + 1}"
        node_id = f"{base}-{name}"
        try:
            # a ledger row says who saved it, but a copied folder's ledger (a file's record) says what its author wrote
            own = rec.get("session_id") in SESSIONS_HERE and self.shelf.signed(rec)
            why = restoring.refusal(name, rec.get("backend"), self.backend.name, own, typed)
            if why is not None:
                raise SmolbenchError(why + ("; nothing was added" if added is not None and added.new_row else ""))
            # a file this restore copied in goes again if it fails: its messages name the file the user gave
            ref = await self._restore_file(rec, node_id, added is not None and added.new_row,
                                           typed if added is not None and added.copied is not None else None)
        except BaseException:
            if added is not None:  # a file that can't make a machine is not kept as one of this folder's
                # on a thread: it waits for the folder, which another kernel may hold a while
                await _to_the_end(asyncio.to_thread(self.shelf.unadopt, added))
                self.restore_notes.clear()
            raise
        self.machines[node_id] = ref
        ref.info["restored_from"] = name  # the node's badge is the checkpoint sync's, which may clear it any time
        node = self.tree.add(Node(node_id, None, status="idle", started=time.time(), checkpoint=name,
                                  cells=int(rec.get("cells") or 0)))
        node.where = ref.info.get("node")  # the cluster node it was restored on (None off a cluster)
        self._record(node)
        self._said_of(rec, node_id, ref)
        self.active = node_id
        return node

    def _said_of(self, rec: dict[str, Any], node_id: str, ref: MachineRef) -> None:
        """What a restore says of where its checkpoint came from: a warning when it claims a
        machine unlike this one in what its variables need (restoring.baseline_notice), one when
        variables were not restored for want of a module (the packages its machine had that this
        one lacks), the warnings its row keeps (each one line, as whose word it is), and, for a
        file from elsewhere (its pickle ran in this machine) or such a claim, a row in the
        ledger's trust table (its source and SHA-256, the claim)."""
        imported = rec.get("session_id") == IMPORTED
        have = list(ref.info.get("restore_warnings", []))  # the restore's own: "not restored: x (…)"
        name, machine = str(rec["name"]), rec.get("machine")
        said = restoring.baseline_notice(name, rec.get("baseline"), self.baseline, imported, machine=machine,
                                         spec=self.spec, failed=any(w.startswith("not restored:") for w in have))
        needs = restoring.modules_notice(name, have, machine, self.spec, said)
        # what it was saved with (a variable that could not be pickled): said once, here, as whose word it is
        kept = restoring.said_on_restore(rec.get("warnings"), imported, have)
        if said is not None or needs is not None or kept:
            ref.info["restore_warnings"] = [*have, *([said] if said else []), *([needs] if needs else []), *kept]
        if imported or said is not None:
            came = f" (sha256 {rec['sha256']}, added from {rec.get('source')})" if rec.get("sha256") and imported else ""
            self.ledger.add_trust(self.session, "restore", f"{node_id}: checkpoint {rec['name']}"
                                  f"{' from a file' if imported else ''}{came}" + (f"; {said}" if said else ""))

    async def _adopt(self, source: str) -> Adopted:
        """``Shelf.adopt`` on a thread; a restore interrupted meanwhile waits for the thread and takes
        back what it added before the cancel goes on (taken back later, by a thread of its own, they
        were listed after the Ctrl-C came back, and left for good by a kernel that exited first)."""
        return await _made_in_thread(lambda: self.shelf.adopt(source, self.backend.name), self.shelf.unadopt)

    async def _restore_file(self, rec: dict[str, Any], node_id: str, adopted: bool = False,
                            label: str | None = None) -> MachineRef:
        """A new machine from a row's file, opened once through the gate's rule: the backend
        reads that very file (its descriptor), whatever its name is changed to meanwhile.
        ``adopted``: the file was added by this restore, and goes again if it fails. ``label``:
        the file as messages name it (default: its path in this folder). A row not signed as this
        user's own save is refused for smol and checked as a file from elsewhere otherwise; one
        signed, whose file is not the one saved, is refused (Shelf.vouch)."""
        name = rec["name"]
        with self.shelf.open(rec) as f:
            # hashed once: vouch compares it with a signed row's, or finds a check's pass by it, and so
            # does the backend's own check below (passes.known), never by the file's stat (coarse times)
            digest = await _to_the_end(asyncio.to_thread(lambda: sha256_fd(f.fd)[0]))
            own = await _to_the_end(asyncio.to_thread(self.shelf.vouch, rec, f, self.backend.name, digest))
            shown = label or self.shelf.store.shown(f.name)
            # smol's engine reads the file in its own process, by name: after the check above, so the
            # file and its folder must be such that no other user can change or replace it meanwhile
            path = self.shelf.store.absolute(f.name) if self.backend.name == "smol" else f.path
            if self.backend.name == "smol":  # the folder and every one above it, then the file
                os.close(open_root(Path(os.path.dirname(path)), what="checkpoint folder"))
                why = untrusted(os.fstat(f.fd))
                if why is not None:
                    raise SmolbenchError(f"refusing checkpoint {name} for smol: {f.name}: {why}, so another user could "
                                         f"alter it after smolbench checked it (smol's engine reads it by name); "
                                         f"chmod go-w {path}, or save it again")
            try:
                isolated = not own or rec.get("session_id") not in SESSIONS_HERE
                with passes.known(f.fd, digest):
                    return await self.backend.restore(path, node_id, self.spec, isolated=isolated)
            except SmolbenchError as exc:
                # messages name the descriptor's path (or its last part): name the file instead
                text = str(exc).replace(path, shown).replace(f"checkpoint {f.fd}", f"checkpoint {f.name}")
                text = text.replace("delete it with `%smol checkpoint rm`", "nothing was added") if adopted else \
                    text.replace("`%smol checkpoint rm`", f"`%smol checkpoint rm {name}`")
                if not adopted and " is corrupt or truncated (" in text and rec.get("session_id") == IMPORTED:
                    text += self.shelf.came_from(rec)  # a copy damaged here: its source puts a whole one back
                raise reworded(exc, text) from None

    def checkpoint_trust(self, name: str) -> str:
        """Sign checkpoint ``name`` as this user's own (Shelf.trust); what happened."""
        return self.shelf.trust(name, self.session)

    def checkpoint_remove(self, name: str) -> str:
        """Delete a checkpoint's file (when the gate's rule allows) and its ledger entry; what happened."""
        said = self.shelf.remove(name)
        self.sync_checkpoints()
        return said

    async def watch_checkpoints(self, every: float = 1.0) -> None:
        """Keep checkpoint badges true while up: once a second, look whether the checkpoints
        changed (the folder's mtime, the ledger's count of rows and their times) and, if so,
        sync them and tell the views. No row is read whole: a copied ledger's 10,000 rows of
        2 MB each were read every second, on smolbench's loop (last audit of round 4)."""
        seen = None
        while True:
            try:
                folder = self.checkpoint_dir.stat().st_mtime_ns if self.checkpoint_dir.exists() else None
                now = (folder, self.ledger.checkpoint_stamp())
                if seen is not None and now != seen:
                    self.sync_checkpoints()
                    self._changed()  # the checkpoint panels list them again
                seen = now
            except Exception:  # a watcher must never break the workbench
                pass
            await asyncio.sleep(every)

    def sync_checkpoints(self) -> list[Node]:
        """Each node's checkpoint badge from what exists now (the ledger's rows of this session
        whose file is there): its newest checkpoint, or none. Checkpoints deleted elsewhere (the
        sidebar, another kernel) drop their badge; another checkpoint of the node keeps one.
        Returns the nodes whose badge changed (their views hear of it)."""
        newest: dict[str, str] = {}
        for row in reversed(self.ledger.checkpoint_rows_of(self.session)):  # oldest first: the newest wins
            if self.shelf.store.usable(row.get("path")) is None:
                newest[str(row.get("node_id"))] = str(row.get("name"))
        changed = [node for node in self.tree if node.checkpoint != newest.get(node.id)]
        for node in changed:
            node.checkpoint = newest.get(node.id)
            self._record(node)
        return changed


def _forward(on_event: BranchEvent, node_id: str) -> Callable[[Event], None]:
    """An event callback that tags events with the node they came from."""
    return lambda ev: on_event(node_id, ev)


def _check_name(name: str) -> None:
    if not valid_name(name):
        raise SmolbenchError(f"bad checkpoint name {name!r}: use letters, digits, '.', '_' or '-' (up to 64, "
                             f"first a letter or digit), e.g. {suggested_name(name)}")
