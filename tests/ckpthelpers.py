"""Checkpoint files from someone else, made by hand: shared by the tests of restoring a shared file."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import tarfile
from pathlib import Path
from typing import Any

from smolbench.ledger import Ledger

CK = Path(".smolbench") / "checkpoints"
NAMESPACE = pickle.dumps({"vars": {}, "modules": {}, "seed": None, "name": "root"}, protocol=4)


def rows(folder: Path) -> dict[str, dict[str, Any]]:
    """The checkpoint rows of ``folder``'s ledger, by name."""
    led = Ledger(folder / ".smolbench" / "ledger.db")
    try:
        return {r["name"]: r for r in led.checkpoint_rows()}
    finally:
        led.close()


def forged(path: Path, record: bytes | None, members: list[tuple[str, bytes]] | None = None) -> None:
    """A checkpoint file with ``record`` as its first member, then a real-looking namespace and workspace."""
    parts = ([("smolbench-record.json", record)] if record is not None else []) + (
        members or [("namespace.pkl", NAMESPACE), ("workspace.tar", workspace())])
    with gzip.open(path, "wb") as gz, tarfile.open(fileobj=gz, mode="w|") as tar:
        for name, data in parts:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def workspace(name: str = "hello.txt", data: bytes = b"hi") -> bytes:
    """A workspace archive of one file."""
    ws = io.BytesIO()
    with tarfile.open(fileobj=ws, mode="w:") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return ws.getvalue()


def record(**over: Any) -> bytes:
    """A checkpoint's record as smolbench writes one, changed by ``over``."""
    base = {"kind": "smolbench-checkpoint", "version": 1, "name": "gift", "backend": "sandbox"}
    return json.dumps({**base, **over}).encode()
