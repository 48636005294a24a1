"""The machine's traceback reaches the user outside IPython too.

A plain script's uncaught machine error (``run(check=True)``, a fork's CompositeError) prints
the cell's own file and line after the host's frames (a note, as Python prints it), and a
gym env's error keeps the env's traceback (``.traceback``, printed, catchable as the env's
built-in exception) while its message stays one line naming the sub-env. A machine that
sends a huge traceback full of terminal escapes for an env's error has it bounded and
escaped, as a cell's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import traceback
import uuid
from pathlib import Path

import pytest
from nbhelpers import TAG_VAR, wait_for_no_processes

from smolbench.errors import CompositeError, remote_error

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

POLICY = "def policy(x):\\n    return 1/(x-3)\\n"
SCRIPTS = {
    "run": f"""\
        import smolbench
        with smolbench.Session(backend="sandbox") as s:
            s.run("{POLICY}")
            s.run("b = policy(3)", check=True)
        """,
    "fork": f"""\
        import smolbench
        with smolbench.Session(backend="sandbox") as s:
            s.run("{POLICY}")
            s.fork(3, "b = policy(3 if SEED != 2 else 4)\\nq = None\\nq.x", seeds=[1, 2, 3])
        """,
}


@needs_bwrap
@pytest.mark.parametrize("kind", SCRIPTS)
def test_a_scripts_uncaught_machine_error_prints_the_cells_own_lines(tmp_path: Path, kind: str) -> None:
    (tmp_path / "tmp").mkdir()
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPTS[kind]))
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG_VAR: tag, "TMPDIR": str(tmp_path / "tmp")}
    try:
        done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env, text=True, capture_output=True,
                              timeout=240)
    finally:
        assert wait_for_no_processes(tag, timeout=10) == []
    err = done.stderr
    assert done.returncode == 1, err
    assert '  File "<cell-1>", line 2, in policy\n    return 1/(x-3)\n' in err, err  # the machine's frames
    assert "\x1b" not in err  # no colour codes on a terminal (nor in a log file)
    if kind == "run":
        assert "smolbench.errors.ZeroDivisionError: division by zero\n" in err
        assert "b = policy(3)" in err
    else:  # each distinct branch's traceback, the identical ones once
        assert "smolbench.errors.CompositeError: 3 of 3 branches failed" in err
        assert "the same error in 2 branches: root.0, root.2" in err
        assert "line 3, in <module>\n    q.x\nAttributeError: 'NoneType' object has no attribute 'x'" in err


def test_a_composite_errors_note_is_bounded_and_ipython_shows_no_note() -> None:
    errors = [remote_error("ValueError", f"bad {i}", [f'  File "<cell-1@root.{i}>", line {i + 1}, in f\n    f()\n'],
                           f"root.{i}") for i in range(7)]
    err = CompositeError("7 of 7 branches failed", errors)
    (note,) = err.__notes__
    assert 'File "<cell-1@root.0>", line 1, in f' in note and "ValueError: bad 3" in note
    assert "bad 4" not in note and "... 3 more (root.4, root.5, root.6)" in note
    assert "\x1b" not in note
    printed = "".join(traceback.format_exception(err))
    assert printed.count("ValueError: bad 0") == 1
    err.add_note("a note of the program's own")  # goes after the machine's
    assert err.__notes__ == [note, "a note of the program's own"]
    # IPython shows _render_traceback_ (which has it all) and never the notes
    assert any("ValueError" in line and "bad 0" in line for line in err._render_traceback_())
