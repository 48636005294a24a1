"""What a teacher and students met with the magics, in a real kernel: a fresh machine's `_`
was '3.11.7', `%smol use best` refused after a fork whose branches all failed, episodes failed
with a bare NameError, `%smol up` said nothing while it installed packages, a Ctrl-C on a
flooding cell never named the log its output went to, and some lines said the wrong thing or
said it twice."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from ckpthelpers import held_hand_over, interrupt_once_started
from nbhelpers import NotebookSession, error_text, ok, stream_text

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
pytestmark = needs_bwrap


def test_a_fresh_machine_has_no_underscore_of_the_up(tmp_path: Path) -> None:
    with NotebookSession(tmp_path, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
        cell = nb.run("%%smol\nprint(repr(_))")
        assert "NameError: name '_' is not defined" in error_text(cell), stream_text(cell) + error_text(cell)
        names = ok(nb.run("%%smol\nprint(sorted(k for k in globals() if not k.startswith('__')))"))
        assert stream_text(names) == "['display', 'smolbench_guest']\n"
        ok(nb.run("%smol down"))


def test_use_best_after_a_failed_fork_takes_an_earlier_fork_s_best_and_says_which(tmp_path: Path) -> None:
    with NotebookSession(tmp_path, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
        ok(nb.run("%%smol fork 4 --seed-base 1 --quiet\nreward = SEED * 10"))
        assert "CompositeError" in error_text(nb.run("%%smol fork 3\nraise ValueError('no')"))
        use = ok(nb.run("%smol use best"))
        said = stream_text(use)
        assert said.startswith("smolbench: the fork of 3 under root at In [4] has no rewarded branch (3 error): using the "
                               "best live rewarded branch, root.3 (reward 40), from the fork of 4 under root at In [3]\n"), said
        assert said.endswith("smolbench: active machine is now root.3 (seed 4, reward 40)\n"), said
        ok(nb.run("%smol delete root.3"))
        gone = nb.run("%smol use best")
        assert "no live rewarded branch to use: the fork of 3 under root at In [4] has no rewarded branch (3 error); no " \
               "other fork's rewarded branch is alive: `%smol replay NODE` rebuilds one" in error_text(gone), error_text(gone)
        ok(nb.run("%smol down"))


def test_episodes_after_a_restore_that_all_miss_a_name_say_where_they_start(tmp_path: Path) -> None:
    (tmp_path / "Smolfile").write_text('workdir = "/lab"\n')
    with NotebookSession(tmp_path, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
        ok(nb.run("%%smol\ncart = 7"))
        ok(nb.run("%smol checkpoint save lesson1"))
        ok(nb.run("%smol down"))
        ok(nb.run("%smol checkpoint restore lesson1"))
        failed = error_text(nb.run("%%smol episodes 4\nreward = cart + SEED"))
        assert "4 of 4 episodes failed (4 error); first: [ep1.0] error: NameError: name 'cart' is not defined; episodes " \
               "start fresh from the Smolfile's baseline, not from the active machine r1-lesson1: `%%smol fork N` " \
               "branches it" in failed, failed
        ok(nb.run("%smol down"))


FAKE_PIP = """import os, sys, time
marker, target = sys.argv[1:]
for _ in range(600):  # the test lets it end once the notice showed (or 60 s passed)
    if os.path.exists(marker):
        break
    time.sleep(0.1)
os.makedirs(target)
"""


def test_up_says_it_installs_the_smolfile_s_packages_while_pip_runs(tmp_path: Path) -> None:
    import threading
    import time

    (tmp_path / "Smolfile").write_text('packages = ["tomli-w==1.2.0"]\n')
    (tmp_path / "fakepip.py").write_text(FAKE_PIP)
    marker = tmp_path / "pip-may-end"
    with NotebookSession(tmp_path, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run(f"import os, sys, smolbench.packages as p\nos.environ['SMOLBENCH_CACHE'] = {str(tmp_path / 'cache')!r}\n"
                  f"p.pip_command = lambda r, g, t: [sys.executable, {str(tmp_path / 'fakepip.py')!r}, "
                  f"{str(marker)!r}, str(t)]"))
        ups: list[object] = []
        running = threading.Thread(target=lambda: ups.append(nb.run("%smol up --backend sandbox")))
        running.start()
        said_while_installing = False
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline and not said_while_installing:
                cell = nb.nb.cells[-1]
                said_while_installing = "%smol up" in cell.source and "installing 1 package from the Smolfile" in "".join(
                    o.get("text", "") for o in list(cell.outputs) if o.output_type == "stream")
                time.sleep(0.1)
        finally:
            marker.touch()
            running.join(120)
        up = ok(ups[0])  # type: ignore[arg-type]
        lines = stream_text(up).splitlines()
        assert said_while_installing, lines
        assert lines[0] == "smolbench: installing 1 package from the Smolfile (first time only; cached after) …", lines
        assert lines[1].startswith("smolbench: up on sandbox") and lines[2].startswith("smolbench: packages: installed in")
        ok(nb.run("%smol down"))
        again = ok(nb.run("%smol up --backend sandbox"))
        assert "installing" not in stream_text(again) and "smolbench: packages: cached" in stream_text(again)
        ok(nb.run("%smol down"))


FLOODING = "%%smol\ni = 0\nwhile True:\n    i += 1\n    print('step', i, 'x' * 200)"


def test_a_flooding_cell_names_its_log_at_once_and_again_after_ctrl_c(tmp_path: Path) -> None:
    """Output stopped silently at the limit while the cell ran, and a Ctrl-C said only
    "84 bytes of output after Ctrl-C not shown": the log holding the rest was never named."""
    import re
    import threading
    import time

    with NotebookSession(tmp_path, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
        ok(nb.run("%smol config output-limit 200K"))
        cells = len(nb.nb.cells)
        seen_while_running: list[str] = []

        def interrupt_once_it_says_where() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not seen_while_running:
                if len(nb.nb.cells) > cells:
                    said = stream_text(nb.nb.cells[cells], "stderr")
                    if "output past" in said:
                        seen_while_running.append(said)
                time.sleep(0.05)
            time.sleep(0.5)  # the flood runs on into its log
            nb.interrupt()

        t = threading.Thread(target=interrupt_once_it_says_where)
        t.start()
        cell = nb.run(FLOODING)
        t.join()
        assert seen_while_running, stream_text(cell, "stderr")
        said = re.fullmatch(r"smolbench: output past 200 KB goes to (\S+\.log); `%smol config output-limit SIZE` raises "
                            r"it\n", seen_while_running[0])
        assert said, seen_while_running
        log = tmp_path / said[1]  # (relative to the notebook's folder, or absolute)
        assert log.read_text().startswith("step "), log
        err = stream_text(cell, "stderr")
        assert re.search(rf"^… \d+(\.\d)? MB more output not shown \(saved to {re.escape(said[1])}\)$", err,
                         re.MULTILINE), err
        assert error_text(cell).startswith("KeyboardInterrupt"), error_text(cell)
        ok(nb.run("%smol down"))


def test_a_restore_with_nothing_up_interrupted_names_the_restore(tmp_path: Path) -> None:
    """It said "`%smol up` was interrupted", which the user never ran."""

    copying, go = tmp_path / "copying", tmp_path / "go"
    with NotebookSession(tmp_path, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
        ok(nb.run("%%smol\nkept = 'warm'"))
        ok(nb.run("%smol checkpoint save lesson1"))
        ok(nb.run("%smol down"))
        ok(nb.run(held_hand_over(copying, go)))

        t = interrupt_once_started(nb, copying, go)
        t.start()
        restore = nb.run("%smol checkpoint restore lesson1")
        t.join()
        assert error_text(restore) == ("KeyboardInterrupt: `%smol checkpoint restore lesson1` was interrupted: its machine "
                                       "was deleted and nothing is left behind"), error_text(restore)
        assert "no machine is up" in stream_text(ok(nb.run("%smol status")))
