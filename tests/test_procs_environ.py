"""Attack: a process makes its own /proc/PID/environ huge, and the host's sweeps read it.

Any process (one inside a machine too: no privilege is needed) can point its environment at
memory of its own with ``prctl(PR_SET_MM, PR_SET_MM_MAP)``: a read-only mapping never
touched costs it nothing and no limit of its machine counts it. The sweeps that look for
smolbench's marks (a Ray cluster's, the process backend's, a dead kernel's machines) read
every process's environment whole and split it: the audit's 256 MiB took one 12-18 s and
2.3 GB. Each environment is now read within ``_procs.ENVIRON_LIMIT`` and searched, not split.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator

import pytest

from smolbench.backends import _procs

INFLATE = r'''
import ctypes, mmap, sys
size = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, -1, 0)  # NORESERVE
stat = open("/proc/self/stat", "rb").read()
v = stat[stat.rfind(b")") + 2:].split()
field = lambda n: int(v[n - 3])  # proc(5) numbers fields from 1, the state is the 3rd
libc.sbrk.restype = ctypes.c_void_p

class MmMap(ctypes.Structure):  # struct prctl_mm_map
    _fields_ = [(n, ctypes.c_uint64) for n in ("start_code", "end_code", "start_data", "end_data", "start_brk", "brk",
                "start_stack", "arg_start", "arg_end", "env_start", "env_end")] + [
               ("auxv", ctypes.c_uint64), ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]

m = MmMap(field(26), field(27), field(45), field(46), field(47), libc.sbrk(0), field(28), field(48), field(49),
          addr, addr + size, 0, 0, 0xFFFFFFFF)
rc = libc.prctl(35, 14, ctypes.byref(m), ctypes.sizeof(m), 0)  # PR_SET_MM, PR_SET_MM_MAP
print("ok" if rc == 0 else "refused", flush=True)
sys.stdin.read()  # until the test lets go
'''
SIZE = 64 << 20


@pytest.fixture
def inflated() -> Iterator[int]:
    """A process carrying a mark, whose environment then reads as 64 MiB of NULs."""
    env = {**os.environ, "SMOLBENCH_TEST_INFLATED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", INFLATE, str(SIZE)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ok":
            pytest.skip("prctl(PR_SET_MM_MAP) is refused here")
        assert os.stat(f"/proc/{proc.pid}/environ") is not None
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_sweep_reads_a_huge_environment_within_its_limit(inflated: int) -> None:
    tracemalloc.start()
    try:
        found = _procs.with_env("SMOLBENCH_TEST_INFLATED", "1")
        held = _procs.environ_holds(inflated, [b"SMOLBENCH_TEST_INFLATED=1"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # before: the whole 64 MiB read, then split into a list of 8 bytes per byte (~600 MB)
    assert peak < 3 * _procs.ENVIRON_LIMIT, f"{peak:,} bytes held reading one environment"
    assert inflated not in [pid for pid, _ in found] and held == set()  # its mark is gone with the old environ


def test_marks_are_whole_entries_and_an_entry_cut_off_at_the_limit_is_no_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**os.environ, "SMOLBENCH_TEST_MARK": "123.456"}
    proc = subprocess.Popen([sys.executable, "-c", "print(flush=True); import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # its own environment now (before its exec: this process's)
        me = _procs.environ_holds(proc.pid, [b"SMOLBENCH_TEST_MARK=123.456", b"SMOLBENCH_TEST_MARK=123",
                                             b"TEST_MARK=123.456"])
        assert me == {b"SMOLBENCH_TEST_MARK=123.456"}
        assert proc.pid in [pid for pid, _ in _procs.with_env("SMOLBENCH_TEST_MARK", "123.456")]
        with open(f"/proc/{proc.pid}/environ", "rb") as fh:
            data = fh.read()
        cut = data.index(b"SMOLBENCH_TEST_MARK=123") + len(b"SMOLBENCH_TEST_MARK=123")  # the limit falls inside it
        monkeypatch.setattr(_procs, "ENVIRON_LIMIT", cut)
        assert _procs.environ_holds(proc.pid, [b"SMOLBENCH_TEST_MARK=123"]) == set()
    finally:
        proc.kill()
        proc.wait()
