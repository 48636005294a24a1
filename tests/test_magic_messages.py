"""What a `%%smol` / `%smol` user reads when something is wrong: one line naming the problem and
the fix, in the magics' words (in-process IPython, the process backend).

Found by a user in a real kernel: a syntax error in a `%%smol` cell went through IPython's own
syntax-error printer (the host's frames down to magics.py, an empty `File <string>`, no source
line or caret); `!echo hi` was a bare "invalid syntax"."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from test_session_words import get_ipython

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def shell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = tmp_path_factory.mktemp("magic-messages")
    mp = pytest.MonkeyPatch()
    mp.chdir(folder)
    ip = get_ipython()
    ip.run_line_magic("load_ext", "smolbench")
    ip.run_line_magic("smol", f"up --backend process --ledger {folder / 'ledger.db'}")
    try:
        yield ip
    finally:
        ip.run_line_magic("smol", "down")
        mp.undo()


def shown(shell: Any, capsys: pytest.CaptureFixture[str], cell: str) -> str:
    """What the notebook shows for ``cell`` (its output and error), without colour."""
    capsys.readouterr()
    shell.run_cell(cell)
    out = capsys.readouterr()
    return ANSI.sub("", out.out + out.err)


def test_a_syntax_error_shows_the_cell_s_line_and_caret_and_no_host_frames(
        shell: Any, capsys: pytest.CaptureFixture[str]) -> None:
    said = shown(shell, capsys, "%%smol\ny = 1\nx = (\n")
    lines = said.strip("\n").splitlines()
    assert re.fullmatch(r'  File "<In \[\d+\]>", line 3', lines[0]), said
    assert lines[1:] == ["    x = (", "        ^", "SyntaxError: '(' was never closed"], said
    said = shown(shell, capsys, "%%smol\nif 1:\nprint(2)\n")
    assert said.strip().endswith("IndentationError: expected an indented block after 'if' statement on line 2"), said
    assert "magics.py" not in said and "Traceback" not in said
    assert shown(shell, capsys, "%%smol\nprint(1 + 1)\n") == "2\n"  # the machine is fine


def test_a_shell_escape_says_what_to_use_instead(shell: Any, capsys: pytest.CaptureFixture[str]) -> None:
    said = shown(shell, capsys, "%%smol\n!echo hi\n")
    assert said.strip().splitlines()[-1] == (
        "SyntaxError: shell escapes other than !pip don't run in a machine cell: use "
        "`import subprocess; subprocess.run('echo hi', shell=True)` instead"), said
    assert "magics.py" not in said
    said = shown(shell, capsys, "%%smol\nimport subprocess; subprocess.run('echo hi', shell=True)\n")
    assert "hi" in said
