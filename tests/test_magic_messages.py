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


WORDS = [  # what was typed, what the user now reads (argparse's own words, before: no fix)
    ("%smol delete", "%smol delete needs a node: e.g. `%smol delete root.3` (`%smol tree` lists them)"),
    ("%smol use", "%smol use needs a node: e.g. `%smol use root.3` (`%smol tree` lists them)"),
    ("%smol replay", "%smol replay needs a node: e.g. `%smol replay root.3` (`%smol tree` lists them)"),
    ("%smol checkpoint", "%smol checkpoint needs an action (save, restore, list, rm or export): "
                         "e.g. `%smol checkpoint list`"),
    ("%smol checkpoint lst", "unknown %smol checkpoint word 'lst': did you mean `%smol checkpoint list`? "
                             "one of save, restore, list, rm, export (see %smol?)"),
    ("%smol ledger -n x", "-n takes a whole number, got 'x': e.g. `%smol ledger -n 20`"),
    ("%smol up --smolfile", "--smolfile needs a value: e.g. `%smol up --smolfile path/Smolfile`"),
    ("%smol up --backend smoll", "--backend 'smoll' is not one of auto, smol, sandbox, process: "
                                 "did you mean `--backend smol`?"),
    ("%smol up --retris 2", "unknown option --retris for %smol up: did you mean --retries?"),
    ("%%smol fork 2 --bogus", "unknown option --bogus for %%smol fork: it takes --seed-base, --seeds, --timeout, "
                              "--concurrency, --keep, --out, --bg, --group-outputs, --push, --allow-errors, --quiet, "
                              "--retries, --no-reseed (see %smol?)"),
    ("%%smol fork", "%%smol fork needs the number of branches: e.g. `%%smol fork 16`"),
    ("%%smol --pul x", "--pul could be any of --pull, --pull-trusted: spell the option out (see %smol?)"),
    ("%smol trust maybe", "'maybe' is not a trust setting: `%smol trust on` or `%smol trust off` (trusted mode is off)"),
]


@pytest.mark.parametrize("typed, said", WORDS, ids=[w[0] for w in WORDS])
def test_a_magic_s_wrong_words_are_one_line_with_the_fix(typed: str, said: str) -> None:
    from IPython.core.error import UsageError

    ip = get_ipython()
    ip.run_line_magic("load_ext", "smolbench")
    words = typed.split(None, 1)
    rest = words[1] if len(words) > 1 else ""
    with pytest.raises(UsageError) as got:
        if words[0] == "%%smol":
            ip.run_cell_magic("smol", rest, "x = 1\n")
        else:
            ip.run_line_magic("smol", rest)
    assert str(got.value) == said
