"""What a `%%smol` / `%smol` user reads when something is wrong: one line naming the problem and
the fix, in the magics' words (in-process IPython, the process backend).

Found by a user in a real kernel: a syntax error in a `%%smol` cell went through IPython's own
syntax-error printer (the host's frames down to magics.py, an empty `File <string>`, no source
line or caret); `!echo hi` was a bare "invalid syntax"."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_session_words import get_ipython

import smolbench
from smolbench import SmolbenchError

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The test IPython with a process machine up in ``tmp_path`` (no Smolfile there)."""
    monkeypatch.chdir(tmp_path)
    ip = get_ipython()
    ip.run_line_magic("load_ext", "smolbench")
    ip.run_line_magic("smol", "up --backend process --ledger ledger.db")
    try:
        yield ip
    finally:
        ip.run_line_magic("smol", "down")


def shown(shell: Any, capsys: pytest.CaptureFixture[str], cell: str) -> str:
    """What the notebook shows for ``cell`` (its output and error), without colour."""
    capsys.readouterr()
    shell.run_cell(cell)
    out = capsys.readouterr()
    return ANSI.sub("", out.out + out.err)


def test_a_syntax_error_shows_the_cell_s_line_and_caret_and_no_host_frames(
        shell: Any, capsys: pytest.CaptureFixture[str]) -> None:
    said = shown(shell, capsys, "%%smol\ny = 1\nx = (\n")
    lines = [ln for ln in said.strip("\n").splitlines() if not ln.startswith("smolbench fork of")]  # (other tests' forks)
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



def test_a_pip_line_fills_in_variables_as_ipython_does_and_refuses_shell_syntax_in_one_line(
        shell: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a user: `!pip install {pkg}` said "Invalid requirement: '{pkg}'", `> /dev/null` went to
    pip as a requirement ("Invalid requirement: '>'"), and `| grep` printed the whole list."""
    said = shown(shell, capsys, "%%smol\nimport types\nwhat = types.SimpleNamespace(name='pip')\nflag = '--version'\n"
                                "!pip {flag}\n%pip show $what.name\n")
    assert said.startswith("pip ") and "Name: pip" in said and "{" not in said, said
    said = shown(shell, capsys, "%%smol\nprint('ran')\n!pip install -q humanize==4.9.0 > /dev/null && echo done\n")
    assert said.strip().splitlines()[-1] == (
        "SyntaxError: `!pip` lines run pip, not a shell: drop `> /dev/null && echo done`, or run it with "
        "`subprocess.run(..., shell=True)`"), said
    assert "ran" not in said  # refused before the cell ran, as a syntax error is
    said = shown(shell, capsys, "%%smol\n!pip list | grep -i numpy\n")
    assert said.strip().splitlines()[-1] == (
        "SyntaxError: `!pip` lines run pip, not a shell: drop `| grep -i numpy`, or run it with "
        "`subprocess.run(..., shell=True)`"), said
    said = shown(shell, capsys, "%%smol\n%pip install numpy >= 2\n")
    assert said.strip().splitlines()[-1] == ('SyntaxError: `%pip` lines run pip, not a shell: put the requirement '
                                             'in quotes, `%pip install "numpy>=2"`'), said
    said = shown(shell, capsys, "%%smol\n!pip install {not_defined_here}\nprint('after')\n")
    assert sorted(said.splitlines()) == [  # (stdout and stderr, each as the cell wrote it)
        "after", "smolbench: this pip line did not run: `{not_defined_here}` could not be filled in (NameError: "
                 "name 'not_defined_here' is not defined): define it before this line, or write "
                 "`{{not_defined_here}}` for the literal text"], said


def test_python_m_pip_as_a_shell_escape_is_told_to_use_pct_pip_and_braces_become_an_f_string(
        shell: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """The advice was `subprocess.run('{sys.executable} -m pip --version', shell=True)`: literal braces."""
    said = shown(shell, capsys, "%%smol\n!{sys.executable} -m pip install -q tabulate\n")
    assert said.strip().splitlines()[-1] == (
        "SyntaxError: shell escapes other than !pip don't run in a machine cell: write `%pip install -q tabulate` "
        "(it runs pip of the machine's own Python)"), said
    said = shown(shell, capsys, "%%smol\n!ls {folder} $HOME\n")
    assert said.strip().splitlines()[-1] == (
        "SyntaxError: shell escapes other than !pip don't run in a machine cell: use "
        "`import subprocess; subprocess.run(f'ls {folder} {HOME}', shell=True)` instead"), said


WORDS = [  # what was typed, what the user now reads (argparse's own words, before: no fix)
    ("%smol delete", "%smol delete needs a node: e.g. `%smol delete root.3` (`%smol tree` lists them)"),
    ("%smol use", "%smol use needs a node: e.g. `%smol use root.3` (`%smol tree` lists them)"),
    ("%smol replay", "%smol replay needs a node: e.g. `%smol replay root.3` (`%smol tree` lists them)"),
    ("%smol checkpoint", "%smol checkpoint needs an action (save, restore, list, rm or export): "
                         "e.g. `%smol checkpoint list`"),
    ("%smol checkpoint lst", "unknown %smol checkpoint word 'lst': did you mean `%smol checkpoint list`? "
                             "one of save, restore, list, rm, export, trust (see %smol?)"),
    ("%smol ledger -n x", "-n takes a whole number, got 'x': e.g. `%smol ledger -n 20`"),
    ("%smol up --smolfile", "--smolfile needs a value: e.g. `%smol up --smolfile path/Smolfile`"),
    ("%smol up --backend smoll", "--backend 'smoll' is not one of auto, smol, sandbox, process: "
                                 "did you mean `--backend smol`?"),
    ("%smol up --retris 2", "unknown option --retris for %smol up: did you mean --retries?"),
    ("%%smol fork 2 --bogus", "unknown option --bogus for %%smol fork: it takes --seed-base, --seeds, --timeout, "
                              "--concurrency, --keep, --out, --bg, --group-outputs, --push, --allow-errors, --quiet, "
                              "--retries, --no-reseed (see %smol?)"),
    ("%%smol fork", "%%smol fork needs the number of branches: e.g. `%%smol fork 16`"),
    # a --keep no policy has is the parser's to refuse, as --timeout -1 is (was a SmolbenchError after it)
    ("%%smol fork 2 --keep some", "--keep 'some' is not one of best, all, none: e.g. `%%smol fork 16 --keep best`"),
    ("%%smol fork 2 --keep bset", "--keep 'bset' is not one of best, all, none: did you mean `--keep best`?"),
    ("%%smol fork 2 --timeout -1", "%%smol fork: --timeout must be a positive number of seconds, got '-1': "
                                   "e.g. --timeout 30 (see %smol?)"),
    ("%%smol --pul x", "--pul could be any of --pull, --pull-trusted: spell the option out (see %smol?)"),
    ("%smol up --retries -1", "--retries must be at least 0, got -1: e.g. --retries 1"),  # was Session(retries=1)
    ("%smol trust maybe", "'maybe' is not a trust setting: `%smol trust on` or `%smol trust off` (trusted mode is off)"),
]


@pytest.mark.parametrize("typed, said", WORDS, ids=[w[0] for w in WORDS])
def test_a_magic_s_wrong_words_are_one_line_with_the_fix(typed: str, said: str) -> None:
    from IPython.core.error import UsageError

    ip = get_ipython()
    ip.run_line_magic("load_ext", "smolbench")
    words = typed.split(None, 1)
    rest = words[1] if len(words) > 1 else ""
    with pytest.raises((UsageError, SmolbenchError)) as got:
        if words[0] == "%%smol":
            ip.run_cell_magic("smol", rest, "x = 1\n")
        else:
            ip.run_line_magic("smol", rest)
    assert str(got.value) == said


def test_a_fork_s_numbers_are_said_in_the_magics_words_and_the_session_s_in_its_own(shell: Any) -> None:
    with pytest.raises(SmolbenchError) as got:
        shell.run_cell_magic("smol", "fork 2 --concurrency 0", "reward = 1")
    assert str(got.value) == "--concurrency must be at least 1, got 0: e.g. --concurrency 4"
    with pytest.raises(SmolbenchError) as got:
        shell.run_cell_magic("smol", "fork 2 --retries -1", "reward = 1")
    assert str(got.value) == "--retries must be at least 0, got -1: e.g. --retries 1"
    with pytest.raises(SmolbenchError) as got:
        smolbench.Session(retries=-1)
    assert str(got.value) == "retries must be at least 0, got -1: e.g. Session(retries=1)"


def test_a_missing_file_is_relative_to_the_folder_only_when_its_path_is(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ip = get_ipython()
    ip.run_line_magic("load_ext", "smolbench")
    for path, said in [(f"{tmp_path}/nothere.smolcheckpoint", f"no file {tmp_path}/nothere.smolcheckpoint: check the path"),
                       ("sub/nothere.smolcheckpoint", "no file sub/nothere.smolcheckpoint: check the path (it is relative "
                                                      "to this notebook's folder)")]:
        with pytest.raises(SmolbenchError) as got:
            ip.run_line_magic("smol", f"checkpoint restore {path}")
        assert str(got.value) == said


def test_a_file_refused_on_the_process_backend_names_itself_in_the_fix(shell: Any, tmp_path: Path) -> None:
    shell.run_cell_magic("smol", "", "x = 1\n")
    (tmp_path / "class files").mkdir()
    shell.run_line_magic("smol", "checkpoint save warm")
    shell.run_line_magic("smol", "checkpoint export warm 'class files/warm.smolcheckpoint'")
    shell.run_line_magic("smol", "down")
    shell.run_line_magic("smol", "up --backend process --ledger other.db")
    with pytest.raises(SmolbenchError) as got:
        shell.run_line_magic("smol", "checkpoint restore 'class files/warm.smolcheckpoint'")
    assert str(got.value).endswith("restore it on the sandbox backend (`%smol down`, then `%smol checkpoint restore "
                                   "'class files/warm.smolcheckpoint'` brings one up); nothing was added"), got.value


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_status_s_limits_line_says_the_smolfile_s_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Smolfile").write_text('memory = "1G"\ndisk = "300M"\n')
    ip = get_ipython()
    ip.run_line_magic("load_ext", "smolbench")
    for backend, said in [("sandbox", "; disk 300M (the Smolfile's: the workspace and /tmp, held in memory)"),
                          ("process", "; disk not limited (the process backend writes to the host's own folders)")]:
        ip.run_line_magic("smol", f"up --backend {backend} --ledger ledger.db")
        try:
            capsys.readouterr()
            ip.run_line_magic("smol", "status")
            limits = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("limits"))
        finally:
            ip.run_line_magic("smol", "down")
        assert limits.endswith(said), limits


def test_a_result_past_the_output_limit_is_said_once(shell: Any, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """It was said twice: its own line, and again counted as "1 more displays not shown"."""
    from smolbench.gate import limits

    monkeypatch.setattr(limits.LIMITS, "output", 10_000)
    said = shown(shell, capsys, "%%smol\nprint('x' * 20_000)\n6 * 7\n")
    assert "smolbench: root's result was not shown: the cell's output passed its limit (`%smol config output-limit " \
           "SIZE` raises it)" in said, said
    assert "displays not shown" not in said, said
