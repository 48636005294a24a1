"""A teacher and a student in two folders, in JupyterLab in chromium (issue 26 item 2).

The teacher's notebook warms a machine, saves it and exports it to a class folder; the
student's notebook, in another folder, restores the exported file by path with nothing up
and forks from it. Then the teacher's folder is copied whole (its ledger too), and the copy's
checkpoint is deleted from the sidebar (its Delete button and dialog): the copy's file goes,
the teacher's and the student's stay. The student's own checkpoint, deleted from the sidebar
while the student's kernel owns that ledger (the server hands the delete to the kernel),
takes the student's copy only. CI runs this module as smolci too (a second user).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browserhelpers import (
    BROWSER_TEST_MARKS,
    browser_page,
    dump_failure,
    jupyter_server,
    notebook_url,
    run_all,
    wait_for_kernel,
    write_notebook,
)

pytestmark = [*BROWSER_TEST_MARKS,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]

CK = Path(".smolbench") / "checkpoints" / "lesson1.smolcheckpoint"
TEACHER = [
    "%load_ext smolbench",
    "%smol up --backend sandbox",
    "%%smol\nwarm = 41\nopen('lesson.txt', 'w').write('from the teacher')",
    "%smol checkpoint save lesson1",
    "%smol checkpoint export lesson1 ../class/lesson1.smolcheckpoint",
    "%smol down",
]
STUDENT = [
    "%load_ext smolbench",
    "%smol checkpoint restore ../class/lesson1.smolcheckpoint",
    "%%smol\nprint('student sees', warm + 1, open('lesson.txt').read())",
    "%%smol fork 2 --quiet\nreward = SEED + warm",
]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict[str, Any]]:
    root = tmp_path / "root"
    for sub in ("teacher", "student", "class"):
        (root / sub).mkdir(parents=True)
    write_notebook(root / "teacher" / "teach.ipynb", TEACHER)
    write_notebook(root / "student" / "learn.ipynb", STUDENT)
    with jupyter_server(root, "lab") as (base, token):
        yield {"base": base, "token": token, "root": root}


def _run(page: Any, srv: dict[str, Any], name: str, cells: int) -> None:
    from playwright.sync_api import expect

    page.goto(notebook_url(srv["base"], srv["token"], "lab", name).replace("?", "?reset&"))
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    run_all(page, cells)
    last = page.locator(".jp-Notebook .jp-Cell").nth(cells - 1).locator(".jp-InputPrompt")
    expect(last).to_have_text(re.compile(r"\[\d+\]"), timeout=300_000)
    wait_for_kernel(page)


def _cell_text(page: Any, k: int) -> str:
    return str(page.locator(".jp-Notebook .jp-Cell").nth(k).locator(".jp-OutputArea").inner_text())


def test_teacher_exports_student_restores_and_a_copied_folder_deletes_its_own(server: dict[str, Any]) -> None:
    from playwright.sync_api import expect

    srv, root = server, server["root"]
    with browser_page(1400, 1000) as page:
        try:
            _run(page, srv, "teacher/teach.ipynb", len(TEACHER))
            assert "exported checkpoint lesson1 to ../class/lesson1.smolcheckpoint" in _cell_text(page, 4)
            exported = root / "class" / "lesson1.smolcheckpoint"
            assert exported.is_file() and (root / "teacher" / CK).is_file()

            _run(page, srv, "student/learn.ipynb", len(STUDENT))
            restored = _cell_text(page, 1)
            assert "bringing up a sandbox machine" in restored and "restored lesson1 as r1-lesson1" in restored, restored
            assert "student sees 42 from the teacher" in _cell_text(page, 2)
            assert (root / "student" / CK).is_file()

            # the teacher's folder copied whole, ledger and all
            shutil.copytree(root / "teacher", root / "copy")
            page.locator(".jp-smolbench-status").click()
            panel = page.locator("#smolbench-panel")
            expect(panel).to_be_visible()
            rows = panel.locator(".sb-checkpoint[data-name='lesson1']")
            expect(rows).to_have_count(3, timeout=30_000)  # teacher/, student/ and copy/: each its own

            # the copy's Delete, confirmed in its dialog: the copy's file only
            panel.locator(".sb-checkpoint[data-dir='copy'] .sb-delete").click()
            dialog = page.locator(".jp-Dialog")
            expect(dialog).to_contain_text('Delete checkpoint "lesson1"')
            dialog.locator("button.jp-mod-warn").click()
            msg = panel.locator(".sb-msg")
            expect(msg).to_contain_text("deleted checkpoint lesson1 and its file", timeout=30_000)
            assert not (root / "copy" / CK).exists()
            assert (root / "teacher" / CK).is_file() and (root / "student" / CK).is_file() and exported.is_file()
            expect(rows).to_have_count(2, timeout=30_000)

            # the student's, while the student's kernel owns that ledger: handed to it, its copy only
            panel.locator(".sb-checkpoint[data-dir='student'] .sb-delete").click()
            page.locator(".jp-Dialog button.jp-mod-warn").click()
            expect(msg).to_contain_text("removed checkpoint lesson1", timeout=60_000)
            assert not (root / "student" / CK).exists()
            assert (root / "teacher" / CK).is_file() and exported.is_file()
            expect(rows).to_have_count(1, timeout=30_000)
        except BaseException:
            dump_failure(page, "teaching")
            raise
