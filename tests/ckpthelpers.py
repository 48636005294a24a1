"""Checkpoint files from someone else, made by hand: shared by the tests of restoring a shared file."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import tarfile
import threading
import time
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


def interrupt_once_started(nb: Any, started: Path, go: Path) -> threading.Thread:
    """A thread that presses Ctrl-C in ``nb``'s kernel once ``started`` exists (a held step
    reached its hold), then lets that step go on (``go``): start it, run the cell, join it."""
    def press() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not started.exists():
            time.sleep(0.01)
        nb.interrupt()
        go.touch()

    return threading.Thread(target=press)


def held_hand_over(started: Path, go: Path, handed: Path | None = None) -> str:
    """Kernel code that holds a restore's hand-over into its new machine: ``started`` is made
    when it is reached, it goes on once ``go`` exists (60 s at most), ``handed`` made after it."""
    after = f"    finally:\n        open({str(handed)!r}, 'w').close()\n" if handed is not None else ""
    return ("import os, time\nfrom smolbench.backends.sandbox import SandboxBackend\n"
            "_hand_over = SandboxBackend._hand_over\n"
            "def held_hand_over(self, path, folder):\n"
            f"    open({str(started)!r}, 'w').close()\n"
            "    deadline = time.monotonic() + 60\n"
            f"    while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
            "        time.sleep(0.01)\n"
            + ("    try:\n        return _hand_over(self, path, folder)\n" + after if after else
               "    return _hand_over(self, path, folder)\n")
            + "SandboxBackend._hand_over = held_hand_over")


def counted_checks(monkeypatch: Any) -> list[str]:
    """Every workspace check from now on (``archive.check_members``), by the file it names."""
    from smolbench.gate import archive

    checks: list[str] = []
    real = archive.check_members

    def counted(tar: Any, where: str) -> int:
        checks.append(where)
        return real(tar, where)

    monkeypatch.setattr(archive, "check_members", counted)
    return checks


def staged_for_the_guest(tmp_path: Path, blob: bytes) -> tuple[Path, Path]:
    """A stage folder holding workspace ``blob`` and an empty namespace, as a machine's
    restore finds it, and the empty workdir to unpack into (``SaveLoad.load``, in process)."""
    from smolbench.guest import nsstream

    stage, work = tmp_path / "stage", tmp_path / "work"
    stage.mkdir()
    work.mkdir()
    (stage / "workspace.tar").write_bytes(blob)
    with open(stage / "namespace.pkl", "wb") as fh:
        nsstream.dump(fh, {"modules": {}, "seed": None, "name": "r1"}, [])
    return stage, work
