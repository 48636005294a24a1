"""What a teacher and students met with the magics, in a real kernel: a fresh machine's `_`
was '3.11.7', `%smol use best` refused after a fork whose branches all failed, episodes failed
with a bare NameError, `%smol up` said nothing while it installed packages, a Ctrl-C on a
flooding cell never named the log its output went to, and some lines said the wrong thing or
said it twice."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
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
