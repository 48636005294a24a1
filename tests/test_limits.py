"""Issue 8 limits, the process backend, init timeouts and run folders; issue 12's max_alive.

Every test drives a real ipykernel through nbclient. Each limit probe also runs
against a weakened set-up (``_limits.ENFORCE = False`` in the kernel, or the old
kill-only-the-agent delete), to show the probe does see an overrun when the limit
is not there. Kernels get their own ``TMPDIR`` (the test's tmp dir), so run folders
and sweeps never touch the host's /tmp.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from nbformat import NotebookNode
from nbhelpers import (
    NotebookSession,
    error_output,
    error_text,
    result_text,
    stream_text,
    tree_text,
    wait_for_no_processes,
)

from smolbench import Ledger
from smolbench.backends import _limits

HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap is not installed (apt-get install bubblewrap)")
BACKENDS = [pytest.param("sandbox", marks=needs_bwrap), "process"]
WEAKEN = "from smolbench.backends import _limits\n_limits.ENFORCE = False"
OOM = "machine ran out of memory (limit 256M): raise memory in the Smolfile"
# A sandbox its cgroup killed: the files it keeps in memory counted too, and the line says so.
FILES_OOM = ("machine ran out of memory (limit 256M, the files it wrote included: up to disk = {disk} of them): raise "
             "memory in the Smolfile, or lower disk so that a full disk fails writes with ENOSPC first")

# Inside a machine: fork up to 100 sleeping children, count how many the kernel allowed.
FORK_PROBE = """
import os, time
kids = []
for _ in range(100):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
"""
REAP = "for k in kids:\n    os.kill(k, 9)\n    os.waitpid(k, 0)\nlen(kids)"


@pytest.fixture
def tmpdir_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The kernels' own TMPDIR (run folders go there)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp


@contextmanager
def machine(cwd: Path, backend: str, smolfile: str = "", weakened: bool = False, up_args: str = "",
            before: str = "") -> Iterator[NotebookSession]:
    (cwd / "Smolfile").write_text(smolfile)
    with NotebookSession(cwd, timeout=120, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        if weakened:
            nb.run(WEAKEN)
        if before:
            assert error_output(nb.run(before)) is None
        up = nb.run(f"%smol up --backend {backend} {up_args}")
        assert error_output(up) is None, error_text(up)
        yield nb


def value(cell: NotebookNode) -> str:
    assert error_output(cell) is None, error_text(cell)
    return str(result_text(cell))


def one_line_error(cell: NotebookNode) -> str:
    err = error_output(cell)
    assert err is not None, "the cell did not fail"
    text = error_text(cell)
    assert len(text.strip().splitlines()) == 1, text
    return text.strip()


def kernel_cgroups(kernel_pid: int) -> list[Path]:
    """The cgroup directories (group and machines) a kernel made, in every hierarchy."""
    return [d for base in _limits.detect().bases.values() for g in base.glob(f"smolbench-{kernel_pid}-*")
            for d in (g, *g.iterdir()) if d.is_dir()]


def run_folders(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("smolbench-"))


# -- memory -----------------------------------------------------------------------------------


# Four processes of 100 MiB each, held at once: each holds its memory until all four have theirs
# (then there is no cap) or one of them has ended (killed: the cap), not for a time a loaded host's
# process starts could outlast.
FOUR_AT_ONCE = """
import os, subprocess, sys, tempfile, time
d = tempfile.mkdtemp()
hold = ("import os, sys, time; a = b'x' * (100 << 20); open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()\\n"
        "while not os.path.exists(os.path.join(sys.argv[1], 'go')): time.sleep(0.01)")
ps = [subprocess.Popen([sys.executable, '-c', hold, d]) for _ in range(4)]
deadline = time.monotonic() + 120
while len(os.listdir(d)) < 4 and all(p.poll() is None for p in ps) and time.monotonic() < deadline:
    time.sleep(0.01)
open(os.path.join(d, 'go'), 'w').close()
sorted(p.wait() for p in ps)
"""


@needs_bwrap
@pytest.mark.parametrize("weakened", [False, True], ids=["enforced", "weakened"])
def test_memory_past_the_limit_is_one_line_and_everyone_carries_on(tmp_path: Path, tmpdir_env: Path, weakened: bool) -> None:
    with machine(tmp_path, "sandbox", 'memory = "256M"\n', weakened) as nb:
        status = stream_text(nb.run("%smol status"))
        big = nb.run('%%smol\nx = b"x" * (400 << 20)\nlen(x)')
        # the whole machine (4 processes of 100 MiB each) is capped too, not only one process
        procs = nb.run("%%smol\n" + FOUR_AT_ONCE)
        fork = nb.run('%%smol fork 2 --keep all --allow-errors\nif SEED == 0:\n    x = b"x" * (400 << 20)\nreward = SEED')
        after = [value(nb.run("%%smol\n1 + 1")), value(nb.run("2 + 2"))]
        nb.run("%smol use root.1")
        sibling = value(nb.run("%%smol\nSEED"))
        nodes = Ledger(tmp_path / ".smolbench" / "ledger.db").nodes().set_index("id")
    if weakened:  # the same probes, no limits: they see the overrun
        assert "limits" in status and "none: limits are switched off" in status
        assert value(big) == "419430400"
        assert value(procs) == "[0, 0, 0, 0]"
        assert nodes.loc["root.0", "status"] == "ok"
        return
    limits = next(ln for ln in status.splitlines() if ln.startswith("limits"))
    assert "cgroup v" in limits or "rlimits" in limits
    assert "memory 256M" in limits
    # the machine is up, and what a cell before kept still counts: the line says what frees it now
    assert one_line_error(big).endswith(OOM + "; the machine is up and its variables still hold what they did: "
                                         "`del` the big ones to free it"), one_line_error(big)
    if "cgroup v" in limits:  # the kernel killed one of them; the machine itself lived on
        assert value(procs).startswith("[-9")
    assert error_output(fork) is None
    assert nodes.loc["root.0", "status"] == "error" and OOM in nodes.loc["root.0", "error"]
    assert nodes.loc["root.1", "status"] == "ok"
    assert after == ["2", "4"]  # the parent machine and the kernel carry on
    assert sibling == "1"  # and so does the sibling branch


SHARED_400M = ("%%smol\nimport mmap\nm = mmap.mmap(-1, 400 << 20)  # shared memory: no rlimit counts it\n"
               "for i in range(0, 400 << 20, 1 << 20):\n    m[i:i + (1 << 20)] = b'x' * (1 << 20)\nlen(m)")


@needs_bwrap
@pytest.mark.skipif(not _limits.detect().bases, reason="needs a writable cgroup: rlimits can't count shared memory")
@pytest.mark.parametrize("weakened", [False, True], ids=["enforced", "weakened"])
def test_a_branch_killed_for_memory_says_so_in_one_line_and_the_parent_carries_on(
        tmp_path: Path, tmpdir_env: Path, weakened: bool) -> None:
    with machine(tmp_path, "sandbox", 'memory = "256M"\n', weakened) as nb:
        nb.run("%%smol fork 1 --keep all\nreward = 1")
        nb.run("%smol use root.0")
        cell = nb.run(SHARED_400M)
        tree = tree_text(nb.run("%smol tree"))
        nb.run("%smol use root")
        parent = value(nb.run("%%smol\n1 + 1"))
    assert parent == "2"
    if weakened:
        assert value(cell) == str(400 << 20)
    else:
        lost = FILES_OOM.format(disk="128M") + " (machine root.0 was lost); the active machine is now root"
        assert one_line_error(cell).endswith(lost)
        assert "root.0" in tree and not any("root.0" in ln and "alive" in ln for ln in tree.splitlines()), tree


# Inside a machine: write up to ``mib`` MiB into ``path`` (1 MiB at a time); what got in, and why it stopped.
FILL = r"""
import errno, os
def fill(path, mib):
    n = 0
    try:
        with open(path, "wb") as fh:
            for _ in range(mib):
                fh.write(b"x" * (1 << 20))
                fh.flush()
                n += 1
    except OSError as exc:
        return [n, errno.errorcode.get(exc.errno)]
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return [n, None]
"""


@needs_bwrap
@pytest.mark.parametrize("weakened", [False, True], ids=["enforced", "weakened"])
def test_every_filesystem_in_memory_a_machine_can_write_is_bounded(tmp_path: Path, tmpdir_env: Path, weakened: bool) -> None:
    """Issue 17: with memory 256M and disk 32M, a cell put gigabytes in host RAM through its run
    folder, bwrap's /dev and its own tmpfs. Now each is sized (or read-only); under a cgroup the
    tmpfs pages also count as the machine's memory."""
    with machine(tmp_path, "sandbox", 'memory = "256M"\ndisk = "32M"\n', weakened) as nb:
        nb.run("%%smol\n" + FILL)
        small = {p: nb.run(f"%%smol\nfill({p!r}, 48)") for p in ("/dev/fill", "/dev/shm/fill", "/workspace/fill")}
        nb.run("%%smol fork 1 --keep all\npass")
        nb.run("%smol use root.0")
        run = nb.run("%%smol\nfill('/run/smolbench/fill', 400)")  # a branch, into the run folder it shares
        status = stream_text(nb.run("%smol status"))
    if weakened:  # the old set-up: /dev and the run folder had no size
        assert value(small["/dev/fill"]) == "[48, None]"
        assert value(run) == "[400, None]"
        return
    assert value(small["/dev/fill"]) == "[0, 'EROFS']"
    for path in ("/dev/shm/fill", "/workspace/fill"):
        assert value(small[path]).endswith("'ENOSPC']") and int(value(small[path])[1:].split(",")[0]) <= 32
    if error_output(run) is not None:  # a cgroup counted the run folder as the machine's memory
        assert FILES_OOM.format(disk="32M") in one_line_error(run)
    else:
        got = value(run)  # rlimits: the run folder's own size (memory + disk + 16 MiB) stopped it
        assert got.endswith("'ENOSPC']") and int(got[1:].split(",")[0]) <= 256 + 32 + 16, got
    if "rlimits" in status:  # no cgroup: status says what is not counted
        assert "not counted as memory" in status and "a branch's fork bomb" in status, status
        assert "shared memory" in status and "only a cgroup bounds" in status, status


# -- processes --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_numeric_thread_pools_follow_cpus(tmp_path: Path, tmpdir_env: Path, backend: str) -> None:
    with machine(tmp_path, backend, 'cpus = 1\n[env]\nMKL_NUM_THREADS = "3"\n') as nb:
        seen = value(nb.run("%%smol\nimport os\n[os.environ.get(v) for v in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS')]"))
    assert seen == "['1', '1', '3']"  # the Smolfile's own env wins


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weakened", [False, True], ids=["enforced", "weakened"])
def test_processes_are_capped_per_machine(tmp_path: Path, tmpdir_env: Path, backend: str, weakened: bool) -> None:
    with machine(tmp_path, backend, "pids = 32\n", weakened) as nb:
        count = int(value(nb.run("%%smol\n" + FORK_PROBE + REAP)))
        assert value(nb.run("%%smol\n'still here'")) == "'still here'"
    if weakened:
        assert count == 100  # nothing stopped the probe
    else:
        assert 1 <= count < 32


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fork_bomb_is_capped_and_the_kernel_survives(tmp_path: Path, tmpdir_env: Path, backend: str) -> None:
    with machine(tmp_path, backend, "pids = 32\n") as nb:
        # first the bounded probe: only run a real bomb where the cap is shown to hold
        assert 1 <= int(value(nb.run("%%smol\n" + FORK_PROBE + REAP))) < 32
        nb.run("%%smol\nimport subprocess\nsubprocess.Popen(['sh', '-c', 'b() { b | b & }; b'])\nimport time; time.sleep(2)")
        assert len(nb.processes()) <= 40  # 32 in the machine, plus bwrap/sh around it
        assert value(nb.run("sum(range(10))")) == "45"  # the kernel is fine
        assert "deleted" in stream_text(nb.run("%smol down"))
        assert nb.processes() == []
        assert kernel_cgroups(nb.kernel_pid) == []


@needs_bwrap
def test_each_branch_has_its_own_process_cap(tmp_path: Path, tmpdir_env: Path) -> None:
    with machine(tmp_path, "sandbox", "pids = 32\n") as nb:
        # branch 0 takes every process it may have and keeps them; branch 1 can still start its own
        nb.run("%%smol fork 2 --keep all\nif SEED == 0:\n" + "\n".join("    " + ln for ln in FORK_PROBE.splitlines())
               + "\n    reward = len(kids)\nelse:\n    reward = -1")
        nb.run("%smol use root.1")
        assert value(nb.run("%%smol\nimport subprocess\nsubprocess.run(['true']).returncode")) == "0"
        nodes = Ledger(tmp_path / ".smolbench" / "ledger.db").nodes().set_index("id")
        assert 1 <= nodes.loc["root.0", "reward"] < 32
        # the full branch still answers (its agent serves without a new thread), forks are
        # refused in one line, and it recovers once its own processes end
        nb.run("%smol use root.0")
        refused = one_line_error(nb.run("%%smol fork 1\n1"))
        assert refused.endswith("machine 'root.0' is at its process limit (pids = 32) and can't fork: "
                                "end some of its processes, or raise pids in the Smolfile")
        assert int(value(nb.run("%%smol\n" + REAP))) < 32
        assert value(nb.run("%%smol\nimport subprocess\nsubprocess.run(['true']).returncode")) == "0"
        nb.run("%smol down")


# Issue 17: with the kernel as a user (rlimits), a branch's fork bomb made its parent's and its
# siblings' cells fail with "can't start new thread": RLIMIT_NPROC counts a branch in its
# parent's user namespace too, against the limit its creator had. In a machine: bombs of
# sleeping processes or of threads (100 at most, so a broken cap can't hurt the host), an
# ordinary cell's work (4 subprocesses, 4 threads), and the clean-up.
BOMB = """
import os, subprocess, threading, time
hold = threading.Event()
kids, threads = [], []
def bomb(kind):
    threading.stack_size(1 << 18)  # the threads' count, not memory, is what must run out
    for _ in range(100):
        try:
            if kind == "threads":
                t = threading.Thread(target=hold.wait, args=(120,), daemon=True)
                t.start()
                threads.append(t)
                continue
            pid = os.fork()
            if pid == 0:
                time.sleep(120)
                os._exit(0)
            kids.append(pid)
        except (OSError, RuntimeError):
            break
    return len(kids) + len(threads)
def work():
    try:
        ts = [threading.Thread(target=time.sleep, args=(0.01,)) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for p in [subprocess.Popen(["true"]) for _ in range(4)]:
            p.wait()
    except (OSError, RuntimeError) as exc:
        return type(exc).__name__ + ": " + str(exc)
    return "ok"
def reap():
    hold.set()
    for k in kids:
        os.kill(k, 9)
        os.waitpid(k, 0)
    for t in threads:
        t.join()
    return len(kids) + len(threads)
"""
RLIMITS = "from smolbench.backends import _limits\n_limits._MECHANISM = _limits.Mechanism('rlimits')"
PIDS = 64


@needs_bwrap
@pytest.mark.parametrize("setup", ["detected", "rlimits", "weakened"])
def test_a_branch_fork_bomb_leaves_its_siblings_and_its_parent_their_processes(
        tmp_path: Path, tmpdir_env: Path, monkeypatch: pytest.MonkeyPatch, setup: str) -> None:
    """``detected``: this kernel's own mechanism (a pids cgroup as root here, rlimits as a user);
    ``rlimits`` forces them on a root kernel; ``weakened`` is the old rlimits set-up
    (``SMOLBENCH_TEST_WEAKEN=branch-nproc``: every user namespace recorded at ``pids``)."""
    if setup == "rlimits" and _limits.detect().name == "rlimits":
        pytest.skip("this kernel's own mechanism is rlimits: the 'detected' run is this one")
    if setup == "weakened":
        monkeypatch.setenv("SMOLBENCH_TEST_WEAKEN", "branch-nproc")
    with machine(tmp_path, "sandbox", f"pids = {PIDS}\n", before=RLIMITS if setup != "detected" else "") as nb:
        status = stream_text(nb.run("%smol status"))
        value(nb.run("%%smol\n" + BOMB + "'ready'"))
        value(nb.run("%%smol fork 3 --keep all --quiet\npass"))
        got: dict[str, str] = {}
        nproc = "import resource\nresource.getrlimit(resource.RLIMIT_NPROC)"
        for name, cell in (("root.0", "bomb('processes')"), ("root.1", "bomb('threads')"),
                           ("root.2", "work()"), ("root", "work()")):
            assert error_output(nb.run(f"%smol use {name}")) is None
            got[name] = value(nb.run("%%smol\n" + cell))
            got[name + " limit"] = value(nb.run("%%smol\n" + nproc))  # (soft, hard): what a cell may raise to
        for name in ("root.0", "root.1"):
            nb.run(f"%smol use {name}")
            value(nb.run("%%smol\nreap()"))
        assert "deleted" in stream_text(nb.run("%smol down"))
        assert nb.processes() == []
    if "rlimits" in status:
        assert f"a branch's fork bomb stops at {PIDS}" in status, status
        ceiling = _limits.nproc_ceiling(PIDS) if setup != "weakened" else PIDS
        assert got["root.2 limit"] == f"({PIDS}, {PIDS})", got  # a branch's cell can't raise it
        assert got["root limit"] == f"({min(PIDS * 4, ceiling)}, {ceiling})", got  # itself and 3 live branches
    processes, threads = int(got["root.0"]), int(got["root.1"])
    if setup == "weakened":  # the old set-up: the first bomb took the whole tree's count
        assert threads < 8, got
        assert "can't start new thread" in got["root.2"] and "can't start new thread" in got["root"], got
        return
    assert 40 <= processes < PIDS and 40 <= threads < PIDS, got  # each its own count, no more
    assert got["root.2"] == "'ok'" and got["root"] == "'ok'", got


# -- the process backend -------------------------------------------------------------------------


def test_the_process_backend_is_labelled_process_everywhere(tmp_path: Path, tmpdir_env: Path) -> None:
    with machine(tmp_path, "process") as nb:
        up = stream_text(nb.nb.cells[-1])
        status = stream_text(nb.run("%smol status"))
        nb.run("%%smol fork 1\nreward = 1")
        panel = value(nb.run("from smolbench.widgets import checkpoint_panel\n"
                             "checkpoint_panel(get_ipython().find_magic('smol').__self__.workbench).backend"))
        nb.run("%smol down")
    assert "up on process" in up and "isolation: NONE" in up
    assert "backend" in status and "process" in status.split("backend", 1)[1].splitlines()[0]
    ledger = Ledger(tmp_path / ".smolbench" / "ledger.db")
    assert set(ledger.nodes()["backend"]) == {"process"}
    assert set(ledger.sessions()["backend"]) == {"process"}
    assert panel == "'process'"


DAEMONS = """
import os, subprocess, time
# double-forked, own session: sh exits at once, sleep is adopted by init
subprocess.run(['setsid', 'sh', '-c', 'sleep 300 & echo $! > plain.pid'], check=True)
# the same, with its environment scrubbed (no marker left to find it by)
subprocess.run(['env', '-i', 'setsid', 'sh', '-c', 'sleep 301 & echo $! > scrubbed.pid'], check=True)
time.sleep(0.3)
[int(open(f).read()) for f in ('plain.pid', 'scrubbed.pid')]
"""


def start_time(pid: int) -> str | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    return None if fields[0] in (b"Z", b"X") else fields[19].decode()


@pytest.mark.parametrize("weakened", [False, True], ids=["enforced", "weakened"])
def test_down_kills_double_forked_setsid_daemons(tmp_path: Path, tmpdir_env: Path, weakened: bool) -> None:
    old_delete = "from smolbench.backends.process import ProcessBackend\nProcessBackend._kill_root = lambda self, ref, proc: proc.kill()"
    with machine(tmp_path, "process", weakened=weakened) as nb:
        if weakened:  # no cgroup, and delete kills just the top process, as before
            nb.run(old_delete)
        pids = [int(p) for p in value(nb.run("%%smol\n" + DAEMONS)).strip("[]").split(", ")]
        started = {p: start_time(p) for p in pids}
        assert all(started.values())
        nb.run("%smol down")
        # SIGKILLed daemons gone: a loaded host takes a while to run their ends (the weakened
        # run's are never signalled: a second shows they stay)
        deadline = time.monotonic() + (1 if weakened else 30)
        while (alive := [p for p in pids if start_time(p) == started[p]]) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in alive:  # the weakened run leaves them: clean up before the kernel's check
            os.kill(p, 9)
    if weakened:
        assert alive == pids
    else:
        assert alive == []


def test_auto_falls_back_to_process_with_one_loud_line_and_sandbox_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    from smolbench.backends import probe, sandbox
    from smolbench.errors import BackendUnavailable
    from smolbench.magics import choose_backend

    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    monkeypatch.setattr(probe, "probe_smol", lambda announce=None: (False, "no usable KVM here: /dev/kvm is missing"))
    backend, why = choose_backend("auto", "local")
    assert backend.name == "process" and "\n" not in why
    assert why.startswith("smolbench: WARNING: no microVM here (no usable KVM here) and no bubblewrap, so machines are "
                          "PLAIN PROCESSES with NO isolation (backend `process`)")
    with pytest.raises(BackendUnavailable, match="apt-get install bubblewrap"):
        choose_backend("sandbox", "local")


# -- a kernel that ends without `%smol down` ----------------------------------------------------------

OLD_EXIT_HOOK = """import atexit, threading
from smolbench import _lifetime
threading._threading_atexits[:] = [f for f in threading._threading_atexits if f.func is not _lifetime._at_exit]
atexit.register(_lifetime._at_exit)"""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weakened", [False, True], ids=["enforced", "weakened"])
def test_a_kernel_ended_without_down_leaves_no_run_folder_or_cgroup(tmp_path: Path, tmpdir_env: Path, backend: str,
                                                                   weakened: bool) -> None:
    """A notebook closed (its kernel shut down) with machines up: smolbench's exit hook deletes
    them. It used to run after concurrent.futures' own exit hook, when asyncio.to_thread (every
    delete uses it) refuses new work: the processes died with the kernel, but the run folders and
    cgroups stayed until a later `%smol up` swept them. ``weakened``: the hook registered the old way."""
    with machine(tmp_path, backend) as nb:
        nb.run("%%smol fork 2 --keep all --quiet\nreward = 1")
        kernel = nb.kernel_pid
        if weakened:
            assert error_output(nb.run(OLD_EXIT_HOOK)) is None
        assert run_folders(tmpdir_env)
    left, groups = run_folders(tmpdir_env), kernel_cgroups(kernel)
    if weakened:
        assert left
        for name in left:  # what the old hook left
            shutil.rmtree(tmpdir_env / name, ignore_errors=True)
        for group in sorted(groups, key=lambda d: -len(d.parts)):
            with contextlib.suppress(OSError):
                group.rmdir()
        return
    assert left == [] and groups == []


# -- init ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hung_init_fails_up_in_one_line_and_leaves_nothing(tmp_path: Path, tmpdir_env: Path, backend: str) -> None:
    (tmp_path / "Smolfile").write_text('init = ["sleep 600"]\ninit_timeout = 1.5\n')
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        line = one_line_error(nb.run(f"%smol up --backend {backend}"))
        assert line.endswith("Smolfile init did not finish within 1.5 s (still running 'sleep 600'): "
                             "fix the command, or raise init_timeout in the Smolfile")
        assert nb.processes() == []
        assert run_folders(tmpdir_env) == []
        assert kernel_cgroups(nb.kernel_pid) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_during_init_prints_one_line_and_leaves_nothing(tmp_path: Path, tmpdir_env: Path, backend: str) -> None:
    (tmp_path / "Smolfile").write_text('init = ["sleep 600"]\n')
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        cell: list[NotebookNode] = []
        runner = threading.Thread(target=lambda: cell.append(nb.run(f"%smol up --backend {backend}")))
        runner.start()
        deadline = time.monotonic() + 60
        while not any("sleep 600" in p.cmdline for p in nb.processes()):
            assert time.monotonic() < deadline, "init never started"
            time.sleep(0.05)
        interrupter = threading.Thread(target=nb.interrupt)  # asyncio.run here would unset this thread's loop
        interrupter.start()
        interrupter.join(30)
        runner.join(60)
        line = one_line_error(cell[0])
        assert "`%smol up` was interrupted: its machine was deleted and nothing is left behind" in line
        assert nb.processes() == []
        assert run_folders(tmpdir_env) == []
        assert kernel_cgroups(nb.kernel_pid) == []
        # and the kernel can start a machine afterwards
        (tmp_path / "Smolfile").write_text("")
        assert error_output(nb.run(f"%smol up --backend {backend}")) is None
        nb.run("%smol down")


# -- run folders ----------------------------------------------------------------------------------


def test_stale_run_folders_of_dead_owners_are_swept_never_a_live_ones(tmp_path: Path, tmpdir_env: Path) -> None:
    dead = subprocess.Popen(["sleep", "0"])
    dead_started = start_time(dead.pid) or "1"
    dead.wait()
    for name, owner in (("smolbench-dead", f"{dead.pid} {dead_started}\n"),
                        ("smolbench-live", f"{os.getpid()} {start_time(os.getpid())}\n"),
                        ("smolbench-unowned", None)):
        (tmpdir_env / name / "workspace").mkdir(parents=True)
        if owner is not None:
            (tmpdir_env / name / "owner").write_text(owner)
    # a kernel killed with kill -9 leaves its folder ...
    killed = NotebookSession(tmp_path, check_processes=False)
    with killed as nb:
        nb.run("%load_ext smolbench")
        nb.run("%smol up --backend process")
        left = set(run_folders(tmpdir_env)) - {"smolbench-dead", "smolbench-live", "smolbench-unowned"}
        assert len(left) == 1
        killed_pid = nb.kernel_pid
        nb.kill()
    assert wait_for_no_processes(killed.tag) == []  # the keeper took the machine down with the kernel
    assert left <= set(run_folders(tmpdir_env))
    assert bool(kernel_cgroups(killed_pid)) == bool(_limits.detect().bases)
    # ... and the next `%smol up` sweeps it, with the other dead owner's; never a live owner's
    with machine(tmp_path, "process") as nb:
        now = set(run_folders(tmpdir_env))
        nb.run("%smol down")
    assert "smolbench-dead" not in now and not (left & now)
    assert kernel_cgroups(killed_pid) == []  # the dead kernel's cgroups went with its folders
    assert {"smolbench-live", "smolbench-unowned"} <= now
    assert set(run_folders(tmpdir_env)) == {"smolbench-live", "smolbench-unowned"}


# -- max_alive ------------------------------------------------------------------------------------------


FIFTY = ("ip = get_ipython()\nfor i in range(50):\n"
         "    ip.run_cell_magic('smol', 'fork 1 --quiet --seed-base ' + str(i), 'reward = SEED')")


@needs_bwrap
@pytest.mark.tier2  # second tier: hundreds of branches (tests/conftest.py SECOND_TIER)
@pytest.mark.parametrize("weakened", [False, True], ids=["default-cap", "no-cap"])
def test_fifty_forks_stay_under_max_alive(tmp_path: Path, tmpdir_env: Path, weakened: bool) -> None:
    with machine(tmp_path, "sandbox", up_args="--max-alive 1024" if weakened else "") as nb:
        cell = nb.run(FIFTY)
        live = len(nb.processes())
        status = stream_text(nb.run("%smol status"))
        replay = stream_text(nb.run("%smol replay root.0")) if not weakened else ""
        nb.run("%smol down")
    nodes = Ledger(tmp_path / ".smolbench" / "ledger.db").nodes()
    assert len(nodes) == 51  # every row stays
    if weakened:
        assert "live_machines  51 (" in status
        return
    assert "live_machines  9 (root, root.42, root.43" in status and "kept 8 of max_alive 8" in status
    assert "host memory RSS" in status and "PSS" in status
    notices = [ln for ln in stream_text(cell, "stdout").splitlines() if "deleted idle kept machine" in ln]
    assert len(notices) == 42 and notices[0].startswith("smolbench: deleted idle kept machine root.0 ")
    assert "identical" in replay
    assert live > 0


def test_max_alive_from_the_smolfile_and_a_bad_flag(tmp_path: Path, tmpdir_env: Path) -> None:
    (tmp_path / "Smolfile").write_text("max_alive = 2\n")

    def live(nb: NotebookSession) -> str:
        status = stream_text(nb.run("%smol status"))
        return next(ln for ln in status.splitlines() if ln.startswith("live_machines"))

    with NotebookSession(tmp_path, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        bad = one_line_error(nb.run("%smol up --backend process --max-alive 0"))
        assert bad.endswith("--max-alive must be from 1 to 1024 kept machines, got 0: e.g. --max-alive 8")
        assert error_output(nb.run("%smol up --backend process")) is None
        fork = "%%smol fork 1 --quiet\nreward = 1"
        nb.run(fork)
        nb.run("%smol use root.0")
        for _ in range(3):  # root.0 is active: never deleted; its older kept children go
            nb.run(fork)
        assert "(root, root.0, root.0.2); kept 2 of max_alive 2" in live(nb)
        nb.run("%smol use root.0.2")
        nb.run("%%smol\n1")  # root.0 is now the least recently used, but it has a live child
        nb.run("%smol use root")
        nb.run(fork)
        assert "(root, root.0, root.1); kept 2 of max_alive 2" in live(nb)
        nb.run(fork)  # root.0 has no live child any more: now it goes
        assert "(root, root.1, root.2); kept 2 of max_alive 2" in live(nb)
        nb.run("%smol down")
