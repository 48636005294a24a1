"""This folder's checkpoints: the ledger's rows and the files in its checkpoint folder.

Every file is used through the gate's one rule (``gate/ckptpaths.py``): a row's path, or
a file someone dropped into ``.smolbench/checkpoints/``, is read or deleted only when
the rule allows it. A checkpoint file from elsewhere (``%smol checkpoint restore PATH``)
is someone else's bytes: it is copied into this folder's checkpoint folder first, and
the copy is checked like a machine's (the gate's archive checks, its record parsed
strictly); later deletes act on that copy only. ``export`` writes one self-contained
file with the checkpoint's record inside.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import stat
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from . import signing
from ._filehash import sha256_fd
from ._shelflist import (
    DROPPED_SCAN,
    FOREIGN,
    _record,
    describe,
    files_there,
    foreign,
    listed,
    misnamed_lines,
    more_line,
)
from ._shown import MAX_ROWS
from .errors import SmolbenchError
from .gate import archive, ckptwrite, restoring, terminal
from .gate.ckptpaths import SUFFIX, Missing, Opened, PathRefused, Store, suggested_name, valid_name
from .gate.limits import LIMITS, human
from .ledger import Ledger
from .spec import MachineSpec

AGENTHOST = ("sandbox", "process")  # backends whose checkpoints are the gate's two-file archives
IMPORTED = "imported"  # the session of a row added from a file (no node of this kernel's tree)
class Adopted(NamedTuple):
    """What adding a file from elsewhere did: its row, a line saying so, and what it added
    (so a restore that then fails can take back exactly that)."""

    row: dict[str, Any]
    note: str
    new_row: bool  # the row is this call's
    copied: str | None  # the file this call copied into the checkpoint folder, if it did
    identity: tuple[int, ...] | None = None  # that copy's identity (_identity): only it is taken back


def _identity(fd: int) -> tuple[int, ...]:
    """A file's identity over time: device and inode are reused as soon as a file is deleted,
    so its change time and size too."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_ctime_ns, st.st_size


def is_path(arg: str) -> bool:
    """Whether ``%smol checkpoint restore ARG`` names a file rather than a checkpoint here (its
    suffix in any case: a copy may have made it ``.SMOLCHECKPOINT``, said by :func:`_open_named`)."""
    return arg.lower().endswith(SUFFIX) or "/" in arg


class Shelf:
    """A folder's checkpoints (its ledger and its ``.smolbench/checkpoints/``), with no machine needed."""

    def __init__(self, ledger: Ledger, directory: str | os.PathLike[str] | None = None) -> None:
        self.ledger = ledger
        self.store = Store(directory or Path(os.path.abspath(ledger.path)).parent / "checkpoints")

    # -- reading -----------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """Every checkpoint here, newest first (rows, then dropped files), see :func:`describe`."""
        return describe(self.ledger.checkpoint_rows(), self.store)

    def listing(self, limit: int = MAX_ROWS) -> tuple[list[dict[str, Any]], int, str | None]:
        """What a view lists (the panel, ``%smol checkpoint list``): the newest ``limit`` rows,
        their text cut (as the sidebar's, :mod:`smolbench._shown`), then dropped files within
        ``limit`` in all (see :func:`listed`); how many rows the ledger holds; what it left out of the dropped."""
        rows, total = self.ledger.checkpoint_rows(limit), self.ledger.checkpoint_count()
        looked = limit + total + DROPPED_SCAN  # the folder's entries looked at
        unlisted = self.ledger.checkpoint_paths(limit, files_there(self.store, looked)) if total > len(rows) else []
        described, left = listed(rows, self.store, limit - len(rows), looked, unlisted, paths=True)
        return described, total, left

    def find(self, name: str) -> dict[str, Any] | None:
        """The row named ``name``, or the dropped file ``NAME.smolcheckpoint`` as a row (None: neither)."""
        rec = self.ledger.checkpoint(name)
        if rec is not None:
            return rec
        if valid_name(name) and f"{name}{SUFFIX}" in self.store.names():
            return next(iter(describe([], self.store, only=f"{name}{SUFFIX}")), None)
        return None

    def known(self) -> str:
        """The names a one-line refusal offers: the first 20 of a listing (a copied folder's many, cut)."""
        rows, total, left = self.listing()
        names = sorted({str(r["name"]) for r in rows})
        return ", ".join(names[:20]) + (", …" if len(names) > 20 or total > MAX_ROWS or left else "") or "none"

    def missing_line(self, name: str, verb: str = "restore") -> str:
        """No checkpoint ``name`` here, and what to do instead (``verb``: what was asked)."""
        if verb == "export":  # exports one of this folder's: save it first
            return (f"no checkpoint named {name!r} to export: saved checkpoints are {self.known()} "
                    f"(`%smol checkpoint list`); save one first: `%smol checkpoint save "
                    f"{name if valid_name(name) else 'NAME'}`")
        misnamed = misnamed_lines(self.store, name)
        return (f"no checkpoint named {name!r}: saved checkpoints are {self.known()} (`%smol checkpoint list`); "
                f"a file elsewhere: `%smol checkpoint restore PATH{SUFFIX}`" + (f"; {misnamed[0]}" if misnamed else ""))

    def row(self, name: str, verb: str = "restore") -> dict[str, Any]:
        rec = self.find(name)
        if rec is None:
            raise SmolbenchError(self.missing_line(name, verb))
        return rec

    @contextlib.contextmanager
    def open(self, rec: dict[str, Any]) -> Iterator[Opened]:
        """A row's file, open for reading when the rule allows it (else one line naming why)."""
        name = rec.get("name")
        try:
            with self.store.open(rec.get("path")) as f:
                yield f
        except Missing:
            raise SmolbenchError(f"checkpoint {name!r} is missing its file {self.store.shown(rec.get('path'))}: "
                                 f"forget it with `%smol checkpoint rm {name}`") from None
        except PathRefused as exc:
            raise SmolbenchError(f"checkpoint {name!r} can't be used: its ledger row names {exc}; "
                                 f"`%smol checkpoint rm {name}` forgets the row and leaves that path alone") from None

    def record(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        """The record inside a row's file (None: it has none, or the file can't be used)."""
        with contextlib.suppress(SmolbenchError), self.open(rec) as f:
            return _record(f)
        return None

    # -- changing ----------------------------------------------------------------------------

    def remove(self, name: str) -> str:
        """Forget checkpoint ``name`` and delete its file here when the rule allows; what happened."""
        rec = self.find(name)
        if rec is None:
            raise SmolbenchError(f"no checkpoint named {name!r}: see `%smol checkpoint list`")
        try:
            note = "" if self.store.remove(rec.get("path")) else " (its file was already gone)"
        except PathRefused as exc:
            note = f"; its row named {exc}, so that path was left alone"
        self.ledger.remove_checkpoint(name)
        return f"removed checkpoint {name}{note}"

    def add(self, name: str, session: str, node: str, fname: str, backend: str, size: int, cells: int,
            warnings: list[str], **known: Any) -> None:
        """Record a checkpoint whose file ``fname`` is in this folder's checkpoint folder, signed
        as this user's (smolbench.signing: over its name, session, node, backend, path and the
        SHA-256 of its file, hashed here unless ``known`` gives it); ``known``: its baseline and
        machine, for a file from elsewhere its source and sha256."""
        path = self.store.relative(fname)
        if known.get("sha256") is None:
            with self.store.open(fname) as f:
                known["sha256"] = sha256_fd(f.fd)[0]
        row = {"name": name, "session_id": session, "node_id": node, "backend": backend, "path": path}
        secret = signing.key_if_any()  # none: no key can be made here (key_or_why): unsigned
        mac = signing.mac(row, known["sha256"], secret) if secret is not None else None
        self.ledger.add_checkpoint(name, session, node, path, backend, size, cells, warnings, mac=mac, **known)

    def signed(self, rec: dict[str, Any]) -> bool:
        """Whether ``rec`` is signed as this user's own save (a bad key file: its one line, raised)."""
        return not rec.get("dropped") and signing.signed(rec, signing.key(create=False))

    def vouch(self, rec: dict[str, Any], f: Opened, backend: str, digest: str | None = None) -> bool:
        """Before a restore of ``rec``'s file ``f`` on ``backend``: True when it is this user's own
        save and still the file saved (else refused: it was replaced since). A row not signed as
        theirs is refused for smol (whose engine reads the file on this host), and otherwise
        checked as a file from elsewhere is (False). ``digest``: ``f``'s SHA-256, if hashed."""
        name = rec.get("name")
        digest = digest or sha256_fd(f.fd)[0]
        if self.signed(rec):
            if digest != rec.get("sha256"):
                raise SmolbenchError(f"checkpoint {name!r}'s file {self.store.shown(f.name)} is not the file saved as it "
                                     "(its SHA-256 is not the one its signed row holds): it was replaced since, so it "
                                     f"is refused; `%smol checkpoint rm {name}` forgets it")
            return True
        if rec.get("backend") == "smol" or backend == "smol":
            raise SmolbenchError(foreign(name, "smol"))
        # the checks of a file from elsewhere (a record claiming smol refused)
        self._check(f, self.store.shown(f.name), f" (checked as a file from elsewhere: its row is {FOREIGN})", digest)
        return False

    def trust(self, name: str, session: str) -> str:
        """Sign checkpoint ``name``'s row as this user's own (``%smol checkpoint trust``), its file
        first checked as one from elsewhere is (smol's, which no check reads, on the user's word),
        and recorded in the ledger's trust table (``session``: the one that did); what happened."""
        rec = self.row(name, "trust")
        if rec.get("dropped"):
            raise SmolbenchError(f"{name} is a file in {self.store.shown(f'{name}{SUFFIX}')}, not yet a checkpoint of this "
                                 f"folder: `%smol checkpoint restore {name}` adds it (and checks it)")
        with self.open(rec) as f:
            digest = sha256_fd(f.fd)[0]
            if self.signed(rec) and digest == rec.get("sha256"):
                return f"checkpoint {name} is signed as your own already"
            smol = rec.get("backend") == "smol"
            if not smol:
                self._check(f, self.store.shown(f.name), "; it was not signed", digest)
        row = {k: rec.get(k) for k in ("name", "session_id", "node_id", "backend", "path")}
        self.ledger.sign_checkpoint(name, digest, signing.mac(row, digest, signing.key() or b""))
        made = terminal.one_line(str(rec.get("backend")), 40)
        self.ledger.add_trust(session, "checkpoint", f"signed checkpoint {name} ({made}, sha256 {digest}) as this "
                                                     "user's own")
        said = (": smol's engine reads its file on this host when it is restored, so trust only a checkpoint you "
                "saved yourself") if smol else " (its file was checked as one from elsewhere)"
        return f"signed checkpoint {name} as your own{said}"

    def adopt(self, source: str, backend: str | None) -> Adopted:
        """Add the checkpoint file ``source`` (a path the user named, anywhere) to this folder:
        copied into its checkpoint folder (unless it is there already), checked as someone
        else's bytes, given a row. ``backend``: the one up (None: none is). Other kernels
        adding or taking back in this folder wait meanwhile (see :meth:`unadopt`)."""
        with self.store.locked():
            return self._adopt(source, backend)

    def _adopt(self, source: str, backend: str | None) -> Adopted:
        src_fd = _open_named(source)
        try:
            own = self._own_name(os.fstat(src_fd))
            fname, created, replaced = (own, False, None) if own else self._copy_in(src_fd, Path(source).name)
        finally:
            os.close(src_fd)
        name = fname[: -len(SUFFIX)]
        existing = self.ledger.checkpoint(name)
        if existing is not None and self._names_file(existing, fname) and replaced is None:
            if existing.get("session_id") == IMPORTED:  # used again: a restore that added it can't take it back
                self.ledger.touch_checkpoint(name)
                existing = self.ledger.checkpoint(name) or existing
            return Adopted(existing, f"checkpoint {name} is already in this folder ({self.store.shown(fname)})",
                           False, None)
        if existing is not None and replaced is None:  # a row of that name for another file: it stays as it is
            raise SmolbenchError(f"a checkpoint named {name} already names another file "
                                 f"({self.store.shown(existing.get('path'))}): rename {self.store.shown(fname)}, "
                                 f"or `%smol checkpoint rm {name}` first")
        try:
            with self.store.open(fname) as f:
                # its hash first: the check looks its pass up by it (the bytes checked before a machine came up)
                digest = sha256_fd(f.fd)[0]
                record, size, identity = self._check(f, source, sha256=digest), f.size, _identity(f.fd)
        except BaseException:
            if created:
                self.discard(fname)  # a copy that failed its checks goes again
            raise
        r = record or {}
        made_by = str(r.get("backend") or (backend if backend in AGENTHOST else "sandbox"))
        # the record's node, cells, baseline and warnings are its author's word: the row says whose
        # (session "imported"), and its warnings say so themselves
        self.add(name, IMPORTED, str(r.get("node") or ""), fname, made_by, size, int(r.get("cells") or 0),
                 restoring.claimed(list(r.get("warnings") or [])), baseline=r.get("baseline"),
                 source=os.path.abspath(source), sha256=digest, machine=restoring.machine_claims(r) or None)
        row = self.ledger.checkpoint(name)
        assert row is not None
        if replaced is not None:  # a whole copy in place of one that can't be used: kept, whatever comes next
            return Adopted(row, f"replaced this folder's copy of checkpoint {name} ({self.store.shown(fname)}, "
                                f"{replaced}) with {source}", False, None)
        how = f"found in {self.store.shown(fname)}" if own else f"copied into {self.store.shown(fname)}"
        renamed = "" if own or fname == Path(source).name else f" (a different {Path(source).name} is here already)"
        return Adopted(row, f"added checkpoint {name} to this folder ({how}){renamed}", True,
                       fname if created else None, identity if created else None)

    def unadopt(self, added: Adopted) -> None:
        """Take back what ``adopt`` added: its row while it is still that row, and the file
        only if it copied it in and the name is still that copy (a file someone put in the
        checkpoint folder stays theirs; one another kernel saved meanwhile stays too). A row
        another kernel was told is "already in this folder" since (it added the same file: its
        ``readded`` was set) stays, and so does the file it names."""
        name = str(added.row["name"])
        with contextlib.suppress(Missing, PathRefused, OSError), self.store.locked():
            now = self.ledger.checkpoint(name)
            if added.new_row and now is not None and now == added.row:
                self.ledger.remove_checkpoint(name)
                now = None
            if added.copied is None or (now is not None and self._names_file(now, added.copied)):
                return
            with contextlib.suppress(SmolbenchError, OSError), self.store.open(added.copied) as f:
                if _identity(f.fd) != added.identity:
                    return
            self.discard(added.copied)

    def discard(self, fname: str) -> None:
        """Delete a file this folder's code copied in, as far as the rule allows."""
        with contextlib.suppress(SmolbenchError, OSError):
            self.store.remove(fname)

    def _own_name(self, st: os.stat_result) -> str | None:
        """The name of the file here that ``st`` is (a path into our own checkpoint folder), or None."""
        for fname in self.store.names():
            with contextlib.suppress(PathRefused, Missing), self.store.open(fname) as f:
                if f.dev_ino == (st.st_dev, st.st_ino):
                    return fname
        return None

    def _copy_in(self, src_fd: int, base: str) -> tuple[str, bool, str | None]:
        """Copy an outside file in under a free name (the same bytes under a taken name: that
        name; in place of this folder's copy of its name when that one is damaged or missing
        and this one is whole); the name, whether a file was made, and what was wrong with the
        one it replaced (None: it replaced none)."""
        stem = _usable(base)
        digest = sha256_fd(src_fd)[0]
        taken = set(self.store.names()) | {str(r["name"]) + SUFFIX for r in self.ledger.checkpoint_rows()}
        for k in range(1, 100):
            name = stem if k == 1 else f"{stem[:60]}-{k}"
            fname = name + SUFFIX
            wrong = None
            if fname in taken:
                with contextlib.suppress(PathRefused, Missing), self.store.open(fname) as f:
                    if sha256_fd(f.fd)[0] == digest:
                        return fname, False, None  # the same bytes are here already
                wrong = self._unusable_copy(name, fname) if k == 1 else None
                if wrong is None:
                    continue
            with self.store.create(fname) as out, os.fdopen(os.dup(src_fd), "rb") as src:
                src.seek(0)
                copied = _copy_bounded(src, out, base)
                if wrong is not None:  # whole, or the one here stays as it was
                    _whole(f"/proc/self/fd/{out}", base, sha256=copied)
            return fname, True, wrong
        raise SmolbenchError(f"checkpoints named {stem}, {stem}-2 … {stem}-99 all exist here: remove some first")

    def _unusable_copy(self, name: str, fname: str) -> str | None:
        """What is wrong with this folder's file ``fname`` of checkpoint ``name`` that a whole copy
        of the same name may replace: cut short or damaged, empty, or missing (its row still names
        it); None when it is fine, or something else (another kind of file, a row for another)."""
        row = self.ledger.checkpoint(name)
        if row is not None and (not self._names_file(row, fname) or row.get("backend") not in AGENTHOST):
            return None
        try:
            with self.store.open(fname) as f:
                if f.size == 0:
                    return "empty"
                archive.check(f.path, "sandbox", fname)
        except Missing:
            return "its file was missing" if row is not None else None
        except (archive.UnsafeCheckpoint, tarfile.TarError, EOFError, OSError) as exc:
            cut = archive.damage(exc)
            return f"cut short or damaged: {cut}" if cut is not None else None
        except SmolbenchError:
            return None
        return None

    def _names_file(self, row: dict[str, Any], fname: str) -> bool:
        try:
            return self.store.file_name(row.get("path")) == fname
        except PathRefused:
            return False

    def _check(self, f: Opened, source: str, after: str = "; nothing was added",
               sha256: str | None = None) -> dict[str, Any] | None:
        """The record of a checkpoint file from someone else (None: it has none), checked as a
        machine's bytes would be; one line when it is unsafe or not a checkpoint at all (ending in
        ``after``). ``sha256``: ``f``'s, when known (a pass of the same bytes is not checked again)."""
        try:
            with open(f.path, "rb") as fh:
                wrong = archive.first_bytes(fh.read(len(archive.GZIP_START)), source)
            if wrong is not None:
                raise wrong
            return archive.check(f.path, "smolbench", source, sha256)
        except (archive.UnsafeCheckpoint, tarfile.TarError, EOFError, OSError) as exc:
            raise _unreadable(source, exc, after) from None

    def names_file(self, arg: str) -> bool:
        """Whether ``arg`` names a file (:func:`is_path`) rather than a checkpoint here: one saved
        under a name ending in another case of the suffix (``run.SMOLCHECKPOINT``) is still its name."""
        if "/" in arg or arg.endswith(SUFFIX):
            return True
        return is_path(arg) and self.find(arg) is None

    def refusal_before_up(self, arg: str, room: Callable[[archive.Checked, str], str | None] | None = None) -> None:
        """Raise what a restore of ``arg`` refuses with no machine needed, before one comes up for it:
        a file that can't be opened, or whose name can't be a checkpoint's (not one of this folder's
        own files); a name with no checkpoint here. ``room(checked, label)``: why what the file holds
        can't fit in the machine that would come up (None: it fits), said the same way."""
        if not self.names_file(arg):
            rec = self.row(arg)
            if rec.get("backend") == "smol" and not self.signed(rec):  # before a microVM comes up for it
                raise SmolbenchError(foreign(arg, "smol"))
            if rec.get("backend") in AGENTHOST:
                with self.open(rec) as f:
                    _fits(_whole(f.path, f"checkpoint {arg!r}", "; nothing was added" if rec.get("dropped") else
                                 self.came_from(rec)), f"{arg}", room)
            return
        fd = _open_named(arg)
        try:
            if self._own_name(os.fstat(fd)) is None:
                _usable(Path(arg).name)
            try:  # one line if it can't be read, as the restore itself would say it
                record = archive.read_record(f"/proc/self/fd/{fd}", arg)
            except archive.UnsafeCheckpoint as exc:
                raise _unreadable(arg, exc) from None
            if (record or {}).get("backend") != "smol":  # (smol's own checkpoints are the SDK's to check)
                _fits(_whole(f"/proc/self/fd/{fd}", arg), arg, room)
        finally:
            os.close(fd)

    def came_from(self, rec: dict[str, Any]) -> str:
        """What a message of a row's damaged file adds: where this folder's ledger says it came
        from, and the restore that puts a whole copy in its place (its own save: how to forget it)."""
        src = rec.get("source")
        if rec.get("session_id") != IMPORTED or not isinstance(src, str) or not src:
            return f"; it is this folder's own save: `%smol checkpoint rm {rec.get('name')}` forgets it"
        rel = os.path.relpath(src) if os.path.isabs(src) else src
        shown = terminal.one_line(rel if not rel.startswith("../../..") else src, 300)  # a copied ledger's words
        return (f"; this folder's ledger says it came from {shown}: `%smol checkpoint restore {shlex.quote(shown)}` "
                "puts a whole copy in its place")

    def backend_for(self, arg: str) -> str:
        """The backend to bring up for restoring ``arg`` (a name here, or a file) in a kernel with
        nothing up: as its record says, but never the process backend (no isolation) on its own."""
        if self.names_file(arg):
            fd = _open_named(arg)
            try:
                record = archive.read_record(f"/proc/self/fd/{fd}", arg)  # one line if it can't be read
            finally:
                os.close(fd)
            return "smol" if (record or {}).get("backend") == "smol" else "sandbox"
        rec = self.row(arg)
        # a copied folder's row says what its author wrote: one of smolbench's words, never an option
        # line (`%smol up --backend {it}`: "sandbox --ray HOST" joined someone's cluster) nor the process backend
        return "smol" if rec.get("backend") == "smol" else "sandbox"

    def lines(self) -> list[str]:
        """The checkpoints here as text (``%smol checkpoint list`` while nothing is up)."""
        (rows, total, left), misnamed = self.listing(), [f"smolbench: {line}" for line in misnamed_lines(self.store)]
        if not rows:
            return [f"smolbench: no checkpoints in {self.store.shown('x' + SUFFIX).rsplit('/', 1)[0]}/ yet", *misnamed]
        out = [f"smolbench: {len(rows)} checkpoint{'s' if len(rows) != 1 else ''} here"]
        out += [f"smolbench: {line}" for line in (more_line(total) if total > MAX_ROWS else None, left) if line]
        for r in rows:  # a file that is there is not read whole here (a restore checks it): no "ok"
            state = "" if r["exists"] and not r["refused"] else (r["refused"] or "missing")
            theirs = "" if not r.get("foreign") else (r["foreign"] if r["foreign"] != FOREIGN else
                                                      f"foreign: {FOREIGN}; `%smol checkpoint trust {r['name']}` if "
                                                      "you saved it")
            said = " · ".join(x for x in ("dropped in, not in the ledger yet" if r["dropped"] else "", state, theirs,
                                          r.get("unread") or "") if x)
            out.append(f"  {r['name']}  {r.get('backend') or '?'}  {r.get('file') or '-'}" + (f"  {said}" if said else ""))
        return out + misnamed

    def export(self, name: str, dest: str, spec: Any = None, force: bool = False) -> dict[str, Any]:
        """Write checkpoint ``name`` to ``dest`` as one self-contained file, its record inside
        (``spec``: the machine's spec up now; its image and size are recorded when it made this one).
        A file added from elsewhere goes with its record's claims as they were, and its SHA-256."""
        if not dest.endswith(SUFFIX):
            raise SmolbenchError(f"export to a file named …{SUFFIX}, not {dest!r}: e.g. "
                                 f"`%smol checkpoint export {name} ../class/{name}{SUFFIX}`")
        rec = self.row(name, "export")
        if rec.get("backend") not in AGENTHOST and rec.get("backend") is not None:
            raise SmolbenchError(f"checkpoint {name!r} was made by the {rec['backend']} backend, whose checkpoints "
                                 "don't travel as one file yet: save one on the sandbox backend to share it")
        target = Path(os.path.abspath(dest))
        if target.exists() and not force:
            raise SmolbenchError(f"{dest} exists: pick another path or add --force to replace it",
                                 api=f"{dest} exists: pick another path or pass force=True to replace it")
        node = self.ledger.node(str(rec.get("session_id")), str(rec.get("node_id"))) if rec.get("node_id") else None
        imported = rec.get("session_id") == IMPORTED
        # a row not signed as this user's (a copied folder's, a dropped file's) is exported as someone
        # else's: only what its file said, its row's words as its row's, never as this user's own save
        theirs = not self.signed(rec)  # (an unsigned row that says it was imported too: what it says is its own word)
        with self.open(rec) as f:
            try:
                inside = archive.check(f.path, "sandbox", f.name) or {}
            except (tarfile.TarError, EOFError, OSError) as exc:
                raise SmolbenchError(f"checkpoint {name!r} is corrupt or truncated ({archive.damage(exc) or exc}): "
                                     "it can't be exported") from None
            # A file added from elsewhere goes on with its own record's claims, read from its
            # bytes (never this folder's rows, which an older install may have left beside
            # another file); this folder's own save with its baseline (from before that
            # column: its node's), and what its row says of its machine (a save from before
            # that: the machine up now, if it is the same).
            extra: dict[str, Any] = {} if imported or theirs else \
                {"baseline": rec.get("baseline") or (node or {}).get("baseline")}
            if not imported and not theirs:
                same = spec.machine() if spec is not None and extra["baseline"] == spec.baseline() else None
                extra.update(restoring.machine_claims(rec.get("machine"), same))
            record = {k: v for k, v in {**inside, **extra}.items() if k in archive.RECORD_FIELDS and v is not None}
            came = [f"re-exported: added to its folder from a checkpoint file (sha256 {sha256_fd(f.fd)[0]}) that said "
                    "what this record says"] if imported else []
            warnings = [str(w) for w in rec.get("warnings") or []] if isinstance(rec.get("warnings"), list) else []
            if theirs:
                came = [f"re-exported from a checkpoint row not signed as the exporter's own save (a copied folder's, "
                        f"another user's, or from before rows were signed; its file's sha256 {sha256_fd(f.fd)[0]}): "
                        "this record says only what that row and file said"]
                warnings = [restoring.ROW_CLAIM + terminal.one_line(w, restoring.CLAIM_TEXT) for w in warnings]
            created = inside.get("created") if imported or theirs else rec.get("created")
            record.update(kind=archive.RECORD_KIND, version=1, name=name,
                          backend=rec.get("backend") or inside.get("backend") or "sandbox",
                          cells=int(rec.get("cells") or 0), size=f.size,
                          warnings=[str(w)[:2000] for w in [*came, *warnings]][:20])
            if created is not None or not (imported or theirs):  # a file that claimed no time claims none here either
                record["created"] = float(created or time.time())
            if rec.get("node_id"):
                record["node"] = rec["node_id"]
            record = restoring.shared_record(record)  # nothing of this disk's paths or user goes to students
            part = target.with_name(f".{target.name}.{os.getpid()}.part")
            try:
                fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise SmolbenchError(f"can't write {dest} ({exc.strerror}): check the folder and its permissions") from None
            try:
                ckptwrite.write_portable(f.path, fd, record, f.name)
                os.fsync(fd)
                os.replace(part, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(part)
                raise
            finally:
                os.close(fd)
        note = _needs(record, imported or theirs)
        if theirs:
            note = "; ".join(x for x in (
                f"checkpoint {name} is not signed as your own save, so it was exported as someone else's (its record "
                f"says only what its file said); if you saved it yourself, `%smol checkpoint trust {name}`, then "
                "export it again", note) if x)
        return {"name": name, "path": str(target), "size": target.stat().st_size, "record": record, "note": note}


def _needs(record: dict[str, Any], imported: bool) -> str | None:
    """What an export says a student needs besides the file: the Smolfile its machine was made
    with, when its record says that Smolfile sets anything (its packages by name); None when
    it says it set nothing, or (a file from elsewhere) says nothing of it."""
    parts = record.get("parts")
    if not isinstance(parts, dict):
        return None if imported else ("its record can't say what its machine's Smolfile set (saved by an older "
                                      "smolbench, or with another Smolfile than this machine's): give students the "
                                      "Smolfile it was made with")
    default = MachineSpec().parts()
    sets = [f"its image {record['image']}"] if record.get("image") else []
    packages = record.get("packages")
    if parts.get("packages", default["packages"]) != default["packages"]:
        sets.append(f"packages {terminal.listed(packages, restoring.SHOWN)}" if packages else "packages")
    sets += [k for k in ("env", "init", "workdir", "volumes") if parts.get(k, default[k]) != default[k]]
    if not sets:
        return None
    verb = "lists" if sets[0].startswith("packages") else "sets"
    return (f"its machine's Smolfile {verb} {' and '.join(', '.join(sets).rsplit(', ', 1))}: students need "
            "them too: give them that Smolfile")


def _usable(base: str) -> str:
    """The checkpoint name a file named ``base`` from elsewhere is added under; one line when it can't be one."""
    stem = base[: -len(SUFFIX)] if base.endswith(SUFFIX) else base
    if not valid_name(stem):
        raise SmolbenchError(f"{base!r} is not a usable checkpoint name (letters, digits, '.', '_' or '-', up to "
                             f"64, first a letter or digit): rename it to {suggested_name(stem)}{SUFFIX} and "
                             "restore that; nothing was added")
    return stem


def _open_named(source: str) -> int:
    """A file the user named (their own name for it: links followed), open for reading; one line
    when it is not a plain file or is over the checkpoint limit."""
    missing = f"no file {source}: check the path" + (
        "" if os.path.isabs(os.path.expanduser(source)) else " (it is relative to this notebook's folder)")
    if not source.endswith(SUFFIX) and source.lower().endswith(SUFFIX):  # a copy that changed its case
        if not os.path.exists(source):
            raise SmolbenchError(missing)
        base = Path(source).name
        raise SmolbenchError(f"{source!r} ends in {base[-len(SUFFIX):]}, not {SUFFIX}: rename it to "
                             f"{suggested_name(base[: -len(SUFFIX)])}{SUFFIX} and restore that")
    if not source.endswith(SUFFIX):
        raise SmolbenchError(f"{source!r} is not a checkpoint file: restore a file named …{SUFFIX}, "
                             "or a checkpoint of this folder by name")
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SmolbenchError(missing) from None
    except OSError as exc:
        raise SmolbenchError(f"can't open {source} ({exc.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SmolbenchError(f"{source} is not a plain file")
    if st.st_size > LIMITS.checkpoint:
        os.close(fd)
        raise SmolbenchError(f"{source} is {human(st.st_size)}, over the checkpoint limit of {human(LIMITS.checkpoint)}: "
                             "raise it with `%smol config checkpoint-limit 4G` if you trust it")
    return fd


def _copy_bounded(src: Any, out: int, what: str) -> str:
    """Copy ``src`` to descriptor ``out`` (at most the checkpoint limit); the SHA-256 of what was written."""
    left, digest = LIMITS.checkpoint, hashlib.sha256()
    while True:
        block = src.read(1 << 20)
        if not block:
            return digest.hexdigest()
        digest.update(block)
        left -= len(block)
        if left < 0:
            raise SmolbenchError(f"{what} grew past the checkpoint limit of {human(LIMITS.checkpoint)} while it was copied")
        _write_all(out, block)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]



def _unreadable(source: str, exc: BaseException, after: str = "; nothing was added") -> SmolbenchError:
    """Why checkpoint file ``source`` can't be used (``exc``: what reading it raised), in one line
    with the fix (:func:`archive.unusable`), then ``after``: the same class of problem is the same
    class of error, whichever check found it (an UnusableCheckpoint: empty, cut short, damaged,
    not a checkpoint, another version; an UnsafeCheckpoint: refused for what it holds)."""
    if isinstance(exc, archive.UnsafeCheckpoint):
        return type(exc)(f"{exc}{after}")
    return archive.UnusableCheckpoint(f"{archive.unusable(source, exc)}{after}")


def _whole(path: str, source: str, after: str = "; nothing was added", sha256: str | None = None) -> archive.Checked:
    """Refuse checkpoint ``path`` (``source``: as the user named it) as its restore would, before a
    machine comes up for it: a copy cut short is said so at once, not after a boot. ``after``:
    what the line ends with (a row's file: where it came from, :meth:`Shelf.came_from`); ``sha256``: its
    hash, when known (:func:`archive.check_sized`). What it holds."""
    try:
        return archive.check_sized(path, "sandbox", source, sha256)
    except (archive.UnsafeCheckpoint, tarfile.TarError, EOFError, OSError) as exc:
        raise _unreadable(source, exc, after) from None


def _fits(checked: archive.Checked, label: str, room: Callable[[archive.Checked, str], str | None] | None) -> None:
    why = room(checked, label) if room is not None else None
    if why is not None:
        raise SmolbenchError(why)
