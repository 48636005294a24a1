"""The REST API under ``{base_url}smolbench/api/``, behind the server's own auth and XSRF.

    GET    machines                      live machines of every kernel, and orphans
    DELETE machines/KERNEL/NODE          ask the kernel to delete it, or kill an orphan
                                         (&orphaned=1: the dead process of a restarted kernel)
    GET    checkpoints[?path=DIR]        checkpoints of DIR's ledger (no path: every ledger under the root)
    DELETE checkpoints/NAME?path=DIR     remove a checkpoint's file and its ledger row
    GET    ledger/sessions?path=DIR      \\
    GET    ledger/runs?path=DIR           > read-only, paginated (&limit=&offset=; runs: &notebook=PATH)
    GET    ledger/nodes?path=DIR&run=ID  /  (or &session=ID)

Errors are JSON ``{"message": "..."}``: one line saying what is wrong and what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import escape, web

from .. import registry
from .._shelflist import DROPPED_READ, DROPPED_SCAN, files_there, listed, misnamed_lines
from ..gate.ckptpaths import SUFFIX, Store
from ..gate.ckptpaths import PathRefused as FileRefused
from . import ledgerview, machines
from .paths import LEDGER, PathRefused, checkpoint_store, find_ledgers, folder, relative

LEDGER_SCAN_TTL = 5.0  # seconds a scan of the root for ledgers is reused


def _fail(code: int, message: str) -> web.HTTPError:
    """An HTTP error whose message is shown as is (it may hold a literal `%smol`)."""
    return web.HTTPError(code, "%s", message)


class _Base(APIHandler):
    auth_resource = "contents"

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = (kwargs.get("exc_info") or (None, None))[1]
        if isinstance(exc, web.HTTPError) and exc.log_message:
            self.set_header("Content-Type", "application/json")
            text = exc.log_message % exc.args if exc.args else exc.log_message
            self.finish(json.dumps({"message": text, "reason": exc.reason}))
            return
        super().write_error(status_code, **kwargs)

    @property
    def root(self) -> str:
        return str(self.settings["smolbench_root"])

    def folder(self) -> Path:
        try:
            return folder(self.root, self.get_query_argument("path", ""))
        except PathRefused as exc:
            raise _fail(403, str(exc)) from None

    def int_arg(self, name: str, default: int) -> int:
        raw = self.get_query_argument(name, str(default))
        try:
            return int(raw)
        except ValueError:
            raise _fail(400, f"{name}={raw!r} is not a whole number") from None

    def ledger(self) -> tuple[Path, str]:
        where = self.folder()
        db = where / LEDGER
        odd = ledgerview.odd_ledger(db)
        if odd is not None:
            raise _fail(403, f"{relative(self.root, where) or '.'}/{LEDGER} {odd}")
        return db, relative(self.root, where) or ""

    def notebook_paths(self) -> list[str] | None:
        """The ``notebook`` filter (an API path) as the paths a kernel records for it: its
        absolute path (the kernel's JPY_SESSION_NAME), real or not, or the API path itself."""
        rel = self.get_query_argument("notebook", None)
        if rel is None or rel == "":
            return None if rel is None else [""]
        rel = rel.strip("/")
        roots = {self.root, str(self.settings.get("server_root_dir") or self.root)}  # as configured: may hold a symlink
        return sorted({rel, os.path.realpath(os.path.join(self.root, rel))} | {os.path.join(r, rel) for r in roots})

    def relative_notebooks(self, data: dict[str, Any]) -> None:
        """Runs' notebook paths as API paths (a notebook outside the root: its name only), as
        strings: a ledger's paths are its author's, never looked up on disk (resolving 60,000
        deep ones held the server's loop for 44 s)."""
        roots = sorted({os.path.normpath(r) for r in (self.root, str(Path(self.root).resolve()),
                                                      str(self.settings.get("server_root_dir") or self.root))},
                       key=len, reverse=True)

        def rel(path: Any) -> str | None:
            if not isinstance(path, str) or not path:
                return None
            if not os.path.isabs(path):
                return path
            p = os.path.normpath(path)
            for r in roots:
                if p == r or p.startswith(r.rstrip("/") + "/"):
                    return p[len(r.rstrip("/")) + 1:]
            return os.path.basename(p)

        for r in data["runs"]:
            r["notebook"] = rel(r.get("notebook"))
        counts: dict[str | None, int] = {}
        for n in data.get("notebooks", []):
            key = rel(n["notebook"])
            counts[key] = counts.get(key, 0) + n["runs"]
        data["notebooks"] = [{"notebook": k, "runs": v} for k, v in counts.items()]

    async def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A blocking read, off the server's event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))


class MachinesHandler(_Base):
    auth_resource = "kernels"

    @web.authenticated
    @authorized
    async def get(self) -> None:
        known = set(self.kernel_manager.list_kernel_ids())
        notebooks: dict[str, str] = {}
        with contextlib.suppress(Exception):
            for s in await self.session_manager.list_sessions():
                notebooks[s["kernel"]["id"]] = s.get("path") or s.get("name") or ""
        snap = await self.run(machines.snapshot, self.settings["smolbench_registry"], known, notebooks,
                              self.settings.setdefault("smolbench_dead", {}))
        self.finish(snap)


class MachineHandler(_Base):
    auth_resource = "kernels"

    @web.authenticated
    @authorized
    async def delete(self, kernel_id: str, node_id: str) -> None:
        folder_ = self.settings["smolbench_registry"]
        flag = self.get_query_argument("orphaned", None)
        orphaned = None if flag is None else flag in ("1", "true", "yes")
        try:
            path, rec, machine = await self.run(machines.find, folder_, kernel_id, node_id, orphaned)
        except machines.NotFound as exc:
            raise _fail(404, str(exc)) from None
        kernel_alive = registry.alive(rec.get("pid"), rec.get("pid_start"))
        if kernel_alive and kernel_id in self.kernel_manager:
            result = await machines.ask_kernel(self.kernel_manager, kernel_id, node_id)
            if not result["ok"] and not result.get("queued"):
                raise _fail(409, result["message"])
            self.set_status(202 if result.get("queued") else 200)
        elif kernel_alive:
            raise _fail(403, f"kernel {kernel_id[:8]} is alive but not run by this server: delete its machines from its own notebook")
        else:
            result = await machines.kill_orphan(path, rec, machine)
            if not result["ok"]:
                raise _fail(409, result["message"])
        self.finish(result)


class CheckpointsHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        problems: list[str] = []
        if self.get_query_argument("path", None) is not None:
            where = self.folder()
            dirs = await self.run(lambda: [where] if (where / LEDGER).is_file()
                                  or (where / LEDGER.parent / "checkpoints").is_dir() else [])
        else:
            dirs, cut = await self.run(self._ledgers)
            problems += [cut] if cut else []
        # the whole listing, its sort and its JSON too, off the server's loop: a copied folder is someone else's
        self.finish(await self.run(_listing, self.root, dirs, problems))

    def _ledgers(self) -> tuple[list[Path], str | None]:
        cache = self.settings.setdefault("smolbench_ledger_scan", {})
        if cache.get("at", 0) > time.monotonic() - LEDGER_SCAN_TTL:
            return list(cache["dirs"]), cache["cut"]
        dirs, cut = find_ledgers(self.root)
        cache.update(at=time.monotonic(), dirs=dirs, cut=cut)
        return list(dirs), cut


def _listing(root: str, dirs: list[Path], problems: list[str]) -> str:
    """The checkpoints of the ledgers in ``dirs``, and the files dropped into their checkpoint
    folders, as the JSON the sidebar reads: at most MAX_LIMIT of them over all ledgers, each
    folder looked at within bounds, and a line in ``problems`` for each thing left out."""
    out: list[dict[str, Any]] = []
    for d in dirs:
        rel = relative(root, d) or ""
        odd = ledgerview.odd_ledger(d / LEDGER)
        if odd is not None:
            problems.append(f"{rel or '.'}: the ledger {odd}")
            continue
        room = ledgerview.MAX_LIMIT - len(out)  # one listing's rows, over all ledgers: a copied folder's 50,000 too
        try:
            rows, total = ledgerview.checkpoints(d / LEDGER, room) if (d / LEDGER).is_file() else ([], 0)
        except ledgerview.LedgerUnreadable as exc:
            problems.append(f"{rel or '.'}: the ledger {exc}")
            continue
        if total > len(rows):
            problems.append(f"{rel or '.'}: {total - len(rows)} more checkpoint{'s' if total - len(rows) > 1 else ''} "
                            f"not listed (a listing shows {ledgerview.MAX_LIMIT} at most, as the notebook's panel does): "
                            f"`smolbench.Ledger('{rel + '/' if rel else ''}.smolbench/ledger.db').checkpoints()` "
                            "lists them all")
        store = checkpoint_store(d)
        # the folder's entries looked at: the ledger's rows' files, the room left, and a few more
        limit = room - len(rows) + total + DROPPED_SCAN
        problems += [f"{rel or '.'}: {line}" for line in misnamed_lines(store, limit=limit)]
        unlisted = ledgerview.unlisted_paths(d / LEDGER, len(rows), files_there(store, limit)) if total > len(rows) else []
        described, left = listed(rows, store, room - len(rows), limit, unlisted)
        unread = sum(1 for r in described if r.get("unread"))
        if unread:
            problems.append(f"{rel or '.'}: {unread} dropped checkpoint file{'s' if unread > 1 else ''} not read "
                            f"(a listing reads {DROPPED_READ} at most)")
        if left:
            problems.append(f"{rel or '.'}: {left}")
        for r in described:
            r["dir"] = r["folder"] = rel  # the folder whose ledger lists it ('' for the root)
            # the file the rule lets it use, as an API path; never a path outside the root
            r["path"] = f"{rel}/{r['file']}" if rel and r["file"] else (r["file"] or Path(str(r.get("path") or "")).name)
            r.pop("file", None)
            out.append(r)
    out.sort(key=lambda r: -(r.get("created") or 0))
    return escape.json_encode({"checkpoints": out, "problems": problems})


class CheckpointHandler(_Base):
    @web.authenticated
    @authorized
    async def delete(self, name: str) -> None:
        db, rel = self.ledger()
        if not db.is_file() and f"{name}{SUFFIX}" not in checkpoint_store(db.parent.parent).names():
            raise _fail(404, f"no ledger in {rel or 'the root folder'}: nothing to delete")
        # a live kernel writing this ledger removes it itself, so its tree's badges follow
        known = set(self.kernel_manager.list_kernel_ids())
        owner = await self.run(machines.ledger_owner, self.settings["smolbench_registry"], known, db)
        if owner is not None:
            result = await machines.ask_kernel(self.kernel_manager, owner, name, f"%smol checkpoint rm {name}")
            if not result["ok"] and not result.get("queued"):
                raise _fail(409, result["message"])
            self.set_status(202 if result.get("queued") else 200)
            self.finish(result)
            return
        message = await self.run(_delete_checkpoint, db, name, self.root)
        self.finish({"ok": True, "message": message})


def _delete_checkpoint(db: Path, name: str, root: str) -> str:
    """Remove one checkpoint: its ledger row, and its file only as the gate's rule allows (a
    ledger is data a kernel wrote, or someone else's in a copied folder: its path must not
    steer a delete); a file dropped into the checkpoint folder, with no row, goes too. The
    ledger is checked and cut off in time as the sidebar's reads are (:func:`ledgerview.open_ro`)."""
    store = checkpoint_store(db.parent.parent)
    odd = ledgerview.odd_ledger(db)
    if odd is not None:
        raise _fail(403, f"this folder's ledger {odd}")
    if not db.is_file():
        return f"deleted checkpoint {name}{_remove_file(store, name, None)}"
    try:
        with ledgerview.open_ro(db, write=True) as conn:  # (its triggers would run on the delete below)
            row = conn.execute("SELECT path FROM checkpoints WHERE name = ?", (name,)).fetchone()
            removed = _remove_file(store, name, row)
            with conn:
                conn.execute("DELETE FROM checkpoints WHERE name = ?", (name,))
                if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'checkpoint_more'"
                                ).fetchone():  # a ledger no kernel of this version opened yet has none
                    conn.execute("DELETE FROM checkpoint_more WHERE name = ?", (name,))
    except ledgerview.LedgerUnreadable as exc:
        raise _fail(422, f"this folder's ledger {exc}") from None
    return f"deleted checkpoint {name}{removed}"


def _remove_file(store: Store, name: str, row: Any) -> str:
    """Remove the file of checkpoint ``name`` (its ledger ``row``'s path, else its own name) as
    the rule allows; what to say of it."""
    named = row[0] if row is not None else f"{name}{SUFFIX}"
    if row is None and named not in store.names():
        raise _fail(404, f"no checkpoint named {name!r} here: refresh the list")
    try:
        return " and its file" if store.remove(named) else ""
    except FileRefused as exc:
        return f"; its row named a path that {exc.reason.split(':')[0]}, so that path was left alone"


class LedgerHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self, what: str) -> None:
        db, rel = self.ledger()
        if not db.is_file():
            self.finish({"total": 0, what: [], "note": f"no ledger in {rel or 'the root folder'} yet: "
                         "it appears after `%smol up` in a notebook there"})
            return
        limit, offset = self.int_arg("limit", 50), self.int_arg("offset", 0)
        try:
            if what == "runs":
                data = await self.run(ledgerview.runs, db, limit, offset, self.notebook_paths())
                await self.run(self.relative_notebooks, data)  # off the server's loop
            elif what == "sessions":
                data = await self.run(ledgerview.sessions, db, limit, offset)
            else:
                data = await self.run(ledgerview.nodes, db, self.get_query_argument("run", None),
                                      self.get_query_argument("session", None), limit, offset)
        except ledgerview.LedgerUnreadable as exc:
            where = f"{rel}/{LEDGER}" if rel else str(LEDGER)
            raise _fail(422, f"{where} {exc}: move it aside; `%smol up` starts a new one") from None
        except KeyError as exc:
            raise _fail(404, str(exc.args[0])) from None
        data["dir"] = rel
        self.finish(data)


def setup_handlers(web_app: Any, root_dir: str, runtime_dir: str) -> None:
    """Add the API to the server's web app."""
    web_app.settings["smolbench_root"] = os.path.realpath(root_dir)
    web_app.settings["smolbench_registry"] = Path(runtime_dir) / registry.DIRNAME
    base = url_path_join(web_app.settings["base_url"], "smolbench", "api")
    node = r"(?P<node_id>[A-Za-z0-9][A-Za-z0-9._-]{0,127})"
    web_app.add_handlers(".*$", [
        (url_path_join(base, "machines"), MachinesHandler),
        (url_path_join(base, "machines", r"(?P<kernel_id>[A-Za-z0-9_.-]{1,128})", node), MachineHandler),
        (url_path_join(base, "checkpoints"), CheckpointsHandler),
        (url_path_join(base, "checkpoints", r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,63})"), CheckpointHandler),
        (url_path_join(base, "ledger", r"(?P<what>sessions|runs|nodes)"), LedgerHandler),
    ])
