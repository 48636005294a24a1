"""Issue 28 part 1: ``smolbench.Session``, the Workbench without IPython.

A Session used from a plain script (``python script.py`` in a subprocess) or inside a Ray
task leaves nothing behind: no processes, no run folders under its TMPDIR, no cgroups,
when the script ends normally, on an exception and on SIGTERM. The SIGTERM case also runs
with the Session's handler taken away (the weakened contrast), to show the check sees what
a killed script leaves. In a real kernel, ``smolbench.session()`` is the Session that
``%smol up`` made, and its forks agree with ``%%smol fork``. The async twins run inside
``asyncio.run`` without blocking the caller's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from nbhelpers import (
    TAG_VAR,
    NotebookSession,
    error_text,
    stream_text,
    tagged_processes,
    wait_for_no_processes,
)

import smolbench
from smolbench.backends import _limits
from smolbench.errors import CompositeError, RemoteError, SmolbenchError
from smolbench.ledger import Ledger

HAVE_BWRAP = shutil.which("bwrap") is not None
BACKENDS = [pytest.param("sandbox", marks=pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap is not installed")),
            "process"]


def cgroups_of(pid: int) -> list[Path]:
    """The cgroup directories (group and machines) process ``pid`` made, in every hierarchy."""
    return [d for base in _limits.detect().bases.values() for g in base.glob(f"smolbench-{pid}-*")
            for d in (g, *g.iterdir()) if d.is_dir()]


def run_folders(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("smolbench-"))


class Script:
    """``python script.py`` in ``cwd`` with its own TMPDIR and process tag."""

    def __init__(self, cwd: Path, source: str) -> None:
        self.cwd = cwd
        self.tmp = cwd / "tmp"
        self.tmp.mkdir(exist_ok=True)
        self.tag = uuid.uuid4().hex
        (cwd / "script.py").write_text(textwrap.dedent(source))
        env = {**os.environ, TAG_VAR: self.tag, "TMPDIR": str(self.tmp), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "script.py"], cwd=cwd, env=env, text=True, start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.pid = self.proc.pid

    def wait_for_line(self, want: str, timeout: float = 180) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if want in line:
                return
            if not line and self.proc.poll() is not None:
                break
        raise AssertionError(f"the script never printed {want!r}: {self.proc.stderr.read() if self.proc.stderr else ''}")

    def finish(self, timeout: float = 240) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except BaseException:  # timed out (ours or pytest's): the script and what it started go
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.proc.communicate()
            raise
        return self.proc.returncode, out, err

    def leftovers(self) -> tuple[list[object], list[str], list[Path]]:
        return wait_for_no_processes(self.tag, timeout=10), run_folders(self.tmp), cgroups_of(self.pid)

    def clean(self) -> None:
        """What a weakened run left: removed so the suite's own check stays meaningful."""
        for p in tagged_processes(self.tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        wait_for_no_processes(self.tag, timeout=10)
        for name in run_folders(self.tmp):
            shutil.rmtree(self.tmp / name, ignore_errors=True)
        for group in sorted(cgroups_of(self.pid), key=lambda d: -len(d.parts)):
            with contextlib.suppress(OSError):
                group.rmdir()


HEAD = """\
import os, signal, sys, smolbench
s = smolbench.Session(backend={backend!r}, ledger="ledger.db")
"""

ENDINGS = {
    # the with block ends by an exception: __exit__ deletes the machines, the script fails
    "exception": """\
with s:
    r = s.fork(2, "reward = SEED", keep="all")
    print("up", len(s.status()["live_machines"]) > 0, flush=True)
    raise RuntimeError("boom in the script")
""",
    # no down, no with, not even the handle: the interpreter's exit hook deletes them
    "exit": """\
s.up()
s.fork(2, "reward = SEED", keep="all")
del s
import gc; gc.collect()
print("up", flush=True)
""",
    # killed while a cell runs: the SIGTERM handler deletes them, then the default action ends it
    "sigterm": """\
s.up()
s.fork(2, "reward = SEED", keep="all")
print("ready", flush=True)
s.run("import time; time.sleep(600)")
print("not reached", flush=True)
""",
    # Ctrl-C, then Ctrl-C again and again while the exit hook deletes the machines
    "ctrl-c": """\
s.up()
s.fork(2, "reward = SEED", keep="all")
signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
signal.setitimer(signal.ITIMER_REAL, 0.2, 0.005)
print("ready", flush=True)
import time; time.sleep(600)
print("not reached", flush=True)
""",
    # its root dies under a run (episodes made a zygote, on the sandbox): the exit hook still closes what is left
    "root-died": """\
s.up()
s.episodes(2, "reward = SEED")
s.fork(2, "reward = SEED", keep="all")
try:
    s.run("import os; os._exit(3)")
except smolbench.SmolbenchError:
    print("lost", s.status()["up"], flush=True)
""",
}
ENDINGS["sighup"] = ENDINGS["sigterm"]  # a terminal closing
# two sessions: the stop is said once (each session said it, to the same stderr)
ENDINGS["sigterm-two"] = ENDINGS["sigterm"].replace("s.up()\n", "s.up()\nt = smolbench.Session(backend=s.backend_kind, "
                                                    "ledger='other.db')\nt.up()\n", 1)
WEAKENED_SIGTERM = ENDINGS["sigterm"].replace("s.up()\n", "s.up()\nsignal.signal(signal.SIGTERM, signal.SIG_DFL)\n")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ending", ["exception", "exit", "sigterm", "sighup", "ctrl-c", "root-died", "sigterm-two"])
def test_a_script_leaves_nothing_behind(tmp_path: Path, backend: str, ending: str) -> None:
    script = Script(tmp_path, HEAD.format(backend=backend) + ENDINGS[ending])
    if ending in ("sigterm", "sighup", "sigterm-two"):
        script.wait_for_line("ready")
        assert run_folders(script.tmp) and tagged_processes(script.tag)  # machines are up, a cell is running
        script.proc.send_signal(signal.SIGHUP if ending == "sighup" else signal.SIGTERM)
    code, out, err = script.finish()
    procs, folders, groups = script.leftovers()
    assert (procs, folders, groups) == ([], [], [])
    if ending == "exception":
        assert code == 1 and "RuntimeError: boom in the script" in err and "up True" in out
    elif ending == "exit":
        assert code == 0, err
    elif ending == "root-died":
        assert code == 0 and "lost False" in out, err
    elif ending == "ctrl-c":
        assert "KeyboardInterrupt" in err and "not reached" not in out
    else:
        assert code == -(signal.SIGHUP if ending == "sighup" else signal.SIGTERM) and "not reached" not in out
        assert err.count("stopping and deleting this program's machines") == 1, err


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sigterm_without_the_sessions_handler_leaves_run_folders_weakened(tmp_path: Path, backend: str) -> None:
    """The contrast: the default SIGTERM action kills the script before any cleanup."""
    script = Script(tmp_path, HEAD.format(backend=backend) + WEAKENED_SIGTERM)
    script.wait_for_line("ready")
    script.proc.send_signal(signal.SIGTERM)
    code, _, _ = script.finish()
    try:
        _, folders, _ = script.leftovers()
        assert code == -signal.SIGTERM
        assert folders, "the check would not see what a killed script leaves"
    finally:
        script.clean()


def test_a_sigterm_handler_the_script_had_still_runs_after_the_machines_are_deleted(tmp_path: Path) -> None:
    script = Script(tmp_path, """\
import signal, sys, smolbench
def mine(signum, frame):
    import os
    print("mine ran; run folders:", sorted(n for n in os.listdir(os.environ["TMPDIR"]) if n.startswith("smolbench-")), flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, mine)
s = smolbench.Session(backend="process", ledger="ledger.db").up()
print("ready", flush=True)
s.run("import time; time.sleep(600)")
""")
    script.wait_for_line("ready")
    script.proc.send_signal(signal.SIGTERM)
    code, out, err = script.finish()
    assert code == 7, err
    assert "mine ran; run folders: []" in out
    assert script.leftovers() == ([], [], [])


# SIGTERM at the bad moment. The profile hook signals the script itself while its main thread,
# waiting for a Session call, holds the lock of the Event it waits on (in Condition.wait, called
# from smolbench's Job.wait_finished). A handler that deleted the machines right there (the old
# one) deadlocked: the loop thread, ending the killed cell, needs that lock to say so. It waited
# its 30 s, then the script's own handler saw the run folder still there (and under load the
# run took over 240 s). Now the handler only wakes a watcher thread, and returns.
AT_THE_BAD_MOMENT = """\
import os, signal, sys
def _at_the_lock(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "_is_owned":
        up, names = frame, []
        while up is not None and len(names) < 4:
            names.append(up.f_code.co_name)
            up = up.f_back
        if "wait_finished" in names:
            sys.setprofile(None)
            print("signalled in", " < ".join(names), flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
"""
MINE = """\
import smolbench
def mine(signum, frame):
    print("mine ran; run folders:", sorted(n for n in os.listdir(os.environ["TMPDIR"]) if n.startswith("smolbench-")), flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, mine)
"""


@pytest.mark.parametrize("during", ["run", "up", "fork"])
def test_a_sigterm_while_the_main_thread_holds_the_lock_it_waits_with_ends_cleanly(tmp_path: Path, during: str) -> None:
    calls = {
        "up": 'sys.setprofile(_at_the_lock)\ns.up()\nprint("not reached", flush=True)\n',
        "run": 's.up()\nsys.setprofile(_at_the_lock)\ns.run("import time; time.sleep(600)")\nprint("not reached")\n',
        "fork": 's.up()\nsys.setprofile(_at_the_lock)\ns.fork(2, "import time; time.sleep(600)")\nprint("not reached")\n',
    }
    script = Script(tmp_path, AT_THE_BAD_MOMENT + MINE + 's = smolbench.Session(backend="process", ledger="ledger.db")\n'
                    + calls[during])
    code, out, err = script.finish()
    assert "signalled in _is_owned < wait < wait < wait_finished" in out, out + err
    assert code == 7, err
    assert "mine ran; run folders: []" in out and "not reached" not in out
    assert "smolbench: SIGTERM: stopping and deleting this program's machines" in err
    assert script.leftovers() == ([], [], [])


def test_a_second_sigterm_while_the_machines_are_deleted_does_not_cut_the_deletion_short(tmp_path: Path) -> None:
    """The cell ignores the interrupt, so stopping it takes its grace period (3 s): the second
    SIGTERM lands then. The deletion goes on, and the program still ends by SIGTERM."""
    running = tmp_path / "running"
    script = Script(tmp_path, HEAD.format(backend="process") + f"""\
s.up()
print("ready", flush=True)
s.run("import time\\nopen({str(running)!r}, 'w').close()\\nwhile True:\\n    try:\\n        time.sleep(600)\\n    except KeyboardInterrupt:\\n        pass")
print("not reached", flush=True)
""")
    script.wait_for_line("ready")
    deadline = time.monotonic() + 120
    while not running.exists():  # the cell is running (in its loop that ignores the interrupt)
        assert time.monotonic() < deadline and script.proc.poll() is None, "the cell never started"
        time.sleep(0.05)
    script.proc.send_signal(signal.SIGTERM)
    assert script.proc.stderr is not None
    for line in script.proc.stderr:
        if "smolbench: SIGTERM: stopping" in line:
            break
    assert run_folders(script.tmp), "the machines were already gone: the second SIGTERM would not land during deletion"
    script.proc.send_signal(signal.SIGTERM)
    code, out, err = script.finish()
    assert code == -signal.SIGTERM, err
    assert "not reached" not in out
    assert script.leftovers() == ([], [], [])


# -- Ray -------------------------------------------------------------------------------------------

RAY_SCRIPT = """\
import os, time, ray
from smolbench.cluster.local import _again

@ray.remote(num_cpus=1, max_retries=0)
def train(fail):
    import smolbench
    here = os.path.dirname(os.environ["TMPDIR"])  # the test's folder, whatever the worker's cwd
    with open(os.path.join(here, "pids"), "a") as fh:
        fh.write(f"{os.getpid()}\\n")
    with smolbench.Session(backend="process", ledger=os.path.join(here, "ledger.db")) as s:
        s.run("base = 10")
        result = s.fork(3, "reward = base * SEED", keep="all")
        if fail == "raise":
            raise RuntimeError("boom in the task")
        if fail == "cancel":  # the driver cancels it while this cell runs (it says so from the machine)
            s.run(f"open({os.path.join(here, 'running')!r}, 'w').close()\\nimport time; time.sleep(600)")
        return sorted(result.rewards.values()), s.status()["live_machines"].split()[0]

# One small local node. A busy host may take minutes to start it. Ray's raylet gives its agents
# a fixed 15 s to write their ports (ray-project/ray#65983): _again tells it them first (see
# smolbench.cluster.local._ports_told), and starts again if a node still timed out.
_again(lambda: ray.init(num_cpus=1, object_store_memory=80 * 1024 * 1024, include_dashboard=False,
                        log_to_driver=False, _temp_dir=os.environ["RAY_DIR"]), ray.shutdown, tries=3)
print("rewards", ray.get(train.remote(None)), flush=True)
try:
    ray.get(train.remote("raise"))
except ray.exceptions.RayTaskError as exc:
    print("task failed:", "boom in the task" in str(exc), flush=True)
ref = train.remote("cancel")
running = os.path.join(os.path.dirname(os.environ["TMPDIR"]), "running")
while not os.path.exists(running):  # the cell is running in the machine
    time.sleep(0.1)
ray.cancel(ref)  # a KeyboardInterrupt in the task: the with block ends, its machines go
try:
    ray.get(ref)
except ray.exceptions.TaskCancelledError:
    print("task cancelled", flush=True)
# Killed: its worker gets SIGKILL, so nothing in it runs. The machines' keeper kills their
# processes at once; the run folder and cgroups stay until the next Session's up() sweeps
# those of owners that are gone, here the next task's.
os.remove(running)
ref = train.remote("cancel")
while not os.path.exists(running):
    time.sleep(0.1)
ray.cancel(ref, force=True)
try:
    ray.get(ref)
except (ray.exceptions.TaskCancelledError, ray.exceptions.WorkerCrashedError):
    print("task killed", flush=True)
print("after", ray.get(train.remote(None))[0], flush=True)
ray.shutdown()
"""


@pytest.mark.timeout(1500)  # starting Ray: minutes on a busy 2-core host
@pytest.mark.tier2  # second tier: a Ray cluster (tests/conftest.py SECOND_TIER)
def test_a_session_inside_a_ray_task_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tasks that end normally, raise, are cancelled, and are killed (swept by the next task's Session)."""
    pytest.importorskip("ray")
    ray_dir = tempfile.mkdtemp(prefix="sbray-", dir="/tmp" if os.path.isdir("/tmp") else None)  # short: Unix sockets
    monkeypatch.setenv("RAY_DIR", ray_dir)
    try:
        script = Script(tmp_path, RAY_SCRIPT)
        code, out, err = script.finish(timeout=1400)
        assert code == 0, err[-3000:]
        assert "rewards ([0.0, 10.0, 20.0], '4')" in out  # root and its three kept branches were live in the task
        assert "task failed: True" in out
        assert "task cancelled" in out and "task killed" in out and "after [0.0, 10.0, 20.0]" in out
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        assert len(pids) == 5
        assert script.leftovers()[:2] == ([], [])  # no process of the script's (Ray's included) and no run folder
        assert [g for pid in pids for g in cgroups_of(pid)] == []
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


# -- the notebook's Session ---------------------------------------------------------------------------


def test_smolbench_session_in_a_kernel_is_the_one_smol_up_made(tmp_path: Path) -> None:
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        before = nb.run("import smolbench\nsmolbench.session()")
        assert "SmolbenchError: no session is up: run `%smol up` in the notebook" in error_text(before)
        nb.run("%smol up --backend process")
        nb.run("%%smol\nbase = 10")
        out = stream_text(nb.run(
            "s = smolbench.session()\n"
            "f = s.fork(3, 'reward = base * SEED', keep='none')\n"
            "print(s is smolbench._magics.session, s.active, sorted(f.rewards.values()))\n"
            "s.run('base = 100')"))
        assert out.strip() == "True root [0.0, 10.0, 20.0]"
        nb.run("%%smol fork 3 --keep none --quiet --seed-base 5\nreward = base * SEED")
        both = stream_text(nb.run(
            "magic = smolbench._magics.last_result.rewards\n"
            "mine = s.fork(3, 'reward = base * SEED', keep='none', seed_base=5).rewards\n"
            "print(sorted(magic.values()), sorted(mine.values()) == sorted(magic.values()))"))
        assert both.strip() == "[500.0, 600.0, 700.0] True"  # the same machine: the Session's run set base
        # the kernel's own SIGTERM handling is left alone (the Session's handler would fight ipykernel's)
        handler = stream_text(nb.run("import signal\nprint(signal.getsignal(signal.SIGTERM) is "
                                     "smolbench._lifetime._on_sigterm)"))
        assert handler.strip() == "False"
        nb.run("%smol down")
        after = nb.run("smolbench.session()")
        assert "no session is up" in error_text(after)


# -- in this process: results, errors, async twins ------------------------------------------------


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_run_brings_back_output_value_as_data_and_the_error(here: Path) -> None:
    import numpy as np

    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        r = s.run("import numpy as np\nprint('hello')\nnp.arange(3) * 2", push={"k": 5})
        assert r.ok and r.stdout == "hello\n" and isinstance(r.value, np.ndarray) and r.value.tolist() == [0, 2, 4]
        r = s.run("class Thing: pass\nThing()")
        assert r.value is None and r.display is not None and "Thing object" in r.display["text/plain"]  # not data
        r = s.run("y = k + 1", pull=["y"])
        assert r.value is None and r.pulled == {"y": 6}
        r = s.run("1 / 0")
        assert not r.ok and r.error is not None and type(r.error).__name__ == "ZeroDivisionError"
        with pytest.raises(RemoteError) as raised:  # a RemoteError named after the machine's exception
            s.run("1 / 0", check=True)
        assert type(raised.value).__name__ == "ZeroDivisionError" and raised.value.ename == "ZeroDivisionError"
        assert "1 / 0" in "".join(raised.value.traceback)
        with pytest.raises(RemoteError, match=r"^no variable named 'nothere' in the machine to pull$"):
            s.run("pass", pull=["nothere"], check=True)
        with pytest.raises(SmolbenchError, match=r"^pull=\['t'\]: a .*Thing is not plain data, so it is not unpickled on this host"):
            s.run("t = Thing()", pull=["t"])
        with pytest.raises(SmolbenchError, match=r"the code ran longer than timeout=0.5 s and was interrupted"):
            s.run("import time; time.sleep(30)", timeout=0.5)
        assert s.run("k").value == 5  # the machine and its state are kept


def test_fork_errors_are_a_composite_error_and_use_moves_the_active_machine(here: Path) -> None:
    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        with pytest.raises(CompositeError, match=r"1 of 3 branches failed \(1 error\); first: \[root\.1\] error: "
                                                 r"ValueError: bad seed"):
            s.fork(3, "if SEED == 1: raise ValueError('bad seed')\nreward = SEED")
        f = s.fork(3, "if SEED == 1: raise ValueError('bad seed')\nreward = SEED", allow_errors=True, seed_base=10)
        assert f.best is not None and f.best["seed"] == 12
        assert s.use("best") == f.best["branch"] == s.active
        assert s.run("SEED").value == 12
        with pytest.raises(SmolbenchError, match=r"^the number of branches must be at least 1, got 0"):
            s.fork(0, "pass")
        e = s.episodes(2, "reward = SEED + 1")
        assert sorted(e.rewards.values()) == [1.0, 2.0]
    assert s.status() == {"up": False, "lost": None} and s.down() == 0
    with pytest.raises(SmolbenchError, match="no machine is up"):
        s.run("1")


def test_async_twins_inside_asyncio_run_do_not_block_the_callers_loop(here: Path) -> None:
    async def main() -> tuple[object, ...]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.create_task(ticker())
        async with smolbench.Session(backend="process", ledger="ledger.db") as s:
            r = await s.arun("base = 7\nbase * 6")
            f = await s.afork(4, "import time; time.sleep(0.5); reward = base + SEED", keep="none")
            during_fork = ticks
            slow = asyncio.create_task(s.arun("import time; time.sleep(60)"))
            await asyncio.sleep(1.0)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            after = await s.arun("base")  # the interrupted machine is still there
            e = await s.aepisodes(2, "reward = SEED")
            kept = await s.afork(2, "v = SEED * 100", keep="all")
            both = await asyncio.gather(*(s.arun("import time; time.sleep(0.3); v", node=n) for n in kept.kept))
            assert [b.value for b in both] == [0, 100] and [b.node for b in both] == kept.kept
            with pytest.raises(SmolbenchError, match=r"^unknown node 'root\.99': live nodes are root, "):
                await s.arun("1", node="root.99")
        tick.cancel()
        return r.value, sorted(f.rewards.values()), during_fork, after.value, sorted(e.rewards.values()), s.is_up

    value, rewards, ticks, after, episodes, up = asyncio.run(main())
    assert value == 42 and rewards == [7.0, 8.0, 9.0, 10.0] and after == 7 and episodes == [0.0, 1.0]
    assert ticks > 10  # the caller's loop kept running while the fork ran on smolbench's
    assert up is False


def test_the_readmes_session_example_runs_as_a_script(tmp_path: Path) -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## A Python API: smolbench.Session", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```python\n(.*?)```", section, re.S)
    if not HAVE_BWRAP:
        example = example.replace('backend="sandbox"', 'backend="process"')
    after = ('print("best", s.last_result.best["branch"], s.active)\n'
             'print("checkpoints", list(smolbench.Ledger(".smolbench/ledger.db").checkpoints()["name"]))\n')
    script = Script(tmp_path, example + after)
    code, out, err = script.finish()
    assert code == 0, err
    assert re.search(r"^best root\.\d+ None$", out, re.M)  # the best branch was used; all down after the block
    assert "checkpoints ['warm']" in out
    assert script.leftovers() == ([], [], [])


def test_checkpoints_status_and_the_current_session_in_a_script_process(here: Path) -> None:
    with pytest.raises(SmolbenchError, match=r"^no session is up: run `%smol up` in the notebook, or start one"):
        smolbench.session()
    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        assert smolbench.session() is s
        s.run("state = [1, 2]")
        info = s.checkpoint_save("two")
        assert info["name"] == "two" and info["node"] == "root" and Path(info["path"]).exists()
        with pytest.raises(SmolbenchError, match=r"^a checkpoint named 'two' exists: pick another name or pass force=True to replace it"):
            s.checkpoint_save("two")
        s.run("state.append(3)")
        node = s.checkpoint_restore("two")
        assert node == s.active and node.endswith("-two")
        assert s.run("state").value == [1, 2]
        st = s.status()
        assert st["up"] and st["backend"] == "process" and st["active"] == node and st["session"]
        with pytest.raises(SmolbenchError, match=r"^no checkpoint named 'nope': saved checkpoints are two"):
            s.checkpoint_restore("nope")
        assert s.delete(node) == [node] and s.active is None
        with pytest.raises(SmolbenchError, match="no machine is up"):
            s.run("1")
        assert s.use("root") == "root" and s.run("state").value == [1, 2, 3]
    with pytest.raises(SmolbenchError, match="no session is up"):
        smolbench.session()


def test_a_first_session_from_a_thread_still_gets_sigterm_handled_once_the_main_thread_starts_one(tmp_path: Path) -> None:
    script = Script(tmp_path, """\
import threading, smolbench
other = threading.Thread(target=lambda: smolbench.Session(backend="process", ledger="other.db").up())
other.start()
other.join()  # a thread can't set a signal handler: this session's machines wait for the main thread's
s = smolbench.Session(backend="process", ledger="ledger.db").up()
print("ready", flush=True)
s.run("import time; time.sleep(600)")
""")
    script.wait_for_line("ready")
    assert len(run_folders(script.tmp)) == 2
    script.proc.send_signal(signal.SIGTERM)
    code, _, err = script.finish()
    assert code == -signal.SIGTERM, err
    assert script.leftovers() == ([], [], [])


def test_a_session_made_only_off_the_main_thread_says_a_sigterm_can_t_clean_up(tmp_path: Path) -> None:
    """A trainer that makes its Session in a worker thread got no SIGTERM handler (Python sets
    them only from the main thread), without a word: a SIGTERM left its machines."""
    script = Script(tmp_path, """\
import threading, smolbench
def work():
    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        s.run("1")
    with smolbench.Session(backend="process", ledger="ledger.db") as s:  # said once
        s.run("2")
t = threading.Thread(target=work)
t.start()
t.join()
print("done", flush=True)
""")
    code, out, err = script.finish()
    assert code == 0 and "done" in out, err
    said = [line for line in err.splitlines() if "off the main thread" in line]
    assert said == ["smolbench: warning: this Session was made off the main thread, where Python can't catch "
                    "SIGTERM: a SIGTERM now ends the program without deleting its machines (its exit and close() "
                    "still do); make a Session in the main thread first, and it catches SIGTERM for every one"], err


@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap is not installed")
def test_checkpoint_restore_takes_the_path_of_a_checkpoint_file_from_elsewhere(here: Path) -> None:
    notes: list[str] = []
    with smolbench.Session(backend="sandbox", ledger="ledger.db", on_notice=notes.append) as s:
        s.run("a = 41")
        saved = Path(s.checkpoint_save("c1")["path"])
        elsewhere = here / "from-a-colleague"
        elsewhere.mkdir()
        shutil.copy(saved, elsewhere / "theirs.smolcheckpoint")
        node = s.checkpoint_restore(str(elsewhere / "theirs.smolcheckpoint"))
        assert s.active == node and s.run("a + 1").value == 42
        assert any("theirs" in n for n in notes), notes  # said how the file was taken in
    with smolbench.Session(backend="process", ledger="other.db") as p:
        with pytest.raises(SmolbenchError, match=r"was not saved in this kernel: its saved state is code, and the "
                                                 r"process backend would run it here with no isolation"):
            p.checkpoint_restore(str(elsewhere / "theirs.smolcheckpoint"))


class _RunsOnTheHost:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"echo ran > {self.marker}",))


def _planted(folder: Path, backend: str, session_id: str) -> None:
    """A copied folder's ledger row naming a checkpoint whose saved state runs a command."""
    import io
    import pickle
    import tarfile

    from smolbench.ledger import Ledger

    store = folder / ".smolbench" / "checkpoints"
    store.mkdir(parents=True)
    with tarfile.open(store / "evil.smolcheckpoint", "w:gz") as tar:
        for name, data in (("namespace.pkl", pickle.dumps(_RunsOnTheHost(folder / "ran-on-the-host"))), ("workspace.tar", b"\0" * 1024)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ledger = Ledger(str(folder / ".smolbench" / "ledger.db"))
    ledger.add_checkpoint("evil", session_id, "root", "checkpoints/evil.smolcheckpoint", backend,
                          (store / "evil.smolcheckpoint").stat().st_size, 0, [])
    ledger.close()


def test_a_copied_ledger_row_claiming_the_process_backend_never_runs_its_state_on_the_host(
        here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Third audit: a row saying backend="process" from someone else's session had its pickle
    loaded by a process machine (the host) when restored; now only this kernel's own are."""
    _planted(here, "process", "someone-else")
    ledger = str(here / ".smolbench" / "ledger.db")
    with smolbench.Session(backend="process", ledger=ledger) as p:
        with pytest.raises(SmolbenchError, match="was not saved in this kernel"):
            p.checkpoint_restore("evil")
    assert not (here / "ran-on-the-host").exists()
    # the same row restored on the sandbox runs its state inside a machine, never here
    with smolbench.Session(backend="sandbox", ledger=ledger) as s:
        with contextlib.suppress(SmolbenchError):
            s.checkpoint_restore("evil")
    assert not (here / "ran-on-the-host").exists()
    # weakened (the row's session taken at its word, and its row as signed): the command runs on the host
    from smolbench import checkpoints
    from smolbench.shelf import Shelf

    monkeypatch.setattr(checkpoints, "SESSIONS_HERE", {"someone-else"})
    monkeypatch.setattr(Shelf, "signed", lambda self, rec: True)
    monkeypatch.setattr(Shelf, "vouch", lambda self, rec, f, backend, *digest: True)
    with smolbench.Session(backend="process", ledger=ledger) as p:
        with contextlib.suppress(SmolbenchError):
            p.checkpoint_restore("evil")
    assert (here / "ran-on-the-host").exists()


def test_what_a_script_left_running_at_its_end_is_recorded_as_it_ended(tmp_path: Path) -> None:
    """The leak hunt: a script that ends with a fork still running (in a thread) had its
    branches recorded as machines that died ("error"); a gym env never closed kept its run
    unfinished and its running episode 'cancelled' with no end time (its return lost). Now
    the exit stops the fork first (its branches 'cancelled', with an end time), and an open
    env's running episode ends as 'closed' with its return."""
    pytest.importorskip("gymnasium")
    if not HAVE_BWRAP:
        pytest.skip("bubblewrap is not installed")
    script = Script(tmp_path, HEAD.format(backend="sandbox") + """\
import threading, time, gymnasium, smolbench.gym
s.up()
env = smolbench.gym.make(lambda: gymnasium.make("CartPole-v1"), session=s, reset="in-place")
env.reset(seed=0)
for _ in range(3):
    env.step(0)
before = set(s.workbench.tree.nodes)
threading.Thread(target=lambda: s.fork(2, "import time; time.sleep(600)", keep="all"), daemon=True).start()
deadline = time.monotonic() + 300  # both branches running: a loaded host takes a while to branch
while time.monotonic() < deadline:
    try:
        running = [n for i, n in list(s.workbench.tree.nodes.items()) if i not in before and n.status == "running"]
    except RuntimeError:  # changed meanwhile
        continue
    if len(running) == 2:
        break
    time.sleep(0.1)
print("ready", flush=True)
""")
    script.wait_for_line("ready")
    code, _, err = script.finish()
    assert code == 0, err
    assert script.leftovers() == ([], [], [])
    led = Ledger(tmp_path / "ledger.db")
    try:
        nodes, runs = led.nodes(), led.runs()
    finally:
        led.close()
    episode = nodes[[isinstance(m, dict) and "ended" in m for m in nodes["metrics"]]]
    assert len(episode) == 1, nodes[["id", "status", "metrics"]]
    row = episode.iloc[0]
    assert row["metrics"]["ended"] == "closed" and row["reward"] == 3.0 and row["ended"] > 0, row
    gym_run = runs[runs["id"] == row["run_id"]].iloc[0]
    assert gym_run["status"] == "done" and gym_run["ended"] > 0, gym_run  # the env's run is ended too
    forked = nodes[(nodes["parent_id"] == "root") & (nodes["id"] != row["parent_id"])]  # not the env's warm parent
    assert len(forked) == 2 and set(forked["status"]) == {"cancelled"} and forked["ended"].notna().all(), forked


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_gymnasium_id_made_from_a_script_steps_and_leaves_nothing_behind(tmp_path: Path, backend: str) -> None:
    """``smolbench.gym.make("CartPole-v1", session=s)`` in a plain script: its steps are
    gymnasium's own CartPole's, and the session's end leaves no process, run folder or cgroup."""
    pytest.importorskip("gymnasium")
    script = Script(tmp_path, f"""\
import gymnasium, smolbench, smolbench.gym
with smolbench.Session(backend={backend!r}, ledger="ledger.db") as s:
    env = smolbench.gym.make("CartPole-v1", session=s)
    here = gymnasium.make("CartPole-v1")
    same = [bool((env.reset(seed=5)[0] == here.reset(seed=5)[0]).all())]
    for action in (0, 1, 1, 0):
        same.append(bool((env.step(action)[0] == here.step(action)[0]).all()))
    print("same", all(same), env.spec.id, flush=True)
""")
    code, out, err = script.finish()
    assert code == 0, err
    assert "same True CartPole-v1" in out, out + err
    assert script.leftovers() == ([], [], [])


def test_a_session_started_after_the_main_thread_ended_is_refused_in_one_line(tmp_path: Path) -> None:
    """The leak hunt: a Session started in a thread after the main thread returned could not
    register its exit hook ("can't register atexit after shutdown"), and every later session
    of that process then ran with none. Nothing would delete its machines: it is refused."""
    script = Script(tmp_path, HEAD.format(backend="process") + """\
import threading, time
def late():
    threading.main_thread().join(60)  # the main thread has ended
    try:
        with smolbench.Session(backend="process", ledger="late.db") as late_session:
            print("started", flush=True)
    except smolbench.SmolbenchError as exc:
        print("refused:", exc, flush=True)
threading.Thread(target=late).start()
""")
    code, out, err = script.finish()
    assert code == 0, err
    assert "refused: this program is exiting (its main thread ended): a Session can't start now" in out, out
    assert script.leftovers() == ([], [], [])


def test_a_programs_own_sighup_handler_is_left_alone(tmp_path: Path) -> None:
    """The review: SIGHUP was taken over a program's own handler (a daemon's "reload"): its
    machines were deleted and the program went on without them."""
    script = Script(tmp_path, HEAD.format(backend="process") + """\
signal.signal(signal.SIGHUP, lambda *_: print("reloaded", flush=True))
with s:
    os.kill(os.getpid(), signal.SIGHUP)
    print("still up:", s.run("print(6 * 7)").stdout.strip(), flush=True)
""")
    code, out, err = script.finish()
    assert code == 0, err
    assert "reloaded" in out and "still up: 42" in out, out + err
    assert script.leftovers() == ([], [], [])


# A Ctrl-C that lands while the root machine is made (inside the backend's create: its proxy
# and cgroups made, its process started) or once it is up (its state remembered, just before
# up() returns). Delivered as a real SIGINT to the script's main thread, as a terminal's is.
CTRL_C_DURING_UP = """\
import asyncio, os, signal, smolbench
from smolbench.backends.sandbox import SandboxBackend
from smolbench.workbench import Workbench
WHERE = {where!r}

def ctrl_c_here(cls, name):
    orig = getattr(cls, name)
    async def patched(self, *args, **kwargs):
        out = await orig(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(30)
        return out
    setattr(cls, name, patched)

ctrl_c_here(*{{"create": (SandboxBackend, "create"), "up": (Workbench, "_remember_state")}}[WHERE])
s = smolbench.Session(backend="sandbox", ledger="ledger.db", net="on")
try:
    s.up()
except KeyboardInterrupt:
    print("interrupted", s.is_up, flush=True)
"""


@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap is not installed")
@pytest.mark.parametrize("where", ["create", "up"])
def test_a_ctrl_c_during_up_leaves_nothing_behind(tmp_path: Path, where: str) -> None:
    """Third audit: a Ctrl-C while the machine was made, or just after, ended up() with its
    machine, egress proxy and cgroups left running (and `%smol up` said nothing was left)."""
    script = Script(tmp_path, CTRL_C_DURING_UP.format(where=where))
    code, out, err = script.finish()
    try:
        assert code == 0 and "interrupted False" in out, err
        assert script.leftovers() == ([], [], [])
    finally:
        script.clean()


def test_a_fork_in_a_non_daemon_thread_finishes_when_the_main_thread_returns_first(tmp_path: Path) -> None:
    """Third audit: Python runs its exit hooks before it joins the program's own threads, and
    ours cancelled a fork running in one ("stopped by SIGTERM"). It now waits for them first."""
    backend = "sandbox" if HAVE_BWRAP else "process"
    script = Script(tmp_path, HEAD.format(backend=backend) + """\
import threading
s.up()
def work():
    r = s.fork(2, "import time; time.sleep(2); reward = SEED", keep="none")
    print("forked", sorted(b["status"] for b in r), flush=True)
threading.Thread(target=work).start()
print("main returns", flush=True)
""")
    code, out, err = script.finish()
    assert code == 0 and "forked ['ok', 'ok']" in out, (out, err)
    assert "SIGTERM" not in err, err
    assert script.leftovers() == ([], [], [])
