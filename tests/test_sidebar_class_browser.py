"""The sidebar for a class, in JupyterLab and Notebook 7 (headless Debian Chromium, dark theme).

A teacher's notebook ``a.ipynb`` forks 16 branches (3 raise, 4 tie for the top reward),
saves a checkpoint and deletes a kept branch; student notebooks each start a kernel with a
background fork of 8 (8 kernels in all in JupyterLab, 4 in Notebook 7: each costs CPU on a
shared host), one of them in a subfolder where it saves a checkpoint of the same name.

Then, on screen: machines come in one group per notebook, each with a summary line
(``student3.ipynb · 9 machines · 8 running``) that collapses it; past the threshold the
other notebooks' groups start collapsed and a big group pages ("Show more"); how long the
render took is recorded (never asserted). Checkpoints show their folder, and a tooltip never
reads "root folder/:". Restore inserts the `%smol checkpoint restore` cell and runs it.
Replay and ★best pick the same branch on a tie; "Replay" isn't clipped; a run tree's tab
says notebook, cell and kind (not a ledger id) and a deleted branch is "deleted", never
"kept". The fork view never folds away an errored branch and says how it folds. The result
table's ``ok`` colour has 4.5:1 contrast, computed from the page (getComputedStyle).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browserhelpers import (
    ARTIFACTS,
    BROWSER_TEST_MARKS,
    browser_page,
    dump_failure,
    jupyter_server,
    notebook_url,
    run_all,
    wait_for_kernel,
    write_notebook,
)

from smolbench.widgets.static import FOLD_RULE

pytestmark = BROWSER_TEST_MARKS

TEACHER = [
    "%load_ext smolbench",
    "%smol up --backend process",
    # 3 branches raise; root.12-15 tie for the top reward (★best and Replay: root.12)
    "%%smol fork 16 --keep all --allow-errors\nif SEED in (1, 2, 3):\n    raise ValueError('arm broke')\n"
    "reward = 1.0 if SEED >= 12 else SEED / 100",
    "%smol checkpoint save warm --node root",
    "%smol delete root.4",  # a kept branch, deleted: its ledger row stays kept = 1
]
STUDENTS = {"lab": 7, "notebook": 3}  # kernels besides the teacher's
BIG = 30  # one student's fork: a group longer than a page


def student_cells(k: int) -> list[str]:
    n = BIG if k == 2 else 8
    return ["%load_ext smolbench", "%smol up --backend process",
            *(["%smol checkpoint save warm --node root"] if k == 1 else []),
            f"%%smol fork {n} --bg --keep all --quiet\nimport time\ntime.sleep(900)\nreward = 1"]


def student_path(k: int) -> str:
    return f"class/student{k}.ipynb" if k == 1 else f"student{k}.ipynb"


# Start a kernel for a notebook path (a server session, as opening it would) and run code.
START_AND_RUN = """async ([path, cells]) => {
  const sessions = window.jupyterapp.serviceManager.sessions;
  const s = await sessions.startNew({ path, name: path, type: 'notebook', kernel: { name: 'python3' } });
  const out = [];
  for (const code of cells) {
    const f = s.kernel.requestExecute({ code, store_history: true, allow_stdin: false });
    f.onIOPub = m => {
      if (m.header.msg_type === 'stream') out.push(m.content.text);
      if (m.header.msg_type === 'error') out.push('ERROR ' + m.content.ename + ': ' + m.content.evalue);
    };
    await f.done;
  }
  return out.join('');
}"""

# The text colour and the first opaque background behind an element, as the page paints them.
COLOURS = """e => {
  const rgb = s => s.match(/[\\d.]+/g).map(Number);
  let bg = null;
  for (let n = e; n && !bg; n = n.parentElement) {
    const c = rgb(getComputedStyle(n).backgroundColor);
    if (c.length < 4 || c[3] > 0.99) bg = c.slice(0, 3);
  }
  return { fg: rgb(getComputedStyle(e).color).slice(0, 3), bg: bg || [255, 255, 255],
           light: document.body.dataset.jpThemeLight };
}"""


def _lum(c: list[float]) -> float:
    ch = [v / 255 for v in c]
    lin = [v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4 for v in ch]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a: list[float], b: list[float]) -> float:
    hi, lo = sorted((_lum(a), _lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.fixture(params=["lab", "notebook"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    root = tmp_path / "root"
    (root / "class").mkdir(parents=True)
    write_notebook(root / "a.ipynb", TEACHER)
    for k in range(1, STUDENTS[request.param] + 1):
        write_notebook(root / student_path(k), [])
    with jupyter_server(root, request.param, dark=True) as (base, token):
        yield {"app": request.param, "base": base, "token": token, "root": root}


def test_the_sidebar_of_a_class(server: dict[str, Any]) -> None:
    from playwright.sync_api import expect

    srv = server
    app = srv["app"]
    students = STUDENTS[app]
    with browser_page(1400, 1000) as page:
        try:
            url = notebook_url(srv["base"], srv["token"], app, "a.ipynb")
            page.goto(url.replace("?", "?reset&") if app == "lab" else url)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            run_all(page, len(TEACHER))
            last = page.locator(".jp-Notebook .jp-Cell").nth(len(TEACHER) - 1).locator(".jp-InputPrompt")
            expect(last).to_have_text(re.compile(r"\[\d+\]"), timeout=240_000)
            wait_for_kernel(page)
            for k in range(1, students + 1):
                out = page.evaluate(START_AND_RUN, [student_path(k), student_cells(k)])
                assert "ERROR" not in out, out

            # the fork view: errored branches are never folded away, and the fold says its rule
            fork = page.locator(".jp-Notebook .jp-Cell").nth(2)
            for b in ("root.1", "root.2", "root.3"):
                expect(fork.locator(f".sbt-row[data-id='{b}']")).to_have_count(1)
            expect(fork.locator(".sbt-more").first).to_contain_text(FOLD_RULE)
            expect(fork.locator(".sbt-row.sbt-bestnode")).to_have_attribute("data-id", "root.12")
            # its result table's "ok", on the dark theme, computed from the page
            ok = fork.locator(".smolbench-forkresult td.sb-st-ok").first
            seen = ok.evaluate(COLOURS)
            assert seen["light"] == "false", seen
            ratio = contrast(seen["fg"], seen["bg"])
            assert ratio >= 4.5, f"ok {seen['fg']} on {seen['bg']}: {ratio:.2f}:1"

            if app == "notebook":
                page.get_by_role("menuitem", name="View", exact=True).click()
                page.get_by_text("Show the smolbench sidebar", exact=True).click()
            else:
                page.locator(".jp-smolbench-status").click()
            panel = page.locator("#smolbench-panel")
            expect(panel).to_be_visible()

            # one group per notebook, with a summary; the others collapsed past the threshold
            groups = panel.locator(".sb-group")
            expect(groups).to_have_count(students + 1, timeout=60_000)
            s3 = panel.locator(".sb-group", has_text="student3.ipynb")
            expect(s3.locator(".sb-group-nb")).to_have_text("student3.ipynb · 9 machines · 8 running", timeout=60_000)
            mine = panel.locator(".sb-group", has_text="a.ipynb")
            expect(mine.locator(".sb-group-nb")).to_have_text(re.compile(r"^a\.ipynb · \d+ machines · 0 running$"))
            teacher = int(re.findall(r"(\d+) machines", mine.locator(".sb-group-nb").inner_text())[0])
            expect(mine.locator(".sb-machine")).to_have_count(teacher)  # the current notebook's: open
            expect(s3).to_have_attribute("data-collapsed", "true")
            expect(s3.locator(".sb-machine")).to_have_count(0)
            s3.locator(".sb-group-toggle").click()
            expect(s3.locator(".sb-machine")).to_have_count(9)
            expect(s3.locator(".sb-group-toggle")).to_have_attribute("aria-expanded", "true")
            big = panel.locator(".sb-group", has_text="student2.ipynb")
            expect(big.locator(".sb-group-nb")).to_have_text(f"student2.ipynb · {BIG + 1} machines · {BIG} running")
            big.locator(".sb-group-toggle").click()
            expect(big.locator(".sb-machine")).to_have_count(25)
            big.locator(".sb-group-more").click()
            expect(big.locator(".sb-machine")).to_have_count(BIG + 1)
            body = panel.locator(".sb-machines .sb-body")
            machines = teacher + 9 * (students - 1) + BIG + 1
            page.wait_for_timeout(1500)  # a poll or two with everything drawn
            render_ms = float(body.get_attribute("data-render-ms") or "nan")
            rows = int(body.get_attribute("data-rows") or 0)
            ARTIFACTS.mkdir(exist_ok=True)
            with open(ARTIFACTS / "sidebar-render.txt", "a") as fh:
                fh.write(f"{app}: {students + 1} kernels, {machines} machines, {rows} rows drawn: {render_ms:.1f} ms\n")
            print(f"sidebar render ({app}): {machines} machines, {rows} rows: {render_ms:.1f} ms")

            # checkpoints show their folder; no tooltip says "root folder/:"
            ckpts = panel.locator(".sb-checkpoint[data-name='warm']")
            expect(ckpts).to_have_count(2, timeout=30_000)
            here, there = ckpts.and_(panel.locator("[data-dir='']")), ckpts.and_(panel.locator("[data-dir='class']"))
            expect(here.locator(".sb-ckpt-folder")).to_have_text("root folder")
            expect(there.locator(".sb-ckpt-folder")).to_have_text("class/")
            titles = panel.evaluate("p => [...p.querySelectorAll('[title]')].map(e => e.title)")
            assert not [t for t in titles if "folder/" in t], titles
            expect(here.locator(".sb-id")).to_have_attribute("title", re.compile(r"in the root folder$"))
            expect(there.locator(".sb-restore")).to_have_attribute(
                "title", "this checkpoint is in class/: open a notebook there to restore it")

            # Replay: the same branch as ★best on a tie, and its label whole
            run = panel.locator(".sb-run").first
            replay = run.locator(".sb-replay")
            expect(replay).to_have_text("Replay")
            clip = replay.evaluate("b => [b.scrollWidth, b.clientWidth]")
            assert clip[0] <= clip[1] + 1, f"Replay is clipped: {clip}"
            replay.click()
            cells = page.locator(".jp-NotebookPanel:visible .jp-Cell .cm-content")
            expect(cells.filter(has_text="%smol replay root.12")).to_have_count(1)

            # Restore: a cell in the notebook, run, so Run All on a new kernel restores it again
            here.locator(".sb-restore").click()
            expect(panel.locator(".sb-msg")).to_contain_text("restored warm as r1-warm", timeout=90_000)
            restore_cell = page.locator(".jp-NotebookPanel:visible .jp-Cell", has_text="%smol checkpoint restore warm")
            expect(restore_cell).to_have_count(1)
            expect(restore_cell.locator(".jp-OutputArea-output")).to_contain_text("restored warm as r1-warm")

            if app != "lab":  # Notebook 7's notebook page has no main area for a run's tree
                return
            # the run's tree: a title for people, and a deleted kept branch says "deleted"
            run.click()
            tree = page.locator(".jp-smolbench-tree:visible")
            expect(tree.locator(".sb-tree-row")).to_have_count(17, timeout=30_000)
            tab = page.get_by_role("tab", name=re.compile(r"^a\.ipynb \[3\] · fork ×16 · \d\d:\d\d:\d\d$"))
            expect(tab).to_have_attribute("aria-selected", "true")
            expect(tree.locator(".sb-tree-title").first).to_contain_text("a.ipynb [3] · fork ×16")
            expect(tree.locator(".sb-tree-row[data-id='root.4'] .sb-alive")).to_have_text("deleted")
            expect(tree.locator(".sb-tree-row[data-id='root.15'] .sb-alive")).to_have_text("kept")
            assert "kept" not in tree.locator(".sb-tree-row[data-status='error'] .sb-alive").all_inner_texts()
        except Exception:
            dump_failure(page, f"sidebar-class-{app}")
            raise
