"""The notebooks in ``notebooks/`` run end to end in a real ipykernel, on the sandbox backend.

Each notebook is copied into a temporary working directory, its ``%smol up`` line gets
``--backend sandbox`` (the committed notebooks say plain ``%smol up``: on a KVM host users
get microVMs), and nbclient executes it. Only cells tagged ``raises-exception`` (the
errors a notebook shows on purpose) may have an error output; a few key facts are then
read back from each notebook's outputs, and no machine may outlive the kernel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat import NotebookNode
from nbhelpers import (
    TAG_VAR,
    error_output,
    plain_texts,
    result_text,
    stream_text,
    wait_for_no_processes,
)

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = ["01_quickstart.ipynb", "02_fork_exploration.ipynb", "03_disposable_episodes.ipynb", "04_checkpoints.ipynb",
             "05_scale_out.ipynb", "06_teaching.ipynb", "07_training.ipynb"]
RAISES = "raises-exception"  # nbclient's tag for a cell whose error is expected
TIME_BUDGET_S = 120.0  # each notebook, kernel start included, on a 2-core machine
# 05 starts a four-process Ray cluster first (60-90 s on a busy 2-core host); 07 trains on 4 machines, a branch per episode
BUDGETS = {"05_scale_out.ipynb": 360.0, "07_training.ipynb": 300.0}
CELL_TIMEOUT_S = 120
UPS = {"05_scale_out.ipynb": "%smol up --ray {cluster.address}",  # joins the cluster it starts, not another run's (no Smolfile left behind)
       "06_teaching.ipynb": "%smol up --backend sandbox"}  # a checkpoint travels as one file on the sandbox

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")


# -- running a notebook -----------------------------------------------------------------


def on_sandbox(nb: NotebookNode) -> int:
    """Point every ``%smol up`` at the sandbox backend; returns how many lines changed."""
    changed = 0
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.lstrip().startswith("%smol up"):
            cell.source = cell.source.replace("%smol up", "%smol up --backend sandbox", 1)
            changed += 1
    return changed


def execute(name: str, workdir: Path) -> tuple[NotebookNode, float]:
    """Run notebook ``name`` in ``workdir``; return it executed, and how long it took."""
    path = workdir / name
    shutil.copy(NOTEBOOKS_DIR / name, path)
    nb = nbformat.read(path, as_version=4)
    assert on_sandbox(nb) >= 1, f"{name} has no `%smol up` cell"
    tag = uuid.uuid4().hex
    client = NotebookClient(nb, timeout=int(BUDGETS.get(name, CELL_TIMEOUT_S)), kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    t0 = time.perf_counter()
    try:
        client.execute(env={**os.environ, TAG_VAR: tag})
    finally:
        left = wait_for_no_processes(tag)
    took = time.perf_counter() - t0
    assert not left, f"{name}: processes left behind after the kernel shut down: {left}"
    return nb, took


# -- reading outputs ----------------------------------------------------------------------


def cell(nb: NotebookNode, starts: str) -> NotebookNode:
    """The one code cell whose source starts with ``starts``."""
    found = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(starts)]
    assert len(found) == 1, f"{len(found)} cells start with {starts!r}"
    return found[0]


def cells(nb: NotebookNode, starts: str) -> list[NotebookNode]:
    """Every code cell whose source starts with ``starts``, in order."""
    return [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(starts)]


def text(c: NotebookNode) -> str:
    """Everything a cell wrote to stdout and every text/plain it displayed."""
    return stream_text(c) + "\n".join(plain_texts(c))


def number(pattern: str, haystack: str) -> float:
    m = re.search(pattern, haystack)
    assert m, f"{pattern!r} not in {haystack!r}"
    return float(m.group(1))


# -- what each notebook must show --------------------------------------------------------------


def check_quickstart(nb: NotebookNode) -> None:
    assert "smolbench: up on sandbox" in stream_text(cell(nb, "%smol up"))
    assert "hello from smol-root working in /workspace" in stream_text(cell(nb, "%%smol\nimport os, platform"))
    streamed = cell(nb, "%%smol\nimport time")
    assert [ln for ln in stream_text(streamed).splitlines() if ln.startswith("episode ")] == [
        f"episode {i}: return {10 - i * i / 4:.2f}" for i in range(5)]
    assert result_text(streamed) == "[10.0, 9.75, 9.0, 7.75, 6.0]"  # the last expression
    assert "defined in the notebook kernel? False" in stream_text(cell(nb, 'print("is episode_returns'))
    # push (a dict and a notebook-defined function) and pull
    expected = round(sum(0.9 ** t * (10 - t * t / 4) for t in range(5)), 4)
    assert f"{{'episodes': 5, 'discounted_return': {expected}}}" in stream_text(cell(nb, 'print("pulled back'))
    status = stream_text(cell(nb, "%smol status"))
    assert re.search(r"backend\s+sandbox", status) and re.search(r"live_machines\s+1\b", status)
    err = error_output(cell(nb, "%%smol\ndef mean_return"))
    assert err is not None and err.ename == "ZeroDivisionError" and err.evalue == "division by zero"
    tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err.traceback))
    assert "in mean_return" in tb and "return sum(returns) / len(returns)" in tb and "agent.py" not in tb
    assert "still fine: 5 episodes" in stream_text(cell(nb, '%%smol\nprint("the machine is still fine'))
    assert "deleted 1 machine" in stream_text(cell(nb, "%smol down"))


def check_fork_exploration(nb: NotebookNode) -> None:
    assert "warm-up took" in stream_text(cell(nb, "%%smol\nimport math"))
    assert "the starting policy (random moves): reward -1.065, success 0%" in stream_text(cell(nb, "%%smol --pull warmup_s"))
    summary = stream_text(cell(nb, "print(res.summary())"))
    assert summary.startswith("fork of 16 · 16 ok · best reward"), summary
    first = cell(nb, "%%smol fork 16 --seed-base 100 --out res")
    table = [t for t in plain_texts(first) if t.startswith("fork of 16")]
    assert table and len(re.findall(r"^\s+root\.\d+\s+seed=1\d\d\s+ok\b", table[-1], re.M)) == 16
    # forking paid the warm-up once: the whole fork took less than the warm-up itself
    saved = stream_text(cell(nb, 'print(f"warm-up'))
    assert number(r"fork of 16 branches: ([\d.]+) s wall", saved) < number(r"warm-up ([\d.]+) s, paid once", saved)
    for src in ("res.plot()", "%smol plot"):
        assert cell(nb, src).outputs, f"{src} showed nothing"
    assert len(cells(nb, "%smol use best")) == 2
    # the hill climb: the best reward never gets worse from round to round
    climb = stream_text(cell(nb, 'print("best reward per round'))
    bests = [float(x) for x in re.findall(r"([+-]\d+\.\d+) \(root", climb)]
    assert len(bests) == 3 and bests[0] <= bests[1] <= bests[2], climb
    tree = plain_texts(cell(nb, "%smol tree"))[-1]  # its static copy, as text
    assert re.search(r"root\.\d+\.\d+\.\d+ +seed=30\d", tree), tree  # three levels deep
    ledger = stream_text(cell(nb, 'print(f"ledger:'))
    assert "ledger: 33 nodes this session, 32 ok, 4 machines alive" in ledger  # root + 16 + 8 + 8
    assert "deleted 4 machines" in stream_text(cell(nb, "%smol down"))
    assert "32 branches in 3 rounds" in stream_text(nb.cells[-1])


def check_disposable_episodes(nb: NotebookNode) -> None:
    same = json.loads(stream_text(cell(nb, "%%smol --push run_episode --pull same_process")).split("rewards:")[1])
    fresh_cell = cell(nb, "%%smol episodes 16 --seed-base 0")
    assert any(t.startswith("episodes of 16 · 16 ok") for t in plain_texts(fresh_cell))
    # the drift plot's own data: (a) drifts, (b) doesn't
    figs = [o for o in cell(nb, "import plotly").outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert figs, "the drift plot is missing"
    traces = figs[0]["data"]["application/vnd.plotly.v1+json"]["data"]
    a, b = (list(t["y"]) for t in traces)
    assert len(a) == len(b) == 16 and a == same
    assert a[0] == b[0]  # episode 0: nothing has leaked yet

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    assert mean(a[-4:]) < 0.5 * mean(a[:4]), a  # (a) drifting
    assert abs(mean(b[-4:]) - mean(b[:4])) < 0.1 * mean(b[:4]), b  # (b) level
    assert all(x < y for x, y in zip(a[1:], b[1:])), (a, b)
    trends = stream_text(cell(nb, "def trend"))
    assert number(r"\(a\).*trend ([+-][\d.]+)", trends) < -1 and abs(number(r"\(b\).*trend ([+-][\d.]+)", trends)) < 0.5
    # a hung episode timed out, a crashing one errored; both were cleaned up
    rough = stream_text(cell(nb, "print(rough.summary())"))
    assert rough.startswith("episodes of 6 · 1 error · 4 ok · 1 timeout"), rough
    assert "(seed 2): timeout" in rough and "(seed 4): error" in rough
    assert re.search(r"live_machines\s+1\b", stream_text(cell(nb, "%smol status")))
    assert "22 episodes recorded, 0 of their machines alive" in stream_text(cell(nb, 'print(f"{len(episode_rows)}'))
    assert "after %smol down: 0 machines alive" in stream_text(nb.cells[-1])


def check_checkpoints(nb: NotebookNode) -> None:
    warm = stream_text(cell(nb, "%%smol\nimport json, os, pathlib"))
    assert "warm-up took" in warm
    score = re.search(r"greedy success (\d+%)", warm)
    assert score
    assert "saved checkpoint warm of root" in stream_text(cell(nb, "%smol checkpoint save warm"))
    assert "q defined: False · workspace: []" in stream_text(cell(nb, '%%smol\nimport os\nprint("q defined:'))
    assert re.search(r"restored warm as r\d+-warm \(now active\)", stream_text(cell(nb, "%smol checkpoint restore warm")))
    back = stream_text(cell(nb, '%%smol\nprint("q defined:'))
    assert "q defined: True · 36 states · workspace: ['levels']" in back  # the variable and the file
    assert 'levels/level0.json: {"size": 6' in back
    assert f"greedy success now {score.group(1)} (saved: {score.group(1)})" in back  # functions came back too
    assert stream_text(cell(nb, "print(res.summary())")).startswith("fork of 4 · 4 ok · best reward")
    replay = stream_text(cell(nb, "%smol replay {kept}"))
    assert re.search(r"replay of r\d+-warm\.\d: reward [\d.]+ vs recorded [\d.]+: identical\s*$", replay), replay
    listed = cell(nb, "%smol checkpoint list").outputs
    assert len(listed) == 2, listed  # the panel and its static copy, no DataFrame
    assert 'data-name="warm"' in listed[1]["data"]["text/html"]
    assert "deleted 1 machine" in stream_text(cells(nb, "%smol down")[0])
    assert "deleted 3 machines" in stream_text(cells(nb, "%smol down")[-1])  # root, r1-warm and its kept branch


def check_scale_out(nb: NotebookNode) -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed")
    assert "a local Ray cluster: 3 nodes" in stream_text(cell(nb, "from smolbench.cluster.local"))
    assert "cluster: 3 nodes, 12 machine slots" in stream_text(cell(nb, "%smol up"))
    fork = cell(nb, "%%smol fork 12")
    text = stream_text(fork)
    assert all(f"[root.{k}] epsilon" in text for k in range(12))  # streamed, prefixed by branch
    assert any(t.startswith("fork of 12 · 12 ok") for t in plain_texts(fork))
    per_node = stream_text(cell(nb, "import smolbench"))
    assert [int(x) for x in re.findall(r"\s(\d+)$", per_node, re.M)] == [4, 4, 4]
    status = stream_text(cell(nb, "%smol status"))
    assert status.count("replica of root (") == 2 and status.count(": up, 4 slots") == 3
    # what the nodes run, in their own words: not a microVM's limits, no pointer to itself, an image
    lines = {ln.split(None, 1)[0]: ln.split(None, 1)[1] for ln in status.splitlines() if len(ln.split(None, 1)) == 2}
    assert lines["isolation"] == "per node: sandbox on 3 nodes", status
    assert lines["limits"].startswith("on each of the 3 sandbox nodes: ") and "microVM" not in lines["limits"], status
    assert lines["image"] == "(each node's backend default: sandbox: host system, read-only)", status
    assert len(re.findall(r"root -> node \w+: \d+ B of recorded cells replayed in [\d.]+ s, fingerprint \w+",
                          stream_text(cell(nb, "replicas = ")))) == 2
    assert "24 episodes on 3 nodes, 0 machines still alive" in stream_text(cell(nb, "rows = ledger"))
    assert "the local cluster is stopped" in stream_text(nb.cells[-1])


def check_teaching(nb: NotebookNode) -> None:
    work = stream_text(nb.cells[1]).split("working in ", 1)[1].strip()
    assert "warm-up took" in stream_text(cell(nb, "%%smol\nimport json, time"))
    assert "saved checkpoint lesson1 of root" in stream_text(cell(nb, "%smol checkpoint save lesson1"))
    assert "exported checkpoint lesson1 to ../class/lesson1.smolcheckpoint" in stream_text(cell(nb, "%smol checkpoint export"))
    assert stream_text(cell(nb, 'os.chdir(os.path.join(work, "student"))')) == "[]\n"  # a fresh folder
    restored = stream_text(cell(nb, "%smol checkpoint restore"))
    assert "nothing is up: bringing up a sandbox machine" in restored, restored
    assert "added checkpoint lesson1 to this folder (copied into .smolbench/checkpoints/lesson1.smolcheckpoint)" in restored
    assert re.search(r"restored lesson1 as r1-lesson1 \(now active\)", restored), restored
    assert re.search(r'value of the start state 0\.\d+ · \{"lesson": 1, "states": 40\}',
                     stream_text(cell(nb, '%%smol\nprint(f"value of the start state')))
    assert any(t.startswith("fork of 4 · 4 ok") for t in plain_texts(cell(nb, "%%smol fork 4")))
    assert stream_text(cell(nb, "%smol checkpoint rm")) == "smolbench: removed checkpoint lesson1\n"
    assert stream_text(cell(nb, 'print("class file')) == "class file still there: True\nteacher's file still there: True\n"
    assert stream_text(nb.cells[-1]) == f"removed {work} · left behind: False\n"
    assert not os.path.exists(work)


def check_training(nb: NotebookNode) -> None:
    assert "(5, 1.0, True)" in result_text(cell(nb, "%%smol\nimport gymnasium"))  # the prototype reached the goal
    trained = stream_text(cell(nb, "%run train.py"))
    first, last = (float(x) for x in re.findall(r"of the (?:first|last) 8: (-?[\d.]+)", trained))
    assert last > first and "greedy policy: → → → → →" in trained, trained
    episodes = int(re.search(r"^(\d+) episodes;", trained, re.M).group(1))  # type: ignore[union-attr]
    said = stream_text(cell(nb, "import os"))
    assert f"{episodes} training episodes in the ledger" in said and "0 machines still alive" in said, said
    assert cell(nb, "%smol tree").outputs and cell(nb, "%smol plot").outputs
    assert "deleted" in stream_text(cells(nb, "%smol down")[-1])


CHECKS: dict[str, Callable[[NotebookNode], None]] = {
    "01_quickstart.ipynb": check_quickstart,
    "02_fork_exploration.ipynb": check_fork_exploration,
    "03_disposable_episodes.ipynb": check_disposable_episodes,
    "04_checkpoints.ipynb": check_checkpoints,
    "05_scale_out.ipynb": check_scale_out,
    "06_teaching.ipynb": check_teaching,
    "07_training.ipynb": check_training,
}


# -- the tests ----------------------------------------------------------------------------------


def test_every_notebook_is_tested() -> None:
    assert sorted(p.name for p in NOTEBOOKS_DIR.glob("*.ipynb")) == sorted(NOTEBOOKS) == sorted(CHECKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_clean(name: str) -> None:
    """No stored outputs, minimal metadata, a markdown introduction, and no backend pinned."""
    nb = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    assert set(nb.metadata) <= {"kernelspec", "language_info"}
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    for c in nb.cells:
        assert set(c.metadata) <= {"tags"}, c.metadata
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, f"stored output in {c.source[:40]!r}"
    ups = [c.source for c in nb.cells if c.cell_type == "code" and "%smol up" in c.source]
    assert ups and all(s == UPS.get(name, "%smol up") for s in ups), ups


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_end_to_end(name: str, tmp_path: Path) -> None:
    nb, took = execute(name, tmp_path)
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        err = error_output(c)
        expected = RAISES in c.metadata.get("tags", [])
        if expected:
            assert err is not None, f"{name}: cell {c.source[:60]!r} should show an error but didn't"
        else:
            assert err is None, f"{name}: unexpected error in {c.source[:60]!r}: {err.ename}: {err.evalue}"
    CHECKS[name](nb)
    # Every notebook cleans up after itself: nothing in its folder afterwards but the ledger
    # (.smolbench/). A Smolfile left here made every later `%smol up` in the folder join a cluster.
    left = sorted(p.name for p in tmp_path.iterdir() if p.name not in (name, ".smolbench"))
    assert left == [], f"{name} left files in its folder: {left}"
    budget = BUDGETS.get(name, TIME_BUDGET_S)
    assert took < budget, f"{name} took {took:.0f} s (budget {budget:.0f} s)"
