"""What the notebook's views cost a cell, counted in a real kernel: a cell sends only what changed.

A user's kernel after 41 `%%smol fork 2 --keep none` cells: a `%%smol 1` cell produced 250
IOPub messages (612 KB: every fork's view was sent its whole tree twice, then again with its
static copy), and a plain Python cell 86 (each view told "a cell is running" and then not).
"""

from __future__ import annotations

from pathlib import Path

from nbhelpers import NotebookSession, ok

from smolbench.widgets._base import THROTTLE_S

SMOL_CELL = "%%smol\nx = 1"
PLAIN_CELL = "y = 2"


def _traffic(folder: Path, forks: int) -> tuple[dict[str, int], dict[str, int]]:
    """The IOPub messages of a `%%smol` cell and of a plain cell after ``forks`` fork cells."""
    folder.mkdir()
    with NotebookSession(folder) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend process"))
        for _ in range(forks):
            ok(nb.run("%%smol fork 2 --keep none\nreward = SEED"))
        # the views' last throttled flush (THROTTLE_S after a fork's last change) lands in these
        # cells, not in the counted ones: on a loaded host it came after a quick first cell
        ok(nb.run(f"import time\ntime.sleep({3 * THROTTLE_S})"))
        ok(nb.run("%%smol\nx = 0"))  # the first cell after the forks: any leftovers of theirs go here
        smol, smol_counts = nb.run_counted(SMOL_CELL)
        plain, plain_counts = nb.run_counted(PLAIN_CELL)
        ok(smol)
        ok(plain)
        ok(nb.run("%smol down"))
    return smol_counts, plain_counts


def test_a_cells_messages_do_not_grow_with_the_fork_views_above_it(tmp_path: Path) -> None:
    smol2, plain2 = _traffic(tmp_path / "two", 2)
    smol8, plain8 = _traffic(tmp_path / "eight", 8)
    # six more views whose trees the cells don't change: not one message more
    assert smol8 == smol2, (smol2, smol8)
    assert plain8 == plain2, (plain2, plain8)
    # the newest view alone is told a cell runs, and then that it ended
    for counts in (smol8, plain8):
        assert counts.get("comm_msg", 0) <= 2 and not counts.get("update_display_data"), counts
