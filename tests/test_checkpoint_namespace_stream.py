"""A save pickled the variables into one bytes object in the machine's memory and then sent it,
and a restore put that pickle in the new machine's folder (memory too, in a sandbox) and read
it whole: a machine holding an array of more than half its memory ran out of memory saving
it, and its checkpoint could not come back into a machine like it. Now each variable is
pickled straight into a fifo the host reads (and a restore reads them from a fifo the host
writes), counted against the checkpoint limit as they come."""

from __future__ import annotations

import io
import pickle
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpthelpers import forged, workspace

import smolbench
from smolbench.backends import _limits
from smolbench.errors import SmolbenchError
from smolbench.gate import archive
from smolbench.gate.limits import LIMITS, configure
from smolbench.guest import nsstream

needs_sandbox = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install "
                                   "bubblewrap)")
needs_cgroup = pytest.mark.skipif(not _limits.detect().bases, reason="needs a writable cgroup to hold a machine to its "
                                  "memory")

# 240 MiB of float64 in a 384M machine: more than half its memory (a second copy can't fit)
BIG = "import numpy as np\nbig = np.arange(30 << 20, dtype=np.float64)"
# equal to np.arange, compared a MiB at a time (a whole comparison would be another copy)
SAME = ("import numpy as np\nbool(big.dtype == np.float64 and big.shape == (30 << 20,) and all(\n"
        "    (big[i:i + (1 << 17)] == np.arange(i, i + (1 << 17), dtype=np.float64)).all()\n"
        "    for i in range(0, big.size, 1 << 17)))")


@pytest.fixture
def here(open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(open_tmp)
    (open_tmp / "Smolfile").write_text('memory = "384M"\n')
    yield open_tmp


@needs_sandbox
@needs_cgroup
def test_a_variable_of_more_than_half_the_memory_saves_and_restores(here: Path) -> None:
    pytest.importorskip("numpy")
    notes: list[str] = []
    with smolbench.Session(backend="sandbox", on_notice=notes.append) as s:
        assert s.run(BIG + "\nimport threading\nlock = threading.Lock()\nsmall = {'a': 1}").error is None
        # before: "not saved (can't be pickled): big (MemoryError), lock (TypeError)", and big was gone
        saved = s.checkpoint_save("big")
        assert saved["name"] == "big", saved
        assert s.run(SAME).value is True  # the machine saved is the machine kept, its variable with it
        assert [n for n in notes if "can't be pickled" in n] == [
            "smolbench: warning: not saved (can't be pickled): lock (TypeError)"], notes
    with smolbench.Session(backend="sandbox", on_notice=notes.append) as s:  # a fresh up, the same Smolfile
        node = s.checkpoint_restore("big")
        assert s.run(SAME, node=node).value is True
        assert s.run("small, 'lock' in globals()", node=node).value == ({"a": 1}, False)


@needs_sandbox
def test_variables_over_the_checkpoint_limit_are_refused_and_nothing_is_left(here: Path) -> None:
    folder = here / ".smolbench" / "checkpoints"
    old = LIMITS.checkpoint
    with smolbench.Session(backend="sandbox", on_notice=lambda line: None) as s:
        assert s.run("import os\nblob = os.urandom(30 << 20)").error is None
        try:
            configure("checkpoint-limit", "20M")
            with pytest.raises(SmolbenchError) as refused:
                s.checkpoint_save("over")
        finally:
            LIMITS.checkpoint = old
        line = str(refused.value)
        assert "\n" not in line, line
        assert "sends variables of more than the checkpoint limit of 20 MB (stopped there)" in line, line
        assert "configure('checkpoint-limit', '4G')" in line and line.endswith("nothing was saved"), line
        assert not folder.exists() or [p.name for p in folder.iterdir()] == []  # no part file, no checkpoint
        assert s.run("len(blob)").value == 30 << 20  # the machine goes on, its variable kept
        assert s.checkpoint_save("within")["name"] == "within"  # and saves within the limit
        # its restore under a lower limit: refused by its headers; with that check off, the
        # variables are counted as they are sent into the machine, and stopped there
        try:
            configure("checkpoint-limit", "20M")
            archive.TEST_WEAKEN.add("size")
            with pytest.raises(SmolbenchError) as refused:
                s.checkpoint_restore("within")
        finally:
            LIMITS.checkpoint = old
            archive.TEST_WEAKEN.discard("size")
        assert "unpacks to more than the checkpoint limit of 20 MB: stopped there" in str(refused.value), refused.value
        assert s.workbench is not None and list(s.workbench.machines) == ["root"]  # its new machine went
        assert s.run("len(blob)").value == 30 << 20


@needs_sandbox
def test_a_checkpoint_of_the_earlier_layout_still_restores(here: Path) -> None:
    """Before the stream, a namespace was one pickle of each variable's pickle: such files restore."""
    old = pickle.dumps({"vars": {"x": pickle.dumps([1, 2, 3], protocol=4), "bad": b"not a pickle"},
                        "modules": {"j": "json"}, "seed": None, "name": "root"}, protocol=4)
    given = here / "earlier.smolcheckpoint"
    forged(given, None, [("namespace.pkl", old), ("workspace.tar", workspace())])
    notes: list[str] = []
    with smolbench.Session(backend="sandbox", on_notice=notes.append) as s:
        node = s.checkpoint_restore(str(given))
        assert s.run("x, j.dumps(x), open('hello.txt').read()", node=node).value == ([1, 2, 3], "[1, 2, 3]", "hi")
    assert any("not restored: bad (UnpicklingError" in n for n in notes), notes


def test_a_value_that_fails_midway_is_dropped_and_the_rest_comes_back() -> None:
    """Pickled straight into the stream, a value whose pickling fails midway has written part of
    itself: it is dropped (named as not saved), and so is one that can't be unpickled, each alone."""
    out = io.BytesIO()
    items = [("a", list(range(1000))), ("half", {"big": b"x" * (3 << 20), "lock": threading.Lock()}),
             ("e", ValueError("a value, not a failure")), ("z", "last")]
    saved, skipped = nsstream.dump(out, {"modules": {}, "seed": 7, "name": "root"}, items)
    assert saved == ["a", "e", "z"] and skipped == ["half (TypeError)"]
    out.seek(0)
    head, variables = nsstream.load(out)
    got = {k: v for k, v, err in variables}
    assert head["seed"] == 7 and got["a"] == list(range(1000)) and got["z"] == "last" and set(got) == {"a", "e", "z"}
    assert isinstance(got["e"], ValueError)
