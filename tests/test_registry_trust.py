"""Audit (hardening): registry files were trusted for kills. ``kill_orphan`` SIGKILLed whatever
pid and start time a record named (its process group and descendants too) without checking that
smolbench started it, and ``read_records`` followed links and read fifos. A record names a
machine's process now only when that process carries the machine's marker, and records are read
from plain files only.

A second audit: the marker named the machine only (every kernel's first machine is ``root``), so a
crafted record of a dead kernel killed a live kernel's root; the process carries its kernel's pid
and start time too now. A crafted record of 8,000 machines took 12 s to list (each machine looked
through all the others) and 8 records of 4 MiB `[{},...]` cost 759 MiB at once; records are read
one at a time now, within caps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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


class _Counting(list):  # type: ignore[type-arg]
    """A record's machines list that counts the entries looked at."""

    visits = 0

    def __iter__(self) -> Any:
        for item in super().__iter__():
            _Counting.visits += 1
            yield item


def test_a_record_of_thousands_of_machines_is_listed_in_work_linear_in_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each machine's killability looked through all the record's machines: 8,000 entries naming
    one live process took 12 s. Counted: entries looked at, and looks at the process."""
    victim = _sleeper()
    try:
        n = 2000
        rec = _orphan_record(victim.pid)
        rec["machines"] = [{**rec["machines"][0], "id": f"m{i}"} for i in range(n - 1)]
        rec["machines"].append({**rec["machines"][0], "id": "odd", "agent_pid": {}, "agent_start": []})  # not keys
        registry.write_atomic(tmp_path / "kernel-deadbeef.json", rec)
        reading, checking = registry.read_records, registry.started_machine
        looks = []

        def counted(*args: Any, **kwargs: Any) -> Any:
            for path, data in reading(*args, **kwargs):
                data["machines"] = _Counting(data["machines"])
                yield path, data

        def check(*args: Any) -> bool:
            looks.append(args[0])
            return checking(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(registry, "read_records", counted)
        monkeypatch.setattr(registry, "started_machine", check)
        _Counting.visits = 0
        snap = machines.snapshot(tmp_path, set(), {})
        assert snap["orphaned"] == n and not any(m["killable"] for g in snap["kernels"] for m in g["machines"])
        assert _Counting.visits <= 3 * n, _Counting.visits  # was n * (n + 1): 4,002,000
        assert looks == [victim.pid]  # was one look per machine
    finally:
        victim.kill()
        victim.wait()


def _peak(fn: Any) -> int:
    """The most memory ``fn()`` held at once, in bytes (tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_records_are_read_one_at_a_time_and_one_parse_is_bounded(tmp_path: Path) -> None:
    """8 records of 4 MiB `[{},...]` cost 759 MiB at once: every record was parsed and held
    before any was looked at, and a record of tiny objects costs ~33x its size parsed."""
    live = {"format": 1, "kernel_id": "not-ours", "pid": os.getpid(), "pid_start": registry.proc_start(os.getpid())}
    pad = json.dumps({**live, "machines": [], "pad": ["ab"] * 50_000}).encode()  # ~250 KB; ~3 MB parsed
    (tmp_path / "kernel-a0.json").write_bytes(pad)
    one = _peak(lambda: machines.snapshot(tmp_path, set(), {}))
    for i in range(1, 8):
        (tmp_path / f"kernel-a{i}.json").write_bytes(pad)
    eight = _peak(lambda: machines.snapshot(tmp_path, set(), {}))
    assert one > len(pad) and eight < 1.5 * one, (one, eight)  # was ~8x

    for f in tmp_path.iterdir():
        f.unlink()
    body = json.dumps({**live, "machines": []}).encode()
    tiny = body[:-2] + b"{}" + b",{}" * ((registry.MAX_RECORD_BYTES - len(body)) // 3 - 1) + b"]}"
    assert len(tiny) <= registry.MAX_RECORD_BYTES and isinstance(json.loads(tiny), dict)
    (tmp_path / "kernel-tiny.json").write_bytes(tiny)
    snap: dict[str, Any] = {}
    peak = _peak(lambda: snap.update(machines.snapshot(tmp_path, set(), {})))
    assert peak < 3 * registry.MAX_RECORD_BYTES, peak  # was ~22x (88 MiB for 4 MiB)
    assert snap["skipped"] == [f"kernel-tiny.json: more than the {registry.MAX_MACHINES} machines a kernel has, not read"]


def test_a_listing_reads_within_its_caps_and_says_what_it_skipped(tmp_path: Path) -> None:
    kpid, kstart = _dead_pid()
    rec = {"format": 1, "kernel_id": "k", "pid": kpid, "pid_start": kstart, "machines": [{"id": "root"}]}
    for i in range(registry.MAX_RECORDS + 3):
        registry.write_atomic(tmp_path / f"kernel-{i:04}.json", rec)
    (tmp_path / "kernel-0000.json").write_text(json.dumps({**rec, "machines": [{"id": "r"}] * (registry.MAX_MACHINES + 1)}))
    (tmp_path / "kernel-0001.json").write_bytes(b" " * (registry.MAX_RECORD_BYTES + 1))
    skipped: list[str] = []
    read = [p.name for p, _ in registry.read_records(tmp_path, skipped)]
    assert read == [f"kernel-{i:04}.json" for i in range(2, registry.MAX_RECORDS)]
    assert skipped == ["3 record files past the first 256 (by name) were not read",
                       "kernel-0000.json: more than the 4096 machines a kernel has, not read",
                       "kernel-0001.json: over 2 MiB, not read"]
    dead: dict[str, Any] = {}  # the server's, kept between listings: the kernels seen swept
    machines.snapshot(tmp_path, set(), {}, dead)
    for i in range(registry.MAX_RECORDS):
        registry.write_atomic(tmp_path / f"kernel-x{i:04}.json", rec)
    machines.snapshot(tmp_path, set(), {}, dead)
    assert len(dead) == registry.MAX_RECORDS  # of 508 swept

    for f in tmp_path.iterdir():
        f.unlink()
    big = json.dumps({**rec, "pad": "x" * (registry.MAX_RECORD_BYTES - 200)})
    for i in range(5):  # 10 MiB: the fifth is past what one listing reads
        (tmp_path / f"kernel-big{i}.json").write_text(big)
    skipped = []
    assert len(list(registry.read_records(tmp_path, skipped))) == 4
    assert skipped == ["kernel-big4.json and the records after it: past the 8 MiB a listing reads"]
    assert machines.snapshot(tmp_path, set(), {})["skipped"] == skipped
