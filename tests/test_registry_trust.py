"""Audit (hardening): registry files were trusted for kills. ``kill_orphan`` SIGKILLed whatever
pid and start time a record named (its process group and descendants too) without checking that
smolbench started it, and ``read_records`` followed links and read fifos. A record names a
machine's process now only when that process carries the machine's marker, and records are read
from plain files only.

A second audit: the marker named the machine only (every kernel's first machine is ``root``), so a
crafted record of a dead kernel killed a live kernel's root; the process carries its kernel's pid
and start time too now.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import smolbench
from smolbench import registry
from smolbench.server import machines


def _dead_pid() -> tuple[int, int | None]:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    start = registry.proc_start(proc.pid)
    proc.wait()
    return proc.pid, start


def _sleeper(env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A `sleep` in a session of its own, once its exec is done: Popen returns (vfork) before the
    new program's environment is set up, and a busy host reads it empty for a while."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/cmdline", "rb") as fh:
            if fh.read().startswith(b"sleep"):
                break
        time.sleep(0.005)
    return proc


def _orphan_record(pid: int, kernel: tuple[int, int | None] | None = None) -> dict[str, Any]:
    kpid, kstart = kernel or _dead_pid()
    return {"format": 1, "kernel_id": "deadbeef", "pid": kpid, "pid_start": kstart, "backend": "sandbox",
            "updated": time.time(), "machines": [{"id": "root", "backend": "sandbox", "pid": pid,
                                                  "pid_start": registry.proc_start(pid)}]}


@pytest.mark.parametrize("env", [{}, {"SMOLBENCH_MACHINE": "other"}, {"SMOLBENCH_MACHINE": "root"},
                                 {"SMOLBENCH_MACHINE": "root", "SMOLBENCH_KERNEL": "LIVE"}],
                         ids=["unmarked", "another-machine", "no-kernel", "a-live-kernels-root"])
def test_a_record_naming_a_process_smolbench_did_not_start_for_it_kills_nothing(
        tmp_path: Path, env: dict[str, str]) -> None:
    if env.get("SMOLBENCH_KERNEL") == "LIVE":  # a live kernel's machine (this process stands in for the kernel)
        env = {**env, "SMOLBENCH_KERNEL": f"{os.getpid()}.{registry.proc_start(os.getpid())}"}
    victim = _sleeper(env)  # the user's
    try:
        rec = _orphan_record(victim.pid)
        path = tmp_path / "kernel-deadbeef.json"
        registry.write_atomic(path, rec)
        snap = machines.snapshot(tmp_path, set(), {})
        assert [m["killable"] for g in snap["kernels"] for m in g["machines"]] == [False]
        said = asyncio.run(machines.kill_orphan(path, rec, rec["machines"][0]))
        assert not said["ok"] and said["message"] == (f"root's host process {victim.pid} is not a machine smolbench "
                                                      "started (its record names another process): left alone")
        assert victim.poll() is None and path.exists()
    finally:
        victim.kill()
        victim.wait()


def test_a_live_kernels_pid_as_text_does_not_pass_for_a_dead_one(tmp_path: Path) -> None:
    """`"pid": "123"` is no live kernel's pid to ``alive()``, but spells the live kernel's mark."""
    me, started = os.getpid(), registry.proc_start(os.getpid())
    victim = _sleeper({"SMOLBENCH_MACHINE": "root", "SMOLBENCH_KERNEL": f"{me}.{started}"})
    try:
        rec = _orphan_record(victim.pid, (me, started))
        rec.update(pid=str(me), pid_start=str(started))
        path = tmp_path / "kernel-deadbeef.json"
        registry.write_atomic(path, rec)
        assert [m["killable"] for g in machines.snapshot(tmp_path, set(), {})["kernels"] for m in g["machines"]] == [False]
        assert not asyncio.run(machines.kill_orphan(path, rec, rec["machines"][0]))["ok"]
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_a_machine_smolbench_started_is_still_killed(tmp_path: Path) -> None:
    kernel = _dead_pid()
    machine = _sleeper({"SMOLBENCH_MACHINE": "root", "SMOLBENCH_KERNEL": f"{kernel[0]}.{kernel[1]}"})
    try:
        rec = _orphan_record(machine.pid, kernel)
        path = tmp_path / "kernel-deadbeef.json"
        registry.write_atomic(path, rec)
        assert [m["killable"] for g in machines.snapshot(tmp_path, set(), {})["kernels"] for m in g["machines"]] == [True]
        said = asyncio.run(machines.kill_orphan(path, rec, rec["machines"][0]))
        assert said["ok"] and said["action"] == "killed", said
        assert machine.wait(10) < 0 and not path.exists()
    finally:
        machine.kill()
        machine.wait()


def test_records_are_read_from_plain_files_only(tmp_path: Path) -> None:
    rec = {"format": 1, "kernel_id": "k", "machines": []}
    registry.write_atomic(tmp_path / "kernel-plain.json", rec)
    (tmp_path / "elsewhere").mkdir()
    registry.write_atomic(tmp_path / "elsewhere" / "rec.json", rec)
    (tmp_path / "kernel-link.json").symlink_to(tmp_path / "elsewhere" / "rec.json")
    fifo = tmp_path / "kernel-fifo.json"
    os.mkfifo(fifo)

    def writer() -> None:  # a reader that opens the fifo (blocking) gets a record from it
        with contextlib.suppress(OSError), open(fifo, "w") as fh:
            fh.write('{"format": 1, "kernel_id": "fifo", "machines": []}')

    feeding = threading.Thread(target=writer, daemon=True)
    feeding.start()
    try:
        found = [p.name for p, _ in registry.read_records(tmp_path)]
    finally:
        while feeding.is_alive():  # a writer still waiting for a reader: let it go (its write fails)
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
            feeding.join(0.01)
    assert found == ["kernel-plain.json"]


def test_a_crafted_record_never_kills_a_live_kernels_machine(tmp_path: Path) -> None:
    """The audit's repro: a record of a dead kernel naming a live session's root machine (its pid
    and start time) listed it as an orphan, Kill killed it, and the session's next cell failed."""
    with smolbench.Session(backend="sandbox", ledger=tmp_path / "ledger.db") as s:
        s.run("x = 1").raise_for_error()
        pid = s.workbench.machines["root"].info["pid"]
        rec = _orphan_record(pid)
        path = tmp_path / "kernel-crafted.json"
        registry.write_atomic(path, rec)
        snap = machines.snapshot(tmp_path, set(), {})
        assert [(m["id"], m["orphaned"], m["killable"]) for g in snap["kernels"] for m in g["machines"]] == [
            ("root", True, False)]
        said = asyncio.run(machines.kill_orphan(*machines.find(tmp_path, "deadbeef", "root", True)))
        assert not said["ok"] and said["action"] == "none" and said["message"].endswith("left alone"), said
        assert registry.proc_start(pid) is not None
        assert s.run("print(x)").stdout == "1\n"
