"""Turning a client's folder path into a folder under the server's root, or refusing it."""

from __future__ import annotations

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


def find_ledgers(root: str | os.PathLike[str], max_depth: int = 4, max_dirs: int = 4000) -> list[Path]:
    """Folders under ``root`` that hold a ``.smolbench/ledger.db`` or checkpoint folder (bounded walk: hidden and
    dependency folders are skipped, so a big home directory stays cheap)."""
    base = Path(root).resolve()
    found: list[Path] = []
    seen = 0
    for dirpath, dirnames, _ in os.walk(base):
        seen += 1
        here = Path(dirpath)
        if (here / LEDGER).is_file() or (here / LEDGER.parent / "checkpoints").is_dir():  # files dropped in too
            found.append(here)
        depth = len(here.relative_to(base).parts)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS) \
            if depth < max_depth and seen < max_dirs else []
    return found
