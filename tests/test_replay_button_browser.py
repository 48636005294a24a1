"""Replay in the sidebar only where `%smol replay` can work (real JupyterLab, headless Debian
Chromium): a smolbench.gym run's episodes can't be replayed (their actions came from the
trainer and are not recorded), so its Replay button is disabled and its tooltip says why
in `%smol replay`'s words, in the Runs section and in the run's tree; a fork's Replay stays
enabled and inserts its cell.

The ledger is written first by a real Session (a fork, then a gym env's episode), in the
folder JupyterLab serves.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browserhelpers import (
    BROWSER_TEST_MARKS,
    browser_page,
    dump_failure,
    jupyter_server,
    write_notebook,
)
from test_gym_lifecycle import CORRIDOR

pytestmark = [*BROWSER_TEST_MARKS, pytest.mark.filterwarnings("ignore::UserWarning")]

# what the sidebar says, in `%smol replay`'s words (smolbench.tree.replay_refused and node_replay_refused)
RUN_REFUSED = "can't replay: its best branch is an episode of a smolbench.gym env, whose actions are not recorded"
NODE_REFUSED = "can't replay: it is an episode of a smolbench.gym env, whose actions are not recorded"


def _record_runs(root: Path) -> dict[str, str]:
    """A fork and a gym env's one rewarded episode, in ``root``'s ledger, by a real Session."""
    import smolbench
    import smolbench.gym as sgym

    ledger = root / ".smolbench" / "ledger.db"
    with smolbench.Session(backend="process", ledger=str(ledger)) as s:
        s.run(CORRIDOR, check=True)
        s.fork(2, "reward = SEED", keep="none")
        env = sgym.make("corridor", session=s)
        try:
            env.reset(seed=3)
            episode = env.machine
            gym_run = env._m.run_id
            while not env.step(1)[2]:
                pass
        finally:
            env.close()
    conn = sqlite3.connect(ledger)
    try:
        (fork_run,) = [r for (r,) in conn.execute("SELECT id FROM runs WHERE kind = 'fork'")]
        assert conn.execute("SELECT kind FROM runs WHERE id = ?", (gym_run,)).fetchone() == ("gym",)
    finally:
        conn.close()
    assert episode is not None
    return {"gym": gym_run, "fork": fork_run, "episode": episode}


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[dict[str, Any]]:
    root = tmp_path / "root"
    root.mkdir()
    runs = _record_runs(root)
    write_notebook(root / "a.ipynb", ["1 + 1"])
    with jupyter_server(root, "lab") as (base, token):
        yield {"base": base, "token": token, "root": root, **runs}


def _cells(page: Any) -> list[str]:
    return list(page.evaluate(
        "() => { const w = window.jupyterapp.shell.widgets('main'); const out = [];"
        " for (const x of w) { if (x.content && x.content.model && x.content.model.cells) {"
        "   const c = x.content.model.cells; for (let i = 0; i < c.length; i++) out.push(c.get(i).sharedModel.source); } }"
        " return out; }"))


def test_replay_is_disabled_for_a_gym_run_and_says_why(lab: dict[str, Any]) -> None:
    from playwright.sync_api import expect

    with browser_page(1400, 1000) as page:
        try:
            page.goto(f"{lab['base']}/lab/tree/a.ipynb?reset&token={lab['token']}")
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
            page.locator(".jp-smolbench-status").click()
            panel = page.locator("#smolbench-panel")
            expect(panel).to_be_visible()
            # both runs name no notebook (a Session outside a kernel): every notebook's runs
            panel.locator(".sb-runs-filter").select_option(label="all notebooks · 2", timeout=30_000)
            gym = panel.locator(f".sb-run[data-run='{lab['gym']}']")
            fork = panel.locator(f".sb-run[data-run='{lab['fork']}']")
            expect(gym.locator(".sb-kind")).to_have_text("gym", timeout=15_000)
            expect(fork.locator(".sb-kind")).to_have_text("fork ×2")

            # the gym run: Replay disabled, its tooltip saying why in one line
            expect(gym.locator(".sb-best")).to_have_text("1")
            replay = gym.locator(".sb-replay")
            expect(replay).to_be_disabled()
            expect(replay).to_have_attribute("title", RUN_REFUSED)
            replay.click(force=True)  # a click on it does nothing
            page.wait_for_timeout(500)
            assert _cells(page) == ["1 + 1"]

            # the fork: Replay enabled, and it inserts its best branch's replay cell
            replay = fork.locator(".sb-replay")
            expect(replay).to_be_enabled()
            expect(replay).to_have_attribute(
                "title", "Insert a %smol replay root.1 cell (the run's best branch) in the notebook")
            replay.click()
            expect(panel.locator(".sb-msg")).to_contain_text("inserted a %smol replay root.1 cell")
            assert _cells(page) == ["1 + 1", "%smol replay root.1"]

            # the gym run's tree: its episode's Replay is disabled too, saying why
            gym.locator(".sb-run-label").click()
            tree = page.locator(".jp-smolbench-tree:visible")
            tree.locator(f".sb-tree-row[data-id='{lab['episode']}']").click()
            replay = tree.locator(".sb-tree-detail .sb-replay")
            expect(replay).to_have_text(f"Replay {lab['episode']}")
            expect(replay).to_be_disabled()
            expect(replay).to_have_attribute("title", NODE_REFUSED)
            # and the fork's tree: its branch's Replay is enabled
            fork.locator(".sb-run-label").click()
            tree = page.locator(".jp-smolbench-tree:visible")
            tree.locator(".sb-tree-row[data-id='root.1']").click()
            replay = tree.locator(".sb-tree-detail .sb-replay")
            expect(replay).to_have_text("Replay root.1")
            expect(replay).to_be_enabled()
            expect(replay).to_have_attribute("title", "Insert a %smol replay root.1 cell in the active notebook")
        except BaseException:
            dump_failure(page, "replay-button")
            raise
