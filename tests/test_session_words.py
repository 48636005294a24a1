"""A Session user is told the fix in the Session's words, never a magic's: a pull the gate
refused said `--pull-trusted (or %smol trust on)`, a checkpoint name taken said `add --force`,
a checkpoint over the limit said `%smol config checkpoint-limit 4G`, a missing one `%smol
checkpoint list`. The magics keep theirs (`SmolbenchError(magic, api=session)`)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import IPython
import pytest
from IPython.testing.globalipapp import start_ipython

import smolbench
from smolbench.errors import SmolbenchError, session_phrases
from smolbench.gate import limits

MAGIC = re.compile(r"%%?smol|(?<![\w-])--[a-z]")
PACKAGE = Path(smolbench.__file__).parent


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def get_ipython() -> Any:
    """The test IPython (started once per process: a second start_ipython() is None)."""
    return start_ipython() or IPython.get_ipython()


def _said(call: object) -> str:
    with pytest.raises(SmolbenchError) as got:
        call()  # type: ignore[operator]
    text = str(got.value)
    assert not MAGIC.search(text), text
    return text


def test_session_errors_name_session_calls_not_magics(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=lambda line: None) as s:
        s.run("import fractions; f = fractions.Fraction(1, 3)")
        assert "pull=['f']: a" in _said(lambda: s.run("1", pull=["f"]))  # not data: refused by the gate
        s.checkpoint_save("warm")
        assert "force=True" in _said(lambda: s.checkpoint_save("warm"))
        assert "Session.status()['live_machines']" in _said(lambda: s.checkpoint_save("x", node="root.9"))
        assert "Session.checkpoints()" in _said(lambda: s.checkpoint_restore("nope"))
        assert "force=True" in _said(lambda: s.checkpoint_export("warm", _exists(here)))
        assert "Session.ledger().nodes()" in _said(lambda: s.replay("root.9"))
        monkeypatch.setattr(limits.LIMITS, "checkpoint", 100)  # as `configure("checkpoint-limit", ...)` sets it
        assert "configure('checkpoint-limit', '4G')" in _said(lambda: s.checkpoint_restore(_exists(here)))
        monkeypatch.setattr(limits.LIMITS, "max_frame", 10_000)
        assert "configure('max-frame', SIZE)" in _said(lambda: s.run("print('x' * 20_000, end='')"))
    assert "Session.checkpoints()" in _said(lambda: s.checkpoint_rm("nope"))  # nothing up: this folder's
    assert "Session.checkpoints()" in _said(lambda: s.checkpoint_restore("nope"))
    assert [row["name"] for row in s.checkpoints()] == ["warm"]
    assert s.checkpoint_rm("warm") == "removed checkpoint warm" and s.checkpoints() == []


def test_session_options_are_named_as_the_session_takes_them(here: Path) -> None:
    """The network options and a Smolfile path are said as ``Session(...)`` takes them, also
    where a layer below the Session wrote the line (the network policy's parser)."""
    said = _said(lambda: smolbench.Session(backend="process", net="off", allow="pypi.org").up())
    assert said == "net='off' and allow= contradict each other: drop one"
    assert "allow= entry 'https://pypi.org'" in _said(lambda: smolbench.Session(backend="process",
                                                                                 allow="https://pypi.org").up())
    assert "smolfile '~no-such-user-here/Smolfile'" in _said(lambda: smolbench.Session("~no-such-user-here/Smolfile",
                                                                                       backend="process").up())
    (here / "bad.db").write_bytes(b"not a database" * 100)
    assert "name another with `Session(ledger=PATH)`" in _said(lambda: smolbench.Session(backend="process",
                                                                                         ledger="bad.db").up())
    shell = get_ipython()
    shell.run_line_magic("load_ext", "smolbench")
    try:
        with pytest.raises(SmolbenchError, match="name another with --ledger PATH"):
            shell.run_line_magic("smol", "up --backend process --ledger bad.db")
        with pytest.raises(SmolbenchError, match="^--net off and --allow contradict each other"):
            shell.run_line_magic("smol", "up --backend process --net off --allow pypi.org")
        with pytest.raises(SmolbenchError, match="^--allow entry 'https://pypi.org'"):
            shell.run_line_magic("smol", "up --backend process --allow https://pypi.org")
    finally:
        shell.run_line_magic("unload_ext", "smolbench")


# A display of a type the gate never shows (sent as a machine may), then more displays than a cell shows.
DISPLAYS = ("display.__self__._agent.send({'t': 'display', 'data': {'application/javascript': 'alert(1)', "
            "'text/plain': 'js'}})\nfor i in range(3):\n    display(i)\n")


def test_the_hosts_notes_on_output_are_in_the_callers_words(here: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """What the gate says of a cell's output it held back names the Session's calls to a
    Session's ``on_output`` and the magics' commands under a cell; the machine's text is its own."""
    monkeypatch.setattr(limits.LIMITS, "displays", 2)  # as `configure("displays", 2)` sets it
    heard: list[str] = []
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=lambda line: None) as s:
        s.fork(1, DISPLAYS + "print('`%smol trust on`')\nreward = 1",
               on_output=lambda branch, ev: heard.append(ev.text) if ev.kind == "stream" else None)
        notes = [text for text in heard if text.startswith(("smolbench:", "…"))]
        assert notes == ["smolbench: root.0 sent application/javascript output, which was not shown (it could run in "
                         "your browser); `Session.workbench.set_trust(True)` shows machine output raw\n",
                         "… 2 more displays not shown (past 2 displays in one cell; `smolbench.gate.limits.configure("
                         "'displays', N)` or `smolbench.gate.limits.configure('output-limit', SIZE)` raises the limit)\n"]
        assert "`%smol trust on`\n" in heard  # what the machine printed is not reworded
        assert s.status()["trusted"] == "off"
        assert s.workbench is not None
        s.workbench.set_trust(True)
        assert s.status()["trusted"] == "ON: pulls unpickled, output raw (`Session.workbench.set_trust(False)`)"

    shell = get_ipython()
    shell.run_line_magic("load_ext", "smolbench")
    try:
        shell.run_line_magic("smol", "up --backend process --ledger ledger.db")
        capsys.readouterr()
        shell.run_cell_magic("smol", "fork 1", DISPLAYS + "reward = 1")
        said = capsys.readouterr()
        assert "not shown (it could run in your browser); `%smol trust on` shows machine output raw" in said.err
        assert "`%smol config displays N` or `%smol config output-limit SIZE` raises the limit" in said.err
        shell.run_line_magic("smol", "trust on")
        assert get_ipython().find_magic("smol").__self__.session.status()["trusted"].endswith("(`%smol trust off`)")
        shell.run_line_magic("smol", "down")
    finally:
        shell.run_line_magic("unload_ext", "smolbench")


def test_a_forks_summary_names_the_session_arguments(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Session's fork whose branches tie, or that kept none for want of a reward, says so
    with its arguments (``reseed=False``, ``keep='all'``); a ``%%smol fork`` with its options."""
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=lambda line: None) as s:
        tied = s.fork(2, "reward = 1.0", reseed=False).summary()
        assert "reseed=False left the random streams" in tied and not MAGIC.search(tied), tied
        none = s.fork(2, "pass").summary()
        assert "so keep='best' kept none: every branch was deleted (keep='all' keeps them)" in none, none
    shell = get_ipython()
    shell.run_line_magic("load_ext", "smolbench")
    try:
        shell.run_line_magic("smol", "up --backend process --ledger ledger.db")
        capsys.readouterr()
        tied = shell.run_cell_magic("smol", "fork 2 --no-reseed", "reward = 1.0")  # (the cell's Out[])
        shell.run_cell_magic("smol", "fork 2", "pass")
        said = capsys.readouterr()
        assert "--no-reseed left the random streams" in tied.summary(), tied.summary()
        assert "left the random streams" not in said.out + said.err, said  # said once: in the result's summary
        assert "so `--keep best` kept none: every branch was deleted (`--keep all` keeps them)" in said.out + said.err
        shell.run_line_magic("smol", "down")
    finally:
        shell.run_line_magic("unload_ext", "smolbench")


def test_a_cells_pull_trusted_warns_of_that_cell_only(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``%%smol --pull-trusted`` unpickles that cell's pulls: its warning says so, not that
    trusted mode is on (its output is not raw), and `%smol trust on` still says its own."""
    shell = get_ipython()
    shell.run_line_magic("load_ext", "smolbench")
    try:
        shell.run_line_magic("smol", "up --backend process --ledger ledger.db")
        capsys.readouterr()
        shell.run_cell_magic("smol", "--pull-trusted --pull o", "import fractions\no = fractions.Fraction(1, 3)")
        assert repr(shell.user_ns["o"]) == "Fraction(1, 3)"
        err = capsys.readouterr().err
        assert err == ("smolbench: warning: --pull-trusted: what this cell pulls (o) is unpickled here when it is "
                       "not plain data, so code in the machine can run code in this kernel; use it only for "
                       "machines running code you trust\n"), err
        shell.run_line_magic("smol", "trust on")
        assert "trusted mode: objects pulled from the machine are unpickled here and its output is shown raw" in \
            capsys.readouterr().err
        shell.run_cell_magic("smol", "--pull-trusted --pull o", "o = 2")
        assert capsys.readouterr().err == ""  # trusted mode's warning was said
        shell.run_line_magic("smol", "down")
    finally:
        shell.run_line_magic("unload_ext", "smolbench")


def _exists(here: Path) -> str:
    path = here / "there.smolcheckpoint"
    path.write_bytes(b"\x1f\x8b" + bytes(200))
    return str(path)


def test_the_magics_keep_their_words(here: Path) -> None:
    shell = get_ipython()
    shell.run_line_magic("load_ext", "smolbench")
    try:
        shell.run_line_magic("smol", "up --backend process --ledger ledger.db")
        shell.run_line_magic("smol", "checkpoint save warm")
        with pytest.raises(SmolbenchError, match="add --force to replace it"):
            shell.run_line_magic("smol", "checkpoint save warm")
        with pytest.raises(SmolbenchError, match=r"\(`%smol checkpoint list`\)"):
            shell.run_line_magic("smol", "checkpoint restore nope")
        shell.run_line_magic("smol", "down")
    finally:
        shell.run_line_magic("unload_ext", "smolbench")


def _literal(node: ast.AST) -> str:
    """A message's text as written, each ``{hole}`` an ``X``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_literal(v) if isinstance(v, ast.Constant) else "X" for v in node.values)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) + _literal(node.right)
    return "X"


# Raised where no Session method reaches: the magics' own, and `configure` (a Python caller's own call).
NOT_FROM_A_SESSION = {"magics.py", "_magicargs.py", "gate/limits.py"}


def _raise_sites() -> Iterator[tuple[str, str, ast.Call]]:
    """Each call that makes an error a Session method may raise, without ``api=``: its file,
    the function it is in, the call."""
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        if where.startswith("guest/") or where in NOT_FROM_A_SESSION:
            continue
        tree = ast.parse(path.read_text())
        inside: dict[ast.AST, str] = {}  # each node, the innermost function it is in (outer ones come first)
        for func in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
            inside.update((node, getattr(func, "name", "")) for node in ast.walk(func))
        for node, name in inside.items():
            if not (isinstance(node, ast.Call) and node.args and ("raise" in ast.dump(node.func).lower()
                                                                 or _raises(node))):
                continue
            if not any(k.arg == "api" for k in node.keywords):
                yield where, name, node


def test_every_message_that_names_a_magic_command_has_session_words() -> None:
    """Each error raised with a `%smol` command in it either carries ``api=`` or names only
    commands :func:`session_phrases` says as Session calls."""
    left = {f"{where}:{node.lineno}: {_literal(node.args[0])[:100]}" for where, _, node in _raise_sites()
            if re.search(r"%%?smol", session_phrases(_literal(node.args[0])))}
    assert not left, "\n".join(sorted(left))


# Raised only under a command line's own options (`smolbench serve --port`, `smolbench image build
# --suite`, `smolbench cluster local --nodes`), never by a Session method: their words are right.
COMMAND_LINE_ONLY = {"cli.py", "serve.py", "_replies.py", "cluster/local.py", "images.py:build_debian_rootfs"}
# A shell command quoted for the user to type (`apt-get install x`, `ray start --head`): its
# options are that program's. A quoted `--backend process` is a magic's and is not skipped.
_QUOTED_COMMAND = re.compile(r"`[^`%-][^`]*`")


def test_every_message_that_names_a_magic_option_has_session_words() -> None:
    """Each error raised with a magic's option in it (``--target local``, ``--push``) either
    carries ``api=`` or names only options :func:`session_phrases` says in Session words."""
    left = set()
    for where, func, node in _raise_sites():
        if where in COMMAND_LINE_ONLY or f"{where}:{func}" in COMMAND_LINE_ONLY:
            continue
        text = _literal(node.args[0])
        if re.search(r"(?<![\w-])--[a-z]", _QUOTED_COMMAND.sub("", session_phrases(text))):
            left.add(f"{where}:{node.lineno}: {text[:100]}")
    assert not left, "\n".join(sorted(left))


def _raises(node: ast.Call) -> bool:
    name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
    return name.endswith(("Error", "Lost", "Unavailable", "Checkpoint")) or name in ("Bad", "reworded")


def test_session_replay_rebuilds_a_deleted_branch_as_the_magic_does(here: Path) -> None:
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=lambda line: None) as s:
        s.run("base = 10")
        s.fork(3, "reward = base + SEED", keep="best")
        seen: list[str] = []
        report = s.replay("root.1", on_output=lambda branch, ev: seen.append(branch))
        assert report["match"] and report["reward"] == report["recorded"] == 11, report
        assert "root.1" not in (s.workbench.machines if s.workbench else {})  # its temporary branch went
