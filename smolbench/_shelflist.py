"""What a folder's checkpoints list as: the ledger's rows and the files dropped into its
checkpoint folder, each checked through the gate's one rule, within a listing's bounds (a copied
folder is someone else's). ``Shelf`` (``shelf.py``) and the server's sidebar list through here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from . import signing
from ._shown import MAX_ROWS
from .errors import SmolbenchError
from .gate import archive
from .gate.ckptpaths import SUFFIX, Missing, Opened, PathRefused, Store, suggested_name

# what a listing says of a row not signed by this user (smolbench.signing)
FOREIGN = "not signed as your own save (a copied folder's, another user's, or from before rows were signed)"


def foreign(name: object, backend: object) -> str:
    """Why a restore refuses checkpoint ``name``, whose row is not signed as this user's, when it
    would have smol's engine read its file on this host (``backend``: the row's or the one up)."""
    return (f"checkpoint {name!r} is {FOREIGN}: its {backend} file would be read by smol's engine on this host, so "
            f"it is refused; if you saved it yourself, `%smol checkpoint trust {name}` signs it")


def _key_or_why() -> tuple[bytes | None, str | None]:
    """This user's key if there is one (none is made to list), or why it can't be used."""
    try:
        return signing.key(create=False), None
    except SmolbenchError as exc:
        return None, str(exc)


DROPPED_READ = 20  # dropped files one listing reads the record of (the sidebar lists them on every poll)
DROPPED_SCAN = 1_000  # entries of a checkpoint folder a bounded listing looks at past its room and the ledger's rows


def files_there(store: Store, limit: int) -> Callable[[Any], str | None]:
    """What a ledger row's path stands for in ``store``'s folder (``NAME.smolcheckpoint``) when
    that file is among the folder's first ``limit`` entries (those a bounded listing looks at),
    else None: the rows a listing leaves out are read through it, so what is kept of them is at
    most one name per file there (a copied ledger's rows are anyone's)."""
    there = set(store.some_names(limit, (), limit)[0])

    def file_of(path: Any) -> str | None:
        if not isinstance(path, str) or path.rpartition("/")[2] not in there:
            return None
        try:
            name = store.file_name(path)
        except PathRefused:
            return None
        return name if name in there else None
    return file_of


def describe(rows: list[dict[str, Any]], store: Store, paths: bool = True,
             only: str | None = None, unlisted: Iterable[Any] = ()) -> list[dict[str, Any]]:
    """Rows of a ledger's checkpoints, and the files in ``store`` that no row names (dropped
    in; ``only``: that file name alone), each with ``file`` (its path relative to the notebook
    folder, or None), ``exists`` (the rule lets it be read), ``refused`` (why not, one line;
    ``paths=False``: without naming the refused path) and ``dropped``. Past :data:`DROPPED_READ`
    dropped files, one's record is not read: its ``unread`` says so. ``unlisted``: the paths of
    the ledger's rows left out of ``rows``, or their files' names (:func:`files_there`: their
    files are not dropped ones)."""
    return _described(rows, store, paths, only, unlisted, None, 0)[0]


def listed(rows: list[dict[str, Any]], store: Store, room: int, limit: int,
           unlisted: Iterable[Any] = (), paths: bool = False) -> tuple[list[dict[str, Any]], str | None]:
    """:func:`describe` for a bounded listing (the sidebar's, a view's): at most ``room``
    dropped files, found among the folder's first ``limit`` entries; and a line saying what it
    left out, or None (a copied folder's 100,000 dropped files were 37.8 MB on every poll)."""
    return _described(rows, store, paths, None, unlisted, max(0, room), limit)


def _described(rows: list[dict[str, Any]], store: Store, paths: bool, only: str | None, unlisted: Iterable[Any],
               room: int | None, limit: int) -> tuple[list[dict[str, Any]], str | None]:
    out, read, left = [], 0, None
    named: set[str | None] = set()
    for path in unlisted:
        with contextlib.suppress(PathRefused):
            named.add(store.file_name(path))
    secret, why_key = _key_or_why() if rows else (None, None)
    for row in rows:
        rec = dict(row)
        rec["foreign"] = None if signing.signed(row, secret) else (why_key or FOREIGN)
        try:
            fname: str | None = store.file_name(row.get("path"))
            named.add(fname)
        except PathRefused:
            fname = None
        why = _refusal(store, row.get("path"), paths)
        rec.update(file=store.shown(fname) if fname else None, exists=why is None, refused=why, dropped=False)
        if why == MISSING:
            rec["refused"] = None  # missing is not refused: the row is removed as usual
        if row.get("damaged") and rec["refused"] is None:  # a copied ledger's: said, never a crash
            rec["refused"] = f"damaged: {row['damaged']}; `%smol checkpoint rm` forgets it"
        out.append(rec)
    if room is None:
        dropped = store.names()
    else:
        dropped, more, cut = store.some_names(room, named, limit)
        left = _left_line(store, more, cut, limit)
    for fname in dropped:
        if fname in named or only not in (None, fname):
            continue
        name = fname[: -len(SUFFIX)]
        rec = {"name": name, "session_id": None, "node_id": None, "path": store.relative(fname), "backend": None,
               "created": None, "size": None, "cells": None, "warnings": [], "file": store.shown(fname),
               "dropped": True, "foreign": None}  # (a dropped file is added, and checked, as one from elsewhere)
        try:
            with store.open(fname) as f:
                st = os.fstat(f.fd)
                rec.update(size=f.size, created=st.st_mtime, exists=True, refused=None)
                read += 1
                if read > DROPPED_READ:
                    rec["unread"] = f"not read: a listing reads {DROPPED_READ} dropped files at most"
                record = None if read > DROPPED_READ else _record(f)
        except PathRefused as exc:
            rec.update(exists=False, refused=str(exc) if paths else exc.reason)
            record = None
        except Missing:
            rec.update(exists=False, refused=None)
            record = None
        except SmolbenchError as exc:
            rec.update(exists=True, refused=str(exc))
            record = None
        except Exception as exc:  # one file someone dropped in never breaks the folder's listing
            rec.update(exists=True, refused=f"{store.shown(fname)} can't be read ({archive.reason(exc)}): skipped")
            record = None
        if record is not None:
            rec.update(backend=record["backend"], node_id=record.get("node"), cells=record.get("cells"),
                       warnings=record.get("warnings", []))
        out.append(rec)
    return out, left


def _left_line(store: Store, more: int, cut: bool, limit: int) -> str | None:
    """What a bounded listing says of the dropped files it left out (None: none)."""
    where, fix = f"{Path(*store.chain)}/", "`%smol checkpoint restore NAME` there still finds one by name"
    if more:
        return (f"{'at least ' if cut else ''}{more:,} more checkpoint file{'s' if more > 1 else ''} dropped into "
                f"{where} {'are' if more > 1 else 'is'} not listed (a listing shows {MAX_ROWS} checkpoints at most"
                + (f" and looks at {limit:,} entries of a checkpoint folder" if cut else "") + f"): {fix}")
    if cut:
        return (f"{where} holds more than {limit:,} entries, which is all a listing looks at: checkpoint files "
                f"dropped in past them are not listed; {fix}")
    return None


def more_line(total: int) -> str:
    """What a listing of the newest :data:`MAX_ROWS` of ``total`` rows says of the rest."""
    return (f"{total - MAX_ROWS:,} more checkpoints not listed (a listing shows the newest {MAX_ROWS}): "
            "`smolbench.Ledger('.smolbench/ledger.db').checkpoints()` has them all")


MISNAMED_SHOWN = 20  # files a listing names as misnamed; more are counted in one line


def misnamed_lines(store: Store, near: str | None = None, limit: int | None = None) -> list[str]:
    """A line for each file in ``store`` that looks like a checkpoint but is not listed (its name
    is not a checkpoint name), with the name to rename it to; the name as ``ascii`` shows it
    (someone else's file name: no control characters or look-alike text reach the output).
    ``limit``: look at that many of the folder's entries at most."""
    out: list[str] = []
    found, cut = store.some_misnamed(limit)
    if near is not None:  # the files a restore of ``near`` may have meant first
        found.sort(key=lambda f: not suggested_name(f[: -len(SUFFIX)]).lower().startswith(near.lower()))
    for fname in found[:MISNAMED_SHOWN]:
        stem = fname[: -len(SUFFIX)]
        why = (f"ends in {ascii(fname[-len(SUFFIX):])}, not {SUFFIX!r}" if not fname.endswith(SUFFIX) else
               "its name is not a checkpoint name (letters, digits, '.', '_' or '-', up to 64, first a letter or digit)")
        out.append(f"{ascii(fname)} in {Path(*store.chain)}/ is not listed: {why}: rename it to "
                   f"{suggested_name(stem)}{SUFFIX}")
    if len(found) > MISNAMED_SHOWN:
        out.append(f"{'at least ' if cut else ''}{len(found) - MISNAMED_SHOWN:,} more files in {Path(*store.chain)}/ "
                   "are not listed for their names")
    return out


MISSING = "missing"


def _refusal(store: Store, named: object, paths: bool) -> str | None:
    """Why the rule won't let a row's file be read (MISSING: it is not there), or None."""
    try:
        with store.open(named):
            return None
    except Missing:
        return MISSING
    except PathRefused as exc:
        return str(exc) if paths else f"its ledger row names a path that {exc.reason}"


def _record(f: Opened) -> dict[str, Any] | None:
    """The record inside an open checkpoint file (checked), or None; a smol VM file has none.
    Anything wrong with the file is one line naming it (archive.read_record)."""
    try:
        with open(f.path, "rb") as fh:
            if fh.read(2) != b"\x1f\x8b":
                return None
    except OSError as exc:
        raise SmolbenchError(f"{f.name} is not a readable checkpoint ({exc.strerror})") from None
    return archive.read_record(f.path, f.name)
