"""A user's script (``python script.py``) over a sandbox machine: a machine's exception caught
by the built-in class it is named after, and a flooding cell's output all there, shown or logged.

Both were checked only inside pytest's own process before (tests/test_session.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from nbhelpers import TAG_VAR, wait_for_no_processes

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

LINES = 120_000  # of 55 bytes: 6.6 MB, past the cell's 5 MB output limit

SCRIPT = f"""\
import json, smolbench

with smolbench.Session(backend="sandbox") as s:
    said = {{}}
    try:
        s.run("x = 1\\n1 / 0", check=True)
    except ZeroDivisionError as exc:
        said["caught"] = [type(exc).__name__, isinstance(exc, smolbench.RemoteError), exc.ename, "1 / 0" in "".join(exc.traceback)]
    try:
        s.run("import os\\nos.nosuchthing", check=True)
    except AttributeError as exc:
        said["attribute"] = isinstance(exc, smolbench.RemoteError)
    try:
        s.run("raise SystemExit(3)", check=True)
    except SystemExit:
        said["exit"] = "a machine's SystemExit ended the script's own code"
    except smolbench.RemoteError as exc:
        said["exit"] = type(exc).__name__
    r = s.run("import sys\\nfor i in range({LINES}):\\n    sys.stdout.write('line %07d ' % i + 'y' * 41 + '\\\\n')")
    said["log"] = r.output_log
    said["stdout"] = r.stdout
    said["ok"] = r.ok
    # the calls added to the Session since: what a cell displayed, checkpoints, a replay
    r = s.run("display(7)\\ndisplay.__self__._agent.send({{'t': 'display', 'data': {{'application/javascript': 'x'}}}})")
    said["displays"] = [dict(d) for d in r.displays]
    said["notes"] = r.notes
    s.run("warm = 41")
    s.checkpoint_save("warm")
    said["checkpoints"] = [c["name"] for c in s.checkpoints()]
    fork = s.fork(2, "reward = SEED", seeds=[3, 5], keep="all")
    said["replay"] = s.replay(fork.best["branch"])["match"]
    said["restored"] = s.run("warm + 1", node=s.checkpoint_restore("warm")).value
    s.checkpoint_rm("warm")
    said["after_rm"] = [c["name"] for c in s.checkpoints()]
print("SAID " + json.dumps(said))
"""


def test_a_script_catches_a_machines_error_as_the_builtin_and_finds_all_of_a_floods_output(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG_VAR: tag, "TMPDIR": str(tmp_path / "tmp")}
    try:
        done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env, text=True, capture_output=True,
                              timeout=240)
    finally:
        assert wait_for_no_processes(tag, timeout=10) == []
    assert done.returncode == 0, done.stderr
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("SAID ")]
    said = json.loads(line[5:])
    assert said["caught"] == ["ZeroDivisionError", True, "ZeroDivisionError", True]
    assert said["attribute"] is True
    assert said["exit"] == "SystemExit"  # a plain RemoteError of that name: it never ends the script
    assert said["ok"] is True
    assert said["displays"] == [{"text/plain": "7"}]
    assert len(said["notes"]) == 1 and "application/javascript" in said["notes"][0] and "%smol" not in said["notes"][0]
    assert said["checkpoints"] == ["warm"] and said["after_rm"] == []
    assert said["replay"] is True and said["restored"] == 42
    log = Path(said["log"])
    assert log.is_absolute() and log.is_file() and log.parent == tmp_path / ".smolbench" / "outputs"
    shown, _, note = said["stdout"].rstrip("\n").rpartition("\n")
    assert "more output not shown" in note and str(log.relative_to(tmp_path)) in note, note
    everything = "".join(f"line {i:07d} " + "y" * 41 + "\n" for i in range(LINES))
    assert shown + "\n" + log.read_text() == everything  # what was shown, then the rest in the log: all of it
