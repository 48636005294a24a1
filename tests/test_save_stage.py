"""A machine's save stage can't blow up the host (issue 17), through a real kernel.

The machine writes its checkpoint files itself, so a cell can make them anything: here a
cell replaces its own agent's ``save`` to send more than the limit. The host reads both
files from fifos it made, as they come, within ``%smol config checkpoint-limit``, never
into memory or the host's /tmp, and refuses a checkpoint file claiming more before
unpacking it. Each refusal also runs with the check switched off (``archive.TEST_WEAKEN`` in the
kernel), where the same probe gets through. Also: a file named ``...`` restores, and a
machine killed for memory (during a save, or a cell) says so and leaves the tree.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from nbhelpers import NotebookSession, ok, one_line, result_text, stream_text, tree_text

from smolbench.backends import _limits

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

# In the machine: its own agent, whose save a cell replaces.
AGENT = "import os, smolbench_guest\n_agent = smolbench_guest._agent"


@pytest.fixture
def nb(open_tmp: Path) -> Iterator[NotebookSession]:
    (open_tmp / "Smolfile").write_text('memory = "512M"\ndisk = "128M"\n')
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as s:
        ok(s.run("%load_ext smolbench"))
        ok(s.run("%smol up --backend sandbox"))
        ok(s.run("%%smol\n" + AGENT))
        yield s


def _big_files(folder: Path, over: int) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file() and p.stat().st_size > over]


def test_a_stage_over_the_checkpoint_limit_is_refused_and_so_is_such_a_checkpoint(nb: NotebookSession, open_tmp: Path) -> None:
    ok(nb.run("%%smol\nopen('data.bin', 'wb').write(os.urandom(30 << 20))"))
    assert "saved checkpoint big" in stream_text(ok(nb.run("%smol checkpoint save big")))
    ok(nb.run("%smol config checkpoint-limit 20M"))
    line = one_line(nb.run("%smol checkpoint save big2"))  # its workspace streams in: stopped at the limit
    assert "sends a workspace of more than the checkpoint limit of 20 MB (stopped there)" in line, line
    assert "checkpoint-limit 4G" in line and "nothing was saved" in line, line
    # a checkpoint file that claims more than the limit is refused before it is unpacked
    line = one_line(nb.run("%smol checkpoint restore big"))
    assert "over the checkpoint limit of 20 MB" in line and "refused" in line, line
    # the header check off: the bytes are counted as they stream in, and stop at the limit
    ok(nb.run("from smolbench.gate import archive\narchive.TEST_WEAKEN.add('size')"))
    assert "unpacks to more than the checkpoint limit of 20 MB: stopped there" in one_line(
        nb.run("%smol checkpoint restore big"))
    ok(nb.run("archive.TEST_WEAKEN.add('stream')"))  # both off: the probe gets through
    assert "restored big" in stream_text(ok(nb.run("%smol checkpoint restore big")))


# In the machine: its save writes one of the host's fifos (TARGET) without end.
ENDLESS = r'''
def endless(path):
    os.makedirs(path, exist_ok=True)
    for name in ("namespace.pkl", "workspace.tar"):
        with open(os.path.join(path, name), "wb") as fh:
            if name != TARGET and name == "workspace.tar":
                __import__("tarfile").open(fileobj=fh, mode="w|").close()  # an empty one
            for _ in range(200 if name == TARGET else 0):  # 200 MB at most, the test's own bound
                fh.write(b"\0" * (1 << 20))
    return {"t": "done", "status": "ok", "skipped": [], "saved": []}
_agent.save = endless
'''


@pytest.mark.parametrize(("target", "sent"), [("workspace.tar", "a workspace"), ("namespace.pkl", "variables")])
def test_a_file_streamed_without_end_is_stopped_at_the_limit(nb: NotebookSession, open_tmp: Path, target: str,
                                                             sent: str) -> None:
    """The pickled variables and the workspace archive come through fifos the host reads as
    the machine writes them (no copy in the machine's memory): what the machine sends is
    counted as it comes, and stopped at the checkpoint limit; the machine's save is stopped
    too and the machine goes on."""
    ok(nb.run("%smol config checkpoint-limit 20M"))
    ok(nb.run(f"%%smol\nTARGET = {target!r}\n" + ENDLESS))
    line = one_line(nb.run("%smol checkpoint save endless"))
    assert f"sends {sent} of more than the checkpoint limit of 20 MB (stopped there)" in line, line
    assert "nothing was saved" in line, line
    assert _big_files(open_tmp, 1 << 20) == []
    assert result_text(ok(nb.run("%%smol\n1 + 1"))) == "2"  # not busy, not lost
    # Switched off, the host takes every byte the machine sends.
    ok(nb.run("from smolbench.gate import archive\narchive.TEST_WEAKEN.add('size')"))
    assert "saved checkpoint endless" in stream_text(ok(nb.run("%smol checkpoint save endless")))
    import tarfile
    with tarfile.open(next(open_tmp.rglob("endless.smolcheckpoint"))) as tar:
        assert tar.getmember(target).size == 200 << 20


def test_a_file_named_three_dots_restores(nb: NotebookSession) -> None:
    ok(nb.run("%%smol\nopen('...', 'w').write('dots')\nos.makedirs('d/...', exist_ok=True)\nopen('d/.../x', 'w').write('x')"))
    assert "saved checkpoint dots" in stream_text(ok(nb.run("%smol checkpoint save dots")))
    assert "restored dots" in stream_text(ok(nb.run("%smol checkpoint restore dots")))
    assert result_text(ok(nb.run("%%smol\nopen('...').read() + open('d/.../x').read()"))) == "'dotsx'"


SHARED = "import mmap  # shared memory: no rlimit counts it, the cgroup does\nm = mmap.mmap(-1, 800 << 20)\nfor i in range(0, 800 << 20, 1 << 20):\n    m[i:i + (1 << 20)] = b'x' * (1 << 20)\n"


@pytest.mark.skipif(not _limits.detect().bases, reason="needs a writable cgroup: only a cgroup kills a machine for memory")
def test_a_machine_killed_for_memory_says_so_and_leaves_the_tree(nb: NotebookSession) -> None:
    # during a save: the agent's save itself runs out of memory
    ok(nb.run("%%smol\ndef greedy(path):\n" + "".join("    " + ln + "\n" for ln in SHARED.splitlines()) + "_agent.save = greedy"))
    line = one_line(nb.run("%smol checkpoint save oom"))
    assert "machine ran out of memory while saving (limit 512M, its files included: up to disk = 128M" in line, line
    assert "delete big variables or files before saving, or raise memory" in line and "lower disk" not in line, line
    assert "machine root was lost" in line, line
    assert "closed the connection" not in line
    tree = tree_text(ok(nb.run("%smol tree")))
    assert "alive" not in tree and "active" not in tree and "lost" in tree, tree
    # and in a cell, on a fresh machine
    ok(nb.run("%smol up --backend sandbox"))
    line = one_line(nb.run("%%smol\n" + SHARED))
    assert "machine ran out of memory (limit 512M, the files it wrote included" in line, line
    assert "`%smol up` starts a fresh machine" in line, line
    assert "no machine is up: run `%smol up` first" in one_line(nb.run("%%smol\n1"))


def test_a_checkpoint_too_big_for_the_new_machine_says_so(open_tmp: Path) -> None:
    (open_tmp / "Smolfile").write_text('memory = "512M"\ndisk = "200M"\n')
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as s:
        ok(s.run("%load_ext smolbench"))
        ok(s.run("%smol up --backend sandbox"))
        ok(s.run("%%smol\nimport os\nwith open('data.bin', 'wb') as fh:\n    for _ in range(170):\n        fh.write(os.urandom(1 << 20))"))
        assert "saved checkpoint big" in stream_text(ok(s.run("%smol checkpoint save big")))
        ok(s.run("%smol down"))
        (open_tmp / "Smolfile").write_text('memory = "128M"\ndisk = "16M"\n')  # run folder: 160 MiB
        ok(s.run("%smol up --backend sandbox"))
        line = one_line(s.run("%smol checkpoint restore big"))
    assert re.search(r"doesn't fit in a machine of this Smolfile \(its files take 17[01] MiB, more than disk = 16M\)",
                     line), line
    assert 'set disk = "192M" and memory = "384M"' in line and "corrupt" not in line, line
