"""Issue 20 from the user's side: where each machine runs, and a root lost with its node.

One throwaway cluster for the module (``LocalCluster``: a head with 0 CPUs, two sandbox
nodes and one process node, each with its own data folder).

- In JupyterLab (headless Debian Chromium): the sidebar's machine rows and the fork tree's
  rows say which Ray node each cluster machine runs on, that node's backend and its host,
  as the kernel's registry, ``%smol status`` and ``%smol tree`` do; a local kernel's rows
  stay as they were. A host name is data: markup in it shows as text and never runs.
- Through a real kernel (nbclient): the node holding the root is removed
  (``Cluster.remove_node``); the next cell says in one line that the root was lost with that
  node and rebuilds it on a surviving node by replaying its recorded path, with its state
  fingerprint checked; the move is an attempt row in the ledger and shows in the tree; no
  reward is made up. A root whose state came from something unrecorded is rebuilt too,
  and the line says the replay doesn't match.

Every wait is on a state (the node declared dead, the sidebar's rows), never a fixed sleep.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browserhelpers import (
    ARTIFACTS,
    BROWSER_TEST_MARKS,
    KERNEL_EXEC,
    browser_page,
    dump_failure,
    jupyter_server,
    notebook_url,
    run_all,
    wait_for_kernel,
    write_notebook,
)
from clusterhelpers import ledger_nodes, machine_processes, ok
from nbhelpers import NotebookSession, notices, stream_text, tree_text

from smolbench import Ledger, registry

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'jupyterlab-smolbench[ray]'")
pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
    pytest.mark.timeout(900),  # the first test includes starting the cluster: minutes on a busy 2-core host
]

EVIL_HOST = '<img src=x onerror="window.__pwned=1">node"host'


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from smolbench.cluster.local import LocalCluster

    with LocalCluster(3, slots=4, backends=["sandbox", "sandbox", "process"]) as c:
        yield c
    assert not machine_processes(c)






def attempts_of(cwd: Path, node_id: str) -> list[dict[str, Any]]:
    led = Ledger(cwd / ".smolbench" / "ledger.db")
    try:
        return [a for a in led.attempt_rows() if a["node_id"] == node_id]
    finally:
        led.close()


def status_nodes(text: str) -> dict[str, tuple[str, str]]:
    """``%smol status``'s cluster lines: short node id -> (backend, up or LOST)."""
    out = {}
    for m in re.finditer(r"^\s+([0-9a-f]{8}) \S+ (\w+): (up|LOST),", text, re.M):
        out[m.group(1)] = (m.group(2), m.group(3))
    return out


# -- where each machine runs: sidebar, fork tree, status, tree text -----------------------------

def _open(page: Any, base: str, token: str, name: str, cells: int) -> None:
    from playwright.sync_api import expect

    page.goto(notebook_url(base, token, "lab", name).replace("?", "?reset&"))
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    run_all(page, cells)
    last = page.locator(".jp-Notebook .jp-Cell").nth(cells - 1).locator(".jp-InputPrompt")
    expect(last).to_have_text(re.compile(r"\[\d+\]"), timeout=300_000)
    wait_for_kernel(page)


def _run_in(browser: Any, base: str, token: str, name: str, code: str) -> str:
    """Run ``code`` in the kernel of the open notebook ``name`` from a page of its own."""
    page = browser.new_page()
    try:
        page.goto(notebook_url(base, token, "lab", name).replace("?", "?reset&"))  # that notebook alone, current
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        wait_for_kernel(page)
        return str(page.evaluate(KERNEL_EXEC, code))
    finally:
        page.close()


@BROWSER_TEST_MARKS[0]  # skipped without Debian's chromium
def test_the_sidebar_and_the_fork_tree_show_each_machines_node(cluster: Any, open_tmp: Path) -> None:
    from playwright.sync_api import expect

    root = open_tmp
    write_notebook(root / "local.ipynb", ["%load_ext smolbench", "%smol up --backend process", "%%smol\nx = 1"])
    write_notebook(root / "ray.ipynb", [
        "%load_ext smolbench", f"%smol up --ray {cluster.address}", "%%smol\nx = 1",
        "%%smol fork 6 --keep all\nreward = x + SEED",
    ])
    with jupyter_server(root) as (base, token), browser_page(1400, 1000) as page:
        try:
            other = page.context.browser.new_page()  # a local kernel of its own (it runs on after its page closes)
            _open(other, base, token, "local.ipynb", 3)
            other.close()
            _open(page, base, token, "ray.ipynb", 4)
            page.locator(".jp-smolbench-status").click()
            panel = page.locator("#smolbench-panel")
            expect(panel).to_be_visible()
            expect(panel.locator(".sb-machine")).to_have_count(8, timeout=30_000)  # 1 local, root and 6 branches

            # the kernel's own record: every cluster machine with its node, host and backend
            recs = {r["backend"]: r for _, r in registry.read_records(root / ".runtime" / registry.DIRNAME)
                    if r["machines"]}
            placed = {m["id"]: m for m in recs["cluster"]["machines"]}
            assert len(placed) == 7 and all(m["node"] and m["node_host"] and m["node_backend"] for m in placed.values())
            assert len({m["node"] for m in placed.values()}) == 3
            assert all(m["node"] is None for m in recs["process"]["machines"])
            status = str(page.evaluate(KERNEL_EXEC, "%smol status"))
            shown = status_nodes(status)
            assert {m["node"][:8]: m["node_backend"] for m in placed.values()} == {k: v[0] for k, v in shown.items()}
            assert re.search(rf"^machine\s+root on node {placed['root']['node'][:8]} "
                             rf"\({placed['root']['node_backend']} on ", status, re.M), status

            # the sidebar's rows: node id and backend kind always show; the host is in the row and its tooltip
            groups = panel.locator(".sb-group")
            local = groups.filter(has_text="local.ipynb")
            expect(local.locator(".sb-machine")).to_have_count(1)
            expect(local.locator(".sb-where")).to_have_count(0)  # a local machine's row is as before
            ray_group = groups.filter(has_text="ray.ipynb")
            for mid, m in placed.items():
                line = ray_group.locator(f".sb-machine[data-id='{mid}'] .sb-where")
                expect(line.locator(".sb-where-node")).to_have_text(f"node {m['node'][:8]}")
                expect(line.locator(".sb-where-kind")).to_have_text(m["node_backend"])
                expect(line.locator(".sb-where-host")).to_have_text(m["node_host"])
                title = line.get_attribute("title") or ""
                assert m["node"] in title and f"{m['node_backend']} backend" in title and m["node_host"] in title
                for part in (".sb-where-node", ".sb-where-kind"):  # never clipped
                    assert line.locator(part).evaluate("e => e.scrollWidth <= e.clientWidth + 1")

            # the fork tree: a node badge on each row, the node in the row's tooltip and the detail line
            tree = page.locator(".jp-Notebook .sbt").last
            for mid, m in placed.items():
                row = tree.locator(f".sbt-row[data-id='{mid}']")
                badge = row.locator(".sbt-b-node")
                expect(badge).to_have_text(f"@{m['node'][:8]}")
                assert f"Ray node {m['node']} · {m['node_backend']} backend" in (badge.get_attribute("title") or "")
                assert f"node {m['node'][:8]} ({m['node_backend']} on {m['node_host']})" in (row.get_attribute("title") or "")
            tree.locator(".sbt-row[data-id='root.1']").click()
            expect(tree.locator(".sbt-detail")).to_contain_text(f"node {placed['root.1']['node'][:8]}")
            text = str(page.evaluate(KERNEL_EXEC, "print(__import__('smolbench')._magics.workbench.tree.render())"))
            for mid, m in placed.items():
                assert re.search(rf"^\W*{re.escape(mid)} .*@{m['node'][:8]} \({m['node_backend']} on ", text, re.M), text

            # a host name is data: markup in it is shown as text and never runs
            page.evaluate(KERNEL_EXEC, (
                "wb = __import__('smolbench')._magics.workbench\n"
                f"nid = wb.machines['root.1'].info['node']\nwb.backend.nodes[nid].host = {EVIL_HOST!r}\n"
                f"wb.tree['root.1'].where_host = {EVIL_HOST!r}\nwb._changed(wb.tree['root.1'])"))
            evil = ray_group.locator(".sb-machine[data-id='root.1'] .sb-where-host")
            expect(evil).to_have_text(EVIL_HOST, timeout=15_000)
            expect(tree.locator(".sbt-detail")).to_contain_text(EVIL_HOST, timeout=15_000)
            assert panel.locator(".sb-where img").count() == 0 and tree.locator("img").count() == 0
            assert page.evaluate("() => window.__pwned") is None
            page.evaluate(KERNEL_EXEC, "%smol down")
            # the local kernel lives on without a page: its machine goes too, or its run folder stays
            assert "deleted 1 machine" in _run_in(page.context.browser, base, token, "local.ipynb", "%smol down")
        except BaseException:
            dump_failure(page, "cluster-sidebar")
            with contextlib.suppress(OSError):
                shutil.copy(root / "lab.log", ARTIFACTS / "failure-cluster-sidebar-lab.log")
            raise


# -- a root lost with its node ------------------------------------------------------------------


def remove_node_of(cluster: Any, node_id: str) -> None:
    """Take away the node ``node_id`` (returns once the head has declared it dead)."""
    handle = next(n for n in cluster.nodes if n.node_id == node_id)
    cluster.remove_node(handle)


def test_a_root_lost_with_its_node_is_rebuilt_on_a_surviving_node(cluster: Any, open_tmp: Path) -> None:
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run(f"%smol up --ray {cluster.address}"))
        ok(nb.run("%%smol\nx = 41"))
        ok(nb.run("%%smol\nimport random\nrandom.seed(5)\ny = random.random()"))
        ok(nb.run("%%smol fork 6 --keep all\nreward = x + SEED"))
        before = ledger_nodes(open_tmp)
        lost = str(before.loc["root"].host_node)
        went = sorted(n for n in before.index if n.startswith("root.") and before.loc[n].host_node == lost)
        assert went, before[["host_node"]]  # kept branches on the root's node: they go with it
        remove_node_of(cluster, lost)

        t0 = time.monotonic()
        cell = ok(nb.run("%%smol\nprint(round(x + y, 6))"))
        print(f"\nthe rebuild and the cell took {time.monotonic() - t0:.1f} s")
        note = [ln for ln in notices(cell).splitlines() if "was lost with" in ln]
        assert len(note) == 1, notices(cell)
        import random

        rnd = random.Random(5)
        printed = [ln for ln in stream_text(cell).splitlines() if not ln.startswith("smolbench: ")]  # less the news
        assert printed == [str(round(41 + rnd.random(), 6))]  # the state is back
        after = ledger_nodes(open_tmp)
        home = str(after.loc["root"].host_node)
        assert home != lost and after.loc["root"].alive
        assert re.fullmatch(rf"smolbench: root was lost with node {lost[:8]} \(\w+\); rebuilt on node {home[:8]} "
                            r"\(\w+\) by replaying its recorded path \(2 cells, [\d.]+ s\); state fingerprint "
                            rf"[0-9a-f]{{16}} matches; {len(went)} other machines? on it went with it \(.*\)", note[0]), note[0]
        moves = [a for a in attempts_of(open_tmp, "root") if a["stage"] == "move"]
        assert [a["outcome"] for a in moves] == ["moved"] and moves[0]["error"] == note[0].removeprefix("smolbench: ")
        for n in went:  # gone with the node: deleted, their results as they were (never a reward of 0)
            assert not after.loc[n].alive and after.loc[n].status == "ok"
            assert after.loc[n].reward == before.loc[n].reward
        assert not (after.reward == 0).any() and after.loc["root"].status == "idle"

        tree = tree_text(ok(nb.run("%smol tree")))
        root_line = next(ln for ln in tree.splitlines() if ln.startswith("root "))
        assert f"@{home[:8]}" in root_line and f"moved from {lost[:8]}" in root_line
        status = stream_text(ok(nb.run("%smol status")))
        assert status_nodes(status)[lost[:8]][1] == "LOST"
        assert re.search(rf"^machine\s+root on node {home[:8]} \(\w+ on .*moved from {lost[:8]}\)", status, re.M)

        # the rebuilt root forks like the old one: same seeds, same rewards
        cell = ok(nb.run("%%smol fork 4 --keep none --seeds 0:4\nreward = x + y + SEED"))
        df = ledger_nodes(open_tmp).loc[[f"root.{k}" for k in range(6, 10)]]
        assert (df.status == "ok").all()
        assert df.reward.tolist() == pytest.approx([41 + random.Random(5).random() + k for k in range(4)])

        # a state made from something not recorded: rebuilt, and the line says it doesn't match
        ok(nb.run("%%smol\nimport os\nnoise = os.urandom(8).hex()"))
        remove_node_of(cluster, home)
        cell = ok(nb.run("%%smol\nprint('still here', len(noise))"))
        note = [ln for ln in notices(cell).splitlines() if "was lost with" in ln]
        assert len(note) == 1 and f"root was lost with node {home[:8]}" in note[0]
        assert re.search(r"the replay doesn't match: state fingerprint [0-9a-f]{16} vs [0-9a-f]{16} recorded", note[0])
        assert [ln for ln in stream_text(cell).splitlines() if not ln.startswith("smolbench: ")] == ["still here 16"]
        moves = [a for a in attempts_of(open_tmp, "root") if a["stage"] == "move"]
        assert [a["outcome"] for a in moves] == ["moved", "mismatch"]
        assert moves[1]["attempt"] > moves[0]["attempt"]
        ok(nb.run("%smol down"))
    conn = sqlite3.connect(str(open_tmp / ".smolbench" / "ledger.db"))
    try:
        assert conn.execute("SELECT count(*) FROM nodes WHERE reward = 0").fetchone()[0] == 0
    finally:
        conn.close()


def test_branches_lost_with_their_parents_node_mid_fork_rerun_from_the_rebuilt_parent(
        cluster: Any, open_tmp: Path) -> None:
    import threading

    while len(cluster.nodes) < 3:  # the test above took two away
        cluster.add_node(slots=4, backend="sandbox")
    names = [f"root.{k}" for k in range(8)]
    lost: list[str] = []
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run(f"%smol up --ray {cluster.address}"))
        ok(nb.run("%%smol\nx = 41"))

        def go() -> None:  # once every branch runs, the parent's node goes
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                if (open_tmp / ".smolbench" / "ledger.db").exists():
                    df = ledger_nodes(open_tmp)
                    if set(names) <= set(df.index) and (df.loc[names, "status"] == "running").all():
                        lost.append(str(df.loc["root"].host_node))
                        remove_node_of(cluster, lost[0])
                        return
                time.sleep(0.1)

        t = threading.Thread(target=go, daemon=True)
        t.start()
        cell = nb.run("%%smol fork 8 --keep none --retries 2\nimport time\ntime.sleep(15)\nreward = x + SEED")
        t.join()
        ok(cell)
        assert lost, "the branches never all ran"
        run = ledger_nodes(open_tmp).loc[names]
        assert (run.status == "ok").all() and run.reward.tolist() == [41 + k for k in range(8)]
        assert lost[0] not in set(run.host_node)  # none finished on the lost node
        note = [ln for ln in notices(cell).splitlines() if "was lost with" in ln]
        assert len(note) == 1 and f"root was lost with node {lost[0][:8]}" in note[0], notices(cell)
        attempts = [a for n in names for a in attempts_of(open_tmp, n)]
        rerun = {a["node_id"] for a in attempts if a["outcome"] == "retried"}
        assert rerun and all("lost" in (a["error"] or "") for a in attempts if a["outcome"] == "retried")
        assert [a["outcome"] for a in attempts_of(open_tmp, "root") if a["stage"] == "move"] == ["moved"]
        assert str(ledger_nodes(open_tmp).loc["root"].host_node) != lost[0]
        ok(nb.run("%smol down"))
