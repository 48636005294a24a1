"""Turning a client's folder path into a folder under the server's root, or refusing it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..gate.ckptpaths import Store

LEDGER = Path(".smolbench") / "ledger.db"
SKIP_DIRS = {"node_modules", "__pycache__", "site-packages", ".git", ".venv", "venv", ".ipynb_checkpoints"}


def checkpoint_store(where: Path) -> Store:
    """The checkpoint folder of the notebook folder ``where`` (already checked to be under the
    root), used only through the gate's rule: nothing below ``where`` is followed if a link."""
    return Store(where / LEDGER.parent / "checkpoints")


class PathRefused(ValueError):
    """A path that leaves the server's root directory."""


def folder(root: str | os.PathLike[str], rel: str | None) -> Path:
    """``rel`` (a Jupyter API path: '/'-separated, relative to the root) as a real folder
    inside ``root``; symlinks are resolved first, so none can lead out."""
    base = Path(root).resolve()
    rel = (rel or "").strip().strip("/")
    if "\0" in rel:
        raise PathRefused("the path contains a NUL byte")
    target = (base / rel).resolve()
    if target != base and base not in target.parents:
        raise PathRefused(f"{rel!r} is outside the server's root directory: give a folder under it")
    return target


def relative(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> str | None:
    """``path`` as an API path relative to ``root`` ('' for the root), or None when outside."""
    try:
        rel = Path(path).resolve().relative_to(Path(root).resolve())
    except ValueError:
        return None
    return "" if rel == Path(".") else rel.as_posix()


MAX_ENTRIES = 100_000  # entries of folders one walk for ledgers looks at (files too: one huge folder is bounded)


def find_ledgers(root: str | os.PathLike[str], max_depth: int = 4, max_dirs: int = 4000,
                 max_entries: int | None = None) -> tuple[list[Path], str | None]:
    """Folders under ``root`` that hold a ``.smolbench/ledger.db`` or checkpoint folder, and a
    line saying where the walk stopped short (None: it didn't). The walk is bounded: hidden and
    dependency folders are skipped, it goes ``max_depth`` folders deep, looks into ``max_dirs``
    folders and at ``max_entries`` (None: :data:`MAX_ENTRIES`) of their entries at most (a
    copied folder's 60,000 folders were all walked), so a big home directory stays cheap."""
    base = Path(root).resolve()
    max_entries = MAX_ENTRIES if max_entries is None else max_entries
    found: list[Path] = []
    seen = entries = 0
    todo = [(base, 0)]  # depth first, each folder's subfolders in name order (as os.walk's, sorted)
    cut = (f"the root holds more than a listing looks through for ledgers ({max_dirs:,} folders, "
           f"{max_entries:,} entries in them): ledgers past them are not listed; `%smol checkpoint "
           "list` in a notebook lists its own folder's")
    while todo:
        if seen >= max_dirs or entries >= max_entries:
            return found, cut
        here, depth = todo.pop()
        seen += 1
        if (here / LEDGER).is_file() or (here / LEDGER.parent / "checkpoints").is_dir():  # files dropped in too
            found.append(here)
        if depth >= max_depth:
            continue
        subs: list[str] = []
        with contextlib.suppress(OSError), os.scandir(here) as it:
            for e in it:
                entries += 1
                if entries > max_entries:
                    break
                if not e.name.startswith(".") and e.name not in SKIP_DIRS and e.is_dir(follow_symlinks=False):
                    subs.append(e.name)
        todo += [(here / d, depth + 1) for d in sorted(subs, reverse=True)]
    return found, (cut if entries > max_entries else None)
