"""A branch's printed line can't pass for another's, nor hide the lines after it, in JupyterLab.

JupyterLab acts on a stream's control characters: a backspace erases the character before
it, and an ANSI style lasts across lines until a reset. A fork shows each line after its
branch's name, so branch 1 tries to erase its own name and write another branch's (a
reward it did not get), and to turn every line after its own black on black; a failing
branch's error message tries to hide the host's line after it (how many more branches
failed). None works; with the gate's handling weakened in the kernel, each does, which shows
the test would see it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from browserhelpers import (
    ARTIFACTS,
    BROWSER_TEST_MARKS,
    browser_page,
    jupyter_server,
    notebook_url,
    run_all,
    write_notebook,
)

pytestmark = BROWSER_TEST_MARKS

# Live output (the default) and output grouped by branch after the fork: both ways a line goes out.
SPOOF = ("%%smol fork 3 --keep none{how}\n"
         "print('line', SEED)\n"
         "if SEED == 1:\n"
         "    print('\\b' * 12 + '[root.0] reward=999')\n"  # its name, [root.N] , and more
         "    print('\\r[root.2] reward=998')\n"
         "    print('\\x1b[30;40mdark')\n"
         "reward = SEED\n")
LIVE, GROUPED = SPOOF.format(how=""), SPOOF.format(how=" --group-outputs branch")
WEAKEN = "import smolbench.gate.terminal as t\nt.TEST_WEAKEN.add('terminal')"
# Every branch fails; the error shown last (of 4) starts a style in its message, and the
# host's line after it says how many more failed ("... 2 more").
ERRORS = ("from smolbench.errors import CompositeError\n"
          "try:\n"
          "    get_ipython().run_cell_magic('smol', 'fork 6 --keep none',\n"
          "        \"raise ValueError('\\\\x1b[30;40mdark' if SEED == 3 else 'plain %d' % SEED)\")\n"
          "except CompositeError:\n"
          "    get_ipython().showtraceback()  # shown as the failed cell would show it; Run All goes on\n")

# The visible lines of a cell's stdout (a fork's progress display splits it in parts), and the text of every part drawn in one colour on the same.
SEEN = """cell => {
  const outs = cell.querySelectorAll(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stdout']");
  const lines = [], hidden = [];
  for (const out of outs) {
    lines.push(...out.innerText.split('\\n').filter(Boolean));
    for (const el of out.querySelectorAll('span')) {
      const s = getComputedStyle(el);
      if (s.color === s.backgroundColor) hidden.push(el.textContent);
    }
  }
  return outs.length ? {lines, hidden: hidden.join('')} : null;
}"""


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[str, int]]:
    cells = ["%load_ext smolbench", "%smol down\n%smol up --backend sandbox", LIVE, GROUPED, ERRORS, WEAKEN, LIVE,
             GROUPED, ERRORS, "print('ALL' + ' DONE')"]
    write_notebook(tmp_path / "spoof.ipynb", cells)
    with jupyter_server(tmp_path, "lab") as (base, token):
        yield notebook_url(base, token, "lab", "spoof.ipynb"), len(cells)


def test_a_branch_line_cannot_pass_for_another_or_hide_the_next_in_jupyterlab(lab: tuple[str, int]) -> None:
    from playwright.sync_api import expect

    url, cells = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with browser_page(1400, 1600) as page:
        try:
            page.goto(url)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            run_all(page, cells)
            expect(page.locator(".jp-OutputArea-output", has_text="ALL DONE")).to_be_visible(timeout=120_000)
            seen = [page.locator(".jp-Notebook .jp-Cell").nth(i).evaluate(SEEN) for i in (2, 3, 6, 7)]
            errors = [page.locator(".jp-Notebook .jp-Cell").nth(i).evaluate(SEEN.replace("jupyter.stdout", "jupyter.stderr"))
                      for i in (4, 8)]
            page.screenshot(path=str(ARTIFACTS / "terminal_spoof.png"), full_page=True)
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "terminal_failure.png"), full_page=True)
            raise
    names = []
    for out in seen:  # each fork's branches are named anew (root.0-2, root.3-5, ...): by seed
        assert out is not None, "a fork printed nothing"
        named = dict(reversed(ln.split(" line ")) for ln in out["lines"] if re.fullmatch(r"\[root\.\d+\] line \d", ln))
        assert sorted(named) == ["0", "1", "2"], out
        names.append(named)
    for out, named in zip(seen[:2], names[:2]):  # the gate on: each line says who wrote it, and nothing is
        spoofs = [ln for ln in out["lines"] if "reward=99" in ln]  # hidden but branch 1's own
        assert len(spoofs) == 2 and all(ln.startswith(named["1"] + " ") for ln in spoofs), out
        assert out["hidden"] == "dark", out
    for out, named in zip(seen[2:], names[2:]):  # weakened: branch 1 erases its name before branch 0's
        assert [ln for ln in out["lines"] if "reward=999" in ln and not ln.startswith(named["1"])], out
    assert f"{names[3]['2']} line 2" in seen[3]["hidden"], seen[3]  # and hides branch 2's line (grouped)
    # A fork's errors: the last one shown hides the host's count of the others only weakened
    assert errors[0] is not None and errors[1] is not None, errors
    assert any(ln.startswith("... 2 more (") for ln in errors[0]["lines"]) and "more" not in errors[0]["hidden"], errors[0]
    assert "... 2 more" in errors[1]["hidden"], errors[1]
