"""Issue 3 end to end: `%%smol fork N` / `%%smol episodes N`, the ledger and replay.

Every test drives a real ipykernel through nbclient; machines run on the bubblewrap
sandbox backend. Every kernel's machines are tracked by a tag in its environment
(see ``nbhelpers``): when a test's kernel shuts down (or is killed), none may remain.

Branches that must run at the same time meet at a barrier in a shared Smolfile volume
(``/gate``, the test's ``gate`` directory), and tests wait for states in the ledger
rather than for time to pass.
"""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from nbclient.exceptions import DeadKernelError
from nbformat import NotebookNode
from nbhelpers import (
    NotebookSession,
    error_output,
    error_text,
    plain_texts,
    result_text,
    run_notebook,
    stream_text,
    wait_for_no_processes,
)

import smolbench
from smolbench import Ledger

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

SMOLFILE = 'volumes = [{ host = "gate", guest = "/gate", readonly = false }]\n'
UP = ("%load_ext smolbench", "%smol up --backend sandbox")
AGENT = "/run/smolbench-agent/agent.py"

# Inside a machine: wait until `n` files named PREFIX* exist in /gate (all branches got here).
BARRIER = """
def barrier(prefix, n, name):
    import os, time
    open('/gate/' + prefix + name, 'w').close()
    deadline = time.monotonic() + 60
    while sum(f.startswith(prefix) for f in os.listdir('/gate')) < n:
        assert time.monotonic() < deadline, 'the other branches never arrived'
        time.sleep(0.01)
"""


def workdir(tmp_path: Path) -> Path:
    """A notebook directory with a Smolfile that shares ./gate with its machines
    (``tmp_path`` must be reachable by the sandbox uid: the ``open_tmp`` fixture)."""
    (tmp_path / "gate").mkdir()
    (tmp_path / "gate").chmod(0o777)  # machines run as their own unprivileged uid
    (tmp_path / "Smolfile").write_text(SMOLFILE)
    return tmp_path


@pytest.fixture
def session(open_tmp: Path) -> Iterator[NotebookSession]:
    """A kernel in a fresh notebook directory with a machine up (allow_errors: tests read the errors)."""
    with NotebookSession(workdir(open_tmp), allow_errors=True) as nb:
        for source in UP:
            ok(nb.run(source))
        yield nb


def ok(cell: NotebookNode) -> NotebookNode:
    """The cell, after checking it raised nothing."""
    err = error_output(cell)
    assert err is None, f"{cell.source!r} raised {err.ename}: {err.evalue}\n{error_text(cell)}"
    return cell


def failed(cell: NotebookNode) -> NotebookNode:
    """The cell's error output (the cell must have raised)."""
    err = error_output(cell)
    assert err is not None, f"{cell.source!r} did not raise; outputs: {cell.outputs}"
    return err


def json_out(cell: NotebookNode) -> Any:
    """What the cell printed as JSON on its last stdout line."""
    return json.loads(stream_text(ok(cell)).strip().splitlines()[-1])


def rows(nb: NotebookSession, name: str) -> dict[str, dict[str, Any]]:
    """A ForkResult stored in the notebook (``--out name``), as {branch: row} via to_pandas()."""
    recs = json_out(nb.run(f"import json\nprint(json.dumps({name}.to_pandas().to_dict('records'), default=str))"))
    return {r["branch"]: r for r in recs}


def nodes(cwd: Path, table: str = "nodes") -> pd.DataFrame:
    """A table of the ledger beside the notebook (nodes by id, or runs), read from this process."""
    ledger = Ledger(cwd / ".smolbench" / "ledger.db")
    try:
        return ledger.nodes().set_index("id") if table == "nodes" else ledger.runs()
    finally:
        ledger.close()


def wait_for_ledger(cwd: Path, ready: Callable[[pd.DataFrame], bool], timeout: float = 60) -> pd.DataFrame:
    """Poll the ledger until ``ready(nodes)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        if (cwd / ".smolbench" / "ledger.db").exists():
            df = nodes(cwd)
            if not df.empty and "status" in df and ready(df):
                return df
        assert time.monotonic() < deadline, "the ledger never reached the expected state"
        time.sleep(0.05)


def count(df: pd.DataFrame, prefix: str, status: str) -> int:
    """How many nodes whose id starts with ``prefix`` have ``status``."""
    return int(((df.index.str.startswith(prefix)) & (df["status"] == status)).sum())


def branch_lines(text: str) -> list[str]:
    """The lines of a stream that came from branches (``[root.3] ...``), in order."""
    return [ln for ln in text.splitlines() if ln.startswith("[root.")]


def agents(nb: NotebookSession) -> int:
    """How many guest agents (machines and branches) this kernel has running. A contained
    machine is two processes with the agent's command line: its keeper and its agent,
    which is pid 1 of the machine's own pid namespace."""
    return sum(AGENT in p.cmdline and not p.cmdline.split()[0].endswith("bwrap") and _pid_ns_init(p.pid)
               for p in nb.processes())


def _pid_ns_init(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
    return bool(nspid) and nspid[-1] == "1"


# -- fork: seeds, warm state, isolation, rewards, ledger ----------------------------------------


def test_fork_8_branches_share_warm_state_but_not_changes_and_are_seeded(session: NotebookSession) -> None:
    nb, cwd = session, session.cwd
    ok(nb.run("%%smol\nimport os, random\nimport numpy as np\nwarm = 7\nitems = ['parent']\n"
              "open('notes.txt', 'w').write('parent\\n')" + BARRIER))
    ok(nb.run("factor = 3"))
    code = ("import os, smolbench_guest\n"
            "items.append(SEED)\n"
            "open('notes.txt', 'a').write(f'{SEED}\\n')\n"
            "barrier('wrote-', 8, str(SEED))  # every branch has changed its variable and its file\n"
            "print('seed', SEED)\n"
            "smolbench_guest.report(reward=SEED * factor + warm, steps=SEED % 5, items=len(items),\n"
            "                       lines=len(open('notes.txt').read().split()), env=os.environ['SMOLBENCH_SEED'],\n"
            "                       node=smolbench_guest.node)")
    cell = ok(nb.run(f"%%smol fork 8 --seed-base 100 --concurrency 8 --push factor --out res\n{code}"))

    res = rows(nb, "res")
    assert sorted(res) == [f"root.{i}" for i in range(8)]
    for i in range(8):
        r, seed = res[f"root.{i}"], 100 + i
        assert (r["seed"], r["status"]) == (seed, "ok")
        assert r["reward"] == seed * 3 + 7  # warm state (warm) + pushed value (factor) + its own SEED
        assert r["m.steps"] == seed % 5 and r["m.env"] == str(seed) and r["m.node"] == f"root.{i}"
        # after all 8 wrote, each still sees only the parent's entry and its own
        assert r["m.items"] == 2 and r["m.lines"] == 2
        assert f"seed {seed}" in r["output"] and r["wall"] > 0
    out = stream_text(cell)
    for i in range(8):
        assert f"[root.{i}] seed {100 + i}\n" in out  # per-branch prefixed stream
    shown = plain_texts(cell)
    assert "fork: 8/8 done (8 ok)" in shown  # the progress line, as last updated
    assert shown[-1].startswith("fork of 8 · 8 ok · best reward 328 on root.7 (seed 107)")
    assert "kept alive: root.7" in shown[-1]

    # the parent saw none of the branches' changes
    assert result_text(ok(nb.run("%%smol\nitems, open('notes.txt').read().split()"))) == "(['parent'], ['parent'])"

    # random and numpy are seeded per branch: the same seed gives the same draws
    cell = ok(nb.run("%%smol fork 2 --seeds 5,5 --out same\nimport smolbench_guest\nreward = random.random()\n"
                     "smolbench_guest.report(draw=float(np.random.rand()))"))
    assert "warning: --seeds repeats a seed" in stream_text(cell, "stderr")
    same = rows(nb, "same")
    assert [r["seed"] for r in same.values()] == [5, 5]
    assert {r["reward"] for r in same.values()} == {random.Random(5).random()}
    assert {r["m.draw"] for r in same.values()} == {float(np.random.RandomState(5).rand())}

    # the ledger, read from outside the kernel: one row per branch, written as it ran
    df = nodes(cwd)
    for i in range(8):
        row = df.loc[f"root.{i}"]
        assert (row.parent_id, row.machine, row.backend, row.seed, row.status) == ("root", f"root.{i}", "sandbox", 100 + i, "ok")
        assert row.reward == (100 + i) * 3 + 7 and row.metrics["steps"] == (100 + i) % 5
        assert row.code.rstrip("\n") == code and row.code_hash == smolbench.ledger.code_hash(row.code)
        assert row.pushed == ["factor"]
        assert row.baseline and row.started <= row.ended and f"seed {100 + i}" in row.output
        assert row.versions["smolbench"] == smolbench.__version__ and row.versions["guest_python"].startswith("3.")
        assert "smolmachines" in row.versions
        assert (row.alive, row.kept) == ((1, 1) if i == 7 else (0, 0))  # --keep best (the default)
    assert df.loc["root"].versions == df.loc["root.0"].versions
    ledger_view = result_text(ok(nb.run("%smol ledger -n 30")))
    assert ledger_view is not None and "root.7" in ledger_view and "parent_id" in ledger_view
    assert agents(nb) == 3  # root, root.7 and root.8 (the kept best of each fork)


# -- nesting, keep policies, tree, replay ----------------------------------------------------------


def test_nested_forks_to_depth_3_with_keep_policies_tree_and_replay(session: NotebookSession) -> None:
    nb, cwd = session, session.cwd
    ok(nb.run("%%smol\nimport random\nbase = 1000"))
    cell = ok(nb.run("%%smol fork 4 --seed-base 10 --group-outputs branch\nscore = base + SEED\n"
                     "print('a', SEED)\nprint('b', SEED)\nreward = score + random.random()"))
    assert stream_text(cell) == "".join(f"[root.{i}] a {10 + i}\n[root.{i}] b {10 + i}\n" for i in range(4))  # grouped by branch
    assert "active machine is now root.3 (seed 13" in stream_text(ok(nb.run("%smol use root.3")))
    cell = ok(nb.run("%%smol fork 3 --group-outputs type\nimport sys\nscore = score * 10 + SEED\n"
                     "print('out', SEED)\nprint('err', SEED, file=sys.stderr)\nreward = score + random.random()"))
    assert branch_lines(stream_text(cell)) == [f"[root.3.{i}] out {i}" for i in range(3)]  # grouped by stream
    assert branch_lines(stream_text(cell, "stderr")) == [f"[root.3.{i}] err {i}" for i in range(3)]
    ok(nb.run("%smol use root.3.2"))
    ok(nb.run("%%smol fork 2 --keep all\nscore = score * 10 + SEED\nreward = score + random.random()"))

    tree = plain_texts(ok(nb.run("%smol tree")))[-1]  # the static copy as text
    assert [ln for ln in tree.splitlines() if "<- active" in ln] == [next(ln for ln in tree.splitlines() if "root.3.2  seed=2  ok" in ln)]
    assert "   ├─ root.3.2.0  seed=0  ok" in tree and "   └─ root.3.2.1  seed=1  ok" in tree

    df = nodes(cwd)
    expect = {"root.3": "root", "root.3.0": "root.3", "root.3.2": "root.3", "root.3.2.0": "root.3.2", "root.3.2.1": "root.3.2"}
    assert {k: df.loc[k].parent_id for k in expect} == expect
    deepest = df.loc["root.3.2.1"]
    assert deepest.name.count(".") == 3 and deepest.reward == pytest.approx(1013 * 100 + 2 * 10 + 1, abs=1)
    alive = {i for i in df.index if df.loc[i].alive}
    assert alive == {"root", "root.3", "root.3.2", "root.3.2.0", "root.3.2.1"}  # best, best, all

    # replay from the nearest live ancestor reproduces the (seeded-random) reward exactly
    out = stream_text(ok(nb.run("%smol replay root.3.2.1")))
    recorded = float(deepest.reward)
    assert f"replay of root.3.2.1: reward {recorded!r} vs recorded {recorded!r}: identical" in out

    # --keep none leaves nothing alive; replay still works from a checkpoint once every ancestor is gone
    ok(nb.run("%smol checkpoint save mid --node root.3.2"))
    ok(nb.run("%smol use root"))
    ok(nb.run("%%smol fork 2 --keep none\nreward = SEED"))
    assert not nodes(cwd).loc[["root.4", "root.5"]].alive.any()
    assert "deleted root.3.2.1, root.3.2.0, root.3.2, root.3" in stream_text(ok(nb.run("%smol delete root.3")))
    ok(nb.run("%smol delete root"))
    assert agents(nb) == 0
    out = stream_text(ok(nb.run("%smol replay root.3.2.1")))
    assert "identical (started from checkpoint mid)" in out
    err = failed(nb.run("%smol replay root.3.1"))
    assert err.ename == "SmolbenchError" and err.evalue.startswith(
        "can't replay root.3.1: no ancestor is alive and none has a checkpoint")
    assert len(err.traceback) == 1


# -- failures, timeouts, concurrency -------------------------------------------------------------


FAILURE_MIX = """\
import os, time
if SEED == 0:
    raise ValueError('bad seed %d' % SEED)
if SEED == 1:
    os._exit(3)
if SEED == 2:
    time.sleep(60)
if SEED == 3:
    1 / 0
reward = float('nan') if SEED == 4 else SEED * 10
print('finished', SEED)
"""


def test_failing_branches_are_reported_together_and_the_rest_succeed(session: NotebookSession) -> None:
    nb, cwd = session, session.cwd
    cell = nb.run(f"%%smol fork 8 --timeout 2 --concurrency 2 --keep none --out res\n{FAILURE_MIX}")
    res = rows(nb, "res")
    status = {b: r["status"] for b, r in res.items()}
    assert status == {"root.0": "error", "root.1": "error", "root.2": "timeout", "root.3": "error",
                      "root.4": "error", "root.5": "ok", "root.6": "ok", "root.7": "ok"}
    assert [res[f"root.{i}"]["reward"] for i in (5, 6, 7)] == [50, 60, 70]
    assert "reward must be a finite number within +-1e300, got nan" in res["root.4"]["error"]

    err = failed(cell)
    assert err.ename == "CompositeError"
    assert err.evalue == "5 of 8 branches failed (4 error, 1 timeout); first: [root.0] error: ValueError: bad seed 0"
    text = error_text(cell)
    assert "[root.0] Traceback (most recent call last) inside the machine:" in text
    # the notebook cell's number with the branch's name, and the editor's line (%%smol is line 1)
    count = cell.execution_count
    assert f'File "<In [{count}]@root.0>", line 4, in <module>' in text
    assert "raise ValueError('bad seed %d' % SEED)" in text and "ValueError: bad seed 0" in text
    assert "[root.1] error: machine root.1 died mid-cell" in text  # os._exit(3)
    assert "[root.2] timeout: timed out after 2 s" in text
    assert "1 / 0" in text and "ZeroDivisionError: division by zero" in text
    assert text.rstrip().endswith("... 1 more (root.4)")  # the first 4 failures are shown, the rest named
    assert "smolbench/" not in text  # no frames of our own layers
    assert "fork of 8 · 4 error · 3 ok · 1 timeout" in plain_texts(cell)[-1]

    df = nodes(cwd)
    branches = df.loc[[f"root.{i}" for i in range(8)]]
    assert list(branches.status) == list(status.values()) and not branches.alive.any()
    # --concurrency 2: at no moment were more than 2 branches running
    edges = sorted([(t, 1) for t in branches.started] + [(t, -1) for t in branches.ended])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    assert peak <= 2
    assert agents(nb) == 1  # crashed, timed-out and finished branches are all gone; the parent lives
    assert result_text(ok(nb.run("%%smol\n'parent fine'"))) == "'parent fine'"


# -- Ctrl-C -----------------------------------------------------------------------------------------


def interrupt_when(nb: NotebookSession, ready: Callable[[pd.DataFrame], bool]) -> threading.Thread:
    """Ctrl-C the kernel (from another thread) once the ledger shows ``ready``."""
    def go() -> None:
        try:
            wait_for_ledger(nb.cwd, ready)
        finally:  # interrupt even if the wait failed, so the cell can't hang
            nb.interrupt()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_ctrl_c_cancels_every_branch_and_episode_and_cleans_up(session: NotebookSession) -> None:
    nb, cwd = session, session.cwd
    # two branches run, two wait for a slot: all four are cancelled
    t = interrupt_when(nb, lambda df: count(df, "root.", "running") == 2)
    cell = nb.run("%%smol fork 4 --concurrency 2\nimport time\nprint('started', SEED, flush=True)\ntime.sleep(60)\nreward = 1")
    t.join()
    assert failed(cell).ename == "KeyboardInterrupt"
    assert "smolbench: interrupted: fork of 4 · 4 cancelled" in stream_text(cell, "stderr")
    df = nodes(cwd)
    assert list(df.loc[[f"root.{i}" for i in range(4)]].status) == ["cancelled"] * 4
    assert not df.loc[[f"root.{i}" for i in range(4)]].alive.any()
    assert nodes(cwd, "runs").status.tolist() == ["cancelled"]
    assert agents(nb) == 1  # only the parent: nothing left running
    assert result_text(ok(nb.run("%%smol\n'still here'"))) == "'still here'"

    t = interrupt_when(nb, lambda df: count(df, "ep", "running") == 2)
    cell = nb.run("%%smol episodes 2\nimport time\ntime.sleep(60)")
    t.join()
    assert failed(cell).ename == "KeyboardInterrupt"
    eps = nodes(cwd).loc[["ep2.0", "ep2.1"]]
    assert list(eps.status) == ["cancelled"] * 2 and not eps.alive.any()
    assert agents(nb) == 2  # the root and the episodes' zygote


# -- kill -9 of the kernel ------------------------------------------------------------------------


def test_kill_9_of_the_kernel_keeps_finished_branches_and_takes_the_machines_along(open_tmp: Path) -> None:
    cwd = workdir(open_tmp)
    with NotebookSession(cwd, allow_errors=True) as nb:
        for source in UP:
            ok(nb.run(source))

        before_kill: list[int] = []

        def kill_when_half_done() -> None:
            try:
                wait_for_ledger(cwd, lambda df: count(df, "root.", "ok") == 3 and count(df, "root.", "running") == 3)
                before_kill.append(agents(nb))
            finally:
                nb.kill()

        t = threading.Thread(target=kill_when_half_done, daemon=True)
        t.start()
        with pytest.raises(DeadKernelError):
            nb.run("%%smol fork 6 --concurrency 6\nimport time\ntime.sleep(0 if SEED < 3 else 60)\nreward = SEED + 0.5")
        t.join()
        assert before_kill == [7]  # the parent and six branches were running
        assert wait_for_no_processes(nb.tag) == []  # bwrap --die-with-parent: the sandbox died with its kernel
    df = nodes(cwd)
    for i in range(3):
        assert (df.loc[f"root.{i}"].status, df.loc[f"root.{i}"].reward) == ("ok", i + 0.5)
    assert set(df.loc[["root.3", "root.4", "root.5"]].status) == {"running"}  # what was known at the crash


# -- --bg --------------------------------------------------------------------------------------------


def test_background_fork_progresses_while_the_notebook_runs_other_cells(session: NotebookSession) -> None:
    nb = session
    wait_gate = "import os, time\nwhile not os.path.exists('/gate/{name}'):\n    time.sleep(0.01)\n"
    cell = ok(nb.run("%%smol fork 4 --bg --out h\n" + wait_gate.format(name="go") + "reward = SEED * 2"))
    assert "running in the background" in stream_text(cell)
    assert (result_text(cell) or "").startswith("fork of 4 · ")  # the handle, returned at once
    assert stream_text(ok(nb.run("print(h.done(), h.progress)"))) == "False (0, 4)\n"
    out = json_out(nb.run(
        "import json, time\n"
        "seen, deadline = [h.progress[0]], time.monotonic() + 60\n"
        "open('gate/go', 'w').close()  # let the branches finish, and watch them from this cell\n"
        "while not h.done() and time.monotonic() < deadline:\n"
        "    seen.append(h.progress[0])\n"
        "    time.sleep(0.005)\n"
        "h.wait(60)\n"
        "print(json.dumps([h.done(), h.progress, seen, sorted(h.rewards.values()), h.kept]))"))
    done, progress, seen, rewards, kept = out
    assert done is True and progress == [4, 4] and rewards == [0, 2, 4, 6] and kept == ["root.3"]
    assert seen[0] == 0 and seen == sorted(seen)  # this cell ran while the fork progressed to done

    # .cancel(): every branch is cancelled and deleted, and .wait() returns the result
    ok(nb.run("%%smol fork 3 --bg --out h2\n" + wait_gate.format(name="never") + "reward = 1"))
    out = json_out(nb.run(
        "import json, time\n"
        "deadline = time.monotonic() + 60\n"
        "while any(r['status'] != 'running' for r in h2) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "h2.cancel()\n"
        "h2.wait(60)\n"
        "print(json.dumps([h2.done(), h2.counts()]))"))
    assert out == [True, {"cancelled": 3}]
    df = nodes(nb.cwd)
    assert set(df.loc[["root.4", "root.5", "root.6"]].status) == {"cancelled"}
    assert not df.loc[["root.4", "root.5", "root.6"]].alive.any()
    assert agents(nb) == 2  # the parent and the kept best of the first fork


# -- episodes ----------------------------------------------------------------------------------------


def test_episodes_run_in_fresh_machines_that_are_always_deleted(session: NotebookSession) -> None:
    nb, cwd = session, session.cwd
    ok(nb.run("%%smol\nwarm = 1"))
    cell = ok(nb.run(
        "%%smol episodes 4 --seed-base 10 --out eps\n"
        "import os, socket, smolbench_guest\n"
        "reward = SEED * 3 + (1000 if 'warm' in globals() else 0)  # a fresh machine: no warm state\n"
        "smolbench_guest.report(host=socket.gethostname(), env=os.environ['SMOLBENCH_SEED'])"))
    assert plain_texts(cell)[-1].startswith("episodes of 4 · 4 ok · best reward 39 on ep1.3 (seed 13)")
    eps = rows(nb, "eps")
    # each a branch of the baseline's pristine zygote (issue 27; tests/test_episodes.py): its host name
    assert {b: (r["seed"], r["reward"], r["m.host"], r["m.env"]) for b, r in eps.items()} == {
        f"ep1.{i}": (10 + i, (10 + i) * 3, "smol-zygote1", str(10 + i)) for i in range(4)}
    df = nodes(cwd).loc[[f"ep1.{i}" for i in range(4)]]
    assert list(df.status) == ["ok"] * 4 and list(df.seed) == [10, 11, 12, 13]
    assert df.parent_id.isna().all() and not df.alive.any()
    assert agents(nb) == 2  # each episode's machine was deleted: the root and the zygote are left

    # deleted on the failure paths too
    cell = nb.run("%%smol episodes 2 --seeds 1,2 --timeout 2 --allow-errors --out bad\nimport time\n"
                  "if SEED == 1:\n    raise RuntimeError('episode failed')\ntime.sleep(60)")
    assert error_output(cell) is None  # --allow-errors
    assert {b: r["status"] for b, r in rows(nb, "bad").items()} == {"ep2.0": "error", "ep2.1": "timeout"}
    assert not nodes(cwd).loc[["ep2.0", "ep2.1"]].alive.any()
    assert agents(nb) == 2

    assert "replay of ep1.2: reward 36.0 vs recorded 36.0: identical" in stream_text(ok(nb.run("%smol replay ep1.2")))
    assert agents(nb) == 2


# -- bad input: one line that names the problem and the fix -------------------------------------------

# (case id, cell, exception name, text its evalue must contain); run in this order in one kernel.
BEFORE_UP = [
    ("fork-with-no-machine", "%%smol fork 2\nreward = 1", "SmolbenchError", "no machine is up: run `%smol up` first"),
    ("episodes-with-no-machine", "%%smol episodes 2\nreward = 1", "SmolbenchError", "no machine is up: run `%smol up` first"),
    ("use-with-no-machine", "%smol use root.1", "SmolbenchError", "no machine is up: run `%smol up` first"),
]
AFTER_UP = [
    ("fork-0", "%%smol fork 0\nreward = 1", "SmolbenchError",
     "the number of branches must be at least 1, got 0: e.g. `%%smol fork 16`"),
    ("fork-negative", "%%smol fork -1\nreward = 1", "SmolbenchError",
     "the number of branches must be at least 1, got -1: e.g. `%%smol fork 16`"),
    ("fork-above-cap", "%%smol fork 100000\nreward = 1", "SmolbenchError",
     "100000 branches is above the cap of 1024: fork fewer, or fork in stages with `%smol use`"),
    ("fork-not-a-number", "%%smol fork many\nreward = 1", "SmolbenchError",
     "the number of branches must be a whole number, got 'many': e.g. `%%smol fork 16`"),
    ("fork-fraction", "%%smol fork 2.5\nreward = 1", "SmolbenchError",
     "the number of branches must be a whole number, got '2.5'"),
    ("episodes-0", "%%smol episodes 0\nreward = 1", "SmolbenchError",
     "the number of branches must be at least 1, got 0: e.g. `%%smol episodes 16`"),
    ("too-few-seeds", "%%smol fork 3 --seeds 1,2\nreward = 1", "SmolbenchError",
     "--seeds gives 2 seeds for 3 branches: give at least 3 (e.g. --seeds 0:3)"),
    ("too-few-seeds-range", "%%smol fork 4 --seeds 0:2\nreward = 1", "SmolbenchError",
     "--seeds gives 2 seeds for 4 branches: give at least 4"),
    ("seeds-and-seed-base", "%%smol fork 2 --seeds 3,4 --seed-base 0\nreward = 1", "SmolbenchError",
     "give --seeds or --seed-base, not both: --seeds sets every branch's seed, so --seed-base 0 would be ignored; "
     "drop one of them"),
    ("timeout-0", "import smolbench\nsmolbench._magics.workbench.new_fork(2, timeout=0)", "SmolbenchError",
     "--timeout must be a positive number of seconds, got 0: e.g. --timeout 30"),
    ("reward-nan", "%%smol fork 1\nreward = float('nan')", "CompositeError",
     "[root.0] error: reward must be a finite number within +-1e300, got nan"),
    ("reward-inf-reported", "%%smol fork 1\nimport smolbench_guest\nsmolbench_guest.report(reward=float('inf'))",
     "CompositeError", "[root.1] error: reward must be a finite number within +-1e300, got inf"),
    ("reward-not-a-number", "%%smol fork 1\nreward = 'high'", "CompositeError",
     "[root.2] error: reward must be a finite number, got 'high'"),
    ("use-unknown-node", "%smol use root.42", "SmolbenchError",
     "unknown node 'root.42': live nodes are root (see `%smol tree`)"),
    ("use-deleted-node", "%smol use root.0", "SmolbenchError",
     "node 'root.0' was deleted: use a live node, or `%smol replay root.0` to rebuild it"),
]
AFTER_DOWN = [
    ("fork-after-down", "%%smol fork 2\nreward = 1", "SmolbenchError", "no machine is up: run `%smol up` first"),
]
BAD_INPUTS = BEFORE_UP + AFTER_UP + AFTER_DOWN


@pytest.fixture(scope="module")
def bad_input_cells(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NotebookNode]:
    """Every bad input, run once in one kernel: {case id: executed cell}."""
    steps = [(None, UP[0]), *[(c[0], c[1]) for c in BEFORE_UP], (None, UP[1]), *[(c[0], c[1]) for c in AFTER_UP],
             (None, "%smol down"), *[(c[0], c[1]) for c in AFTER_DOWN]]
    nb = run_notebook([source for _, source in steps], tmp_path_factory.mktemp("bad-input"), allow_errors=True)
    for (case, _), cell in zip(steps, nb.cells):
        if case is None:
            ok(cell)
    return {case: cell for (case, _), cell in zip(steps, nb.cells) if case is not None}


@pytest.mark.parametrize(("case", "source", "ename", "text"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_a_one_line_error(bad_input_cells: dict[str, NotebookNode], case: str, source: str,
                                         ename: str, text: str) -> None:
    err = failed(bad_input_cells[case])
    assert err.ename == ename
    assert text in err.evalue and "\n" not in err.evalue
    if ename == "SmolbenchError":
        assert len(err.traceback) == 1  # just the message: no traceback of our layers
    else:  # the branch's failure, listed under the one-line summary; no frames of ours (or the machine's)
        assert "Traceback" not in error_text(bad_input_cells[case]) and "File " not in error_text(bad_input_cells[case])


def test_a_replay_that_fails_says_the_machine_s_error_on_one_line(tmp_path: Path) -> None:
    """The machine's exception name and text went into a replay's error as they were: a line
    break or an escape sequence there reached the notebook's output as smolbench's own line."""
    import smolbench
    from smolbench._session import _block
    from smolbench.errors import SmolbenchError

    with smolbench.Session(backend="sandbox", ledger=tmp_path / ".smolbench" / "ledger.db") as s:
        fork = s.fork(1, "if 'changed' in globals():\n    raise ValueError('a\\nsmolbench: forged\\x1b[2J')\nreward = 1",
                      keep="all")
        branch = next(iter(fork.rows))
        s.run("changed = True").raise_for_error()  # the replay starts from root as it is now: the cell fails
        assert s.workbench is not None
        with pytest.raises(SmolbenchError) as err:
            _block(s.workbench.replay(branch, lambda *_: None))
    line = str(err.value)
    assert line.startswith(f"replay of {branch} failed in a recorded cell: ValueError: a")
    assert "\n" not in line and "\x1b" not in line, line
