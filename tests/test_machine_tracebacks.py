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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gymhelpers import define, up_bench
from nbhelpers import TAG_VAR, wait_for_no_processes

import smolbench.gym as sgym
from smolbench import SmolbenchError
from smolbench.backends.base import CellResult
from smolbench.errors import CompositeError, remote_error
from smolbench.gate import TRACEBACK
from smolbench.gate.terminal import RESET
from smolbench.gym import episode
from smolbench.workbench import Workbench

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


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    yield from up_bench(tmp_path_factory)


HELPER = '''
import gymnasium, numpy as np
from gymnasium import spaces

def helper(a):
    return {}["missing thing %d" % a]

class Helped(gymnasium.Env):
    observation_space = spaces.Discrete(2)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action):
        if action == 0:
            return 0, 1.0, False, False, {}
        helper(action)

def helped():
    return Helped()
'''


def _printed(err: BaseException) -> str:
    return "".join(traceback.format_exception(err))


@needs_bwrap
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_envs_error_keeps_the_envs_traceback(bench: Workbench) -> None:
    define(bench, HELPER)
    env = sgym.make("helped", session=bench)
    try:
        env.reset(seed=1)
        with pytest.raises(KeyError) as caught:  # caught as a local env's KeyError would be
            env.step(1)
        err = caught.value
        assert isinstance(err, sgym.GymError) and isinstance(err, SmolbenchError)
        line = str(err)
        assert line.startswith("the env (machine root.") and line.endswith("KeyError: 'missing thing 1'")
        assert "\n" not in line
        frames = "".join(err.traceback)  # the env's frames, none of the serving loop's
        assert frames.startswith('  File "<cell-') and "in step\n    helper(action)\n" in frames
        assert 'line 6, in helper\n    return {}["missing thing %d" % a]' in frames
        assert "gymserve" not in frames
        printed = _printed(err)
        assert 'line 6, in helper\n    return {}["missing thing %d" % a]' in printed and f"GymError: {line}" in printed
        shown = "\n".join(err._render_traceback_())  # IPython's
        assert "in helper" in shown and shown.endswith(line)
        env.reset()
        assert env.step(0)[1] == 1.0  # the env goes on
    finally:
        env.close()

    envs = sgym.make_vec("helped", 2, session=bench)
    try:
        envs.reset(seed=2)
        with pytest.raises(KeyError) as caught:
            envs.step([0, 1])
        err = caught.value
        assert str(err).startswith("sub-env 1 (machine root.") and "\n" not in str(err)
        assert "in helper" in "".join(err.traceback) and "in helper" in _printed(err)
        infos = err.results[4]  # type: ignore[attr-defined]
        assert infos["smolbench_error"][1] == str(err)  # the results keep the one line
    finally:
        envs.close()


BROKEN = HELPER + '''
def broken():
    return helper(3)
'''


@needs_bwrap
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_env_that_cannot_be_built_keeps_the_factorys_traceback(bench: Workbench) -> None:
    define(bench, BROKEN)
    with pytest.raises(KeyError) as caught:
        sgym.make("broken", session=bench)
    err = caught.value
    assert str(err).startswith("the env could not be built in machine ") and str(err).endswith("'missing thing 3'")
    assert "\n" not in str(err)
    frames = "".join(err.traceback)
    assert "in broken\n    return helper(3)\n" in frames and "in helper" in frames and "gymserve" not in frames
    assert "return helper(3)" in _printed(err)


# The machine rewrites what its agent sends for the env's error: a traceback of 2 MB whose lines
# clear the screen, set the terminal's title, reverse the text and leave a colour on.
CRAFTED = '''
import gymnasium, smolbench_guest
from gymnasium import spaces

EVIL = '  File "<evil>", line 1, in x\\n    \\x1b[2J\\x1b]0;pwned\\x07\\u202e' + "A" * 50000 + "\\n"

class Crafted(gymnasium.Env):
    observation_space = spaces.Discrete(2)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action):
        agent = smolbench_guest._agent
        send = agent.send

        def crafted(msg):
            if msg.get("t") == "answer" and msg.get("error"):
                msg["error"]["traceback"] = [EVIL] * 40 + ['  File "<evil>", line 2, in y\\n    \\x1b[31mleft red\\n']
            send(msg)
        agent.send = crafted
        raise KeyError("boom")

def crafted():
    return Crafted()
'''


@needs_bwrap
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_crafted_env_traceback_is_bounded_and_escaped(bench: Workbench) -> None:
    define(bench, CRAFTED)
    env = sgym.make("crafted", session=bench)
    try:
        env.reset(seed=1)
        with pytest.raises(KeyError) as caught:
            env.step(1)
    finally:
        env.close()
    err = caught.value
    assert "\n" not in str(err) and str(err).endswith("KeyError: 'boom'")
    kept = err.traceback
    assert sum(map(len, kept)) <= TRACEBACK + 200  # the gate's bound: its end, and how much is left out
    assert "earlier lines of the traceback not shown" in kept[0]
    assert kept[-1].endswith(f"left red{RESET}\n")  # in IPython, each line's style ends with it
    (note,) = err.__notes__
    printed = _printed(err)
    for raw in ("\x1b", "\x07", "\u202e"):
        assert raw not in note and raw not in printed  # nothing a terminal acts on
    assert "\\x1b[2J\\x1b]0;pwned\\x07\\u202eAAA" in note and "left red" in note  # shown, escaped
    assert len(note) <= TRACEBACK + 1000


def test_a_one_request_cells_error_keeps_only_the_envs_frames() -> None:
    res = CellResult("error", error={"ename": "ValueError", "evalue": "no", "traceback": [
        '  File "<gym-3@root.0.1>", line 1, in <module>\n',
        '  File "<smolbench gymserve>", line 333, in step\n',
        '  File "/env/mine.py", line 9, in step\n    raise ValueError("no")\n']})
    with pytest.raises(ValueError) as caught:
        episode.cell_out(res, "sub-env 1 (machine root.0.1)")
    assert str(caught.value) == "sub-env 1 (machine root.0.1): ValueError: no"
    assert caught.value.traceback == ['  File "/env/mine.py", line 9, in step\n    raise ValueError("no")\n']  # type: ignore[attr-defined]


def test_a_machine_s_message_reaches_a_terminal_as_plain_text() -> None:
    """A machine's exception message, as ``str(err)`` (Python's printer, ``print(err)``,
    logging): its escapes set a terminal's title, wrote its clipboard (OSC 52) and cleared its
    screen, and a bidi override reordered the line. Shown escaped; the notebook's render keeps
    the message's colours (JupyterLab acts on nothing else)."""
    evil = "loss diverged\x1b]0;pwned\x07\x1b]52;c;cHduZWQ=\x07\x1b[2J\u202e\x1b[31mred"
    err = remote_error("ValueError", evil, [], "root")
    said = str(err)
    assert said.isprintable() and "\\x1b]52;c;" in said and "\\u202e" in said, said
    assert said.startswith("loss diverged") and said.endswith("red")
    assert "\x1b[31mred" in "".join(err.render())  # the notebook keeps the colour
    assert str(remote_error("ValueError", "plain words\nsecond line", [], "root")) == "plain words\nsecond line"
    printed = "".join(traceback.format_exception(err))  # what a script's uncaught error prints
    assert "\x1b" not in printed and "\u202e" not in printed, printed


def test_an_env_s_error_message_reaches_a_terminal_as_plain_text() -> None:
    """The same for a gym env's error (a trainer logs it): its one line was the env's words raw."""
    from smolbench.gym.episode import env_error

    err = env_error("the env (machine root.0.1): ValueError: X\x1b]0;pwned\x07Y\u202eZ\x1b[0m",
                    {"ename": "ValueError", "evalue": "X\x1b]0;pwned\x07Y\u202eZ", "traceback": []})
    assert str(err) == "the env (machine root.0.1): ValueError: X\\x1b]0;pwned\\x07Y\\u202eZ", str(err)
    assert isinstance(err, ValueError)
