"""Sandbox branches are copy-on-write for files too (issue 12), through a real kernel.

A branch sees its parent's workspace and /tmp as they were at the fork and writes to
its own layer: siblings and the parent never see its writes, it never sees what the
parent writes after the fork, nested forks stack layers, and a checkpoint of a branch
holds its merged view.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from nbformat import NotebookNode
from nbhelpers import NotebookSession, error_text, result_text, stream_text

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

BIG_MIB = 200
DIGEST = "import hashlib, os\ndef digest(p):\n    return hashlib.sha256(open(p, 'rb').read()).hexdigest()[:12]\n"


def ok(cell: NotebookNode) -> NotebookNode:
    err = error_text(cell)
    assert not err, f"{cell.source[:60]!r} raised:\n{err}"
    return cell


class Session:
    def __init__(self, nb: NotebookSession) -> None:
        self.nb = nb

    def on(self, node: str, code: str) -> str:
        """Run ``code`` in machine ``node``; its last expression's repr."""
        ok(self.nb.run(f"%smol use {node}"))
        value = result_text(ok(self.nb.run("%%smol\n" + code)))
        assert value is not None, code
        return value


@pytest.fixture
def s(open_tmp: Path) -> Iterator[Session]:
    with NotebookSession(open_tmp, timeout=300) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
        ok(nb.run("%%smol\n" + DIGEST))
        yield Session(nb)


def test_a_branch_overwrites_the_parents_200mb_file_and_nobody_else_sees_it(s: Session) -> None:
    original = s.on("root", f"import os\nopen('big.bin', 'wb').write(os.urandom({BIG_MIB} << 20))\n"
                            "open('/tmp/t.txt', 'w').write('parent')\ndigest('big.bin')")
    ok(s.nb.run("%%smol fork 2 --keep all --quiet\npass"))
    # the branch sees the parent's file, then overwrites it (and /tmp)
    assert s.on("root.0", "digest('big.bin')") == original
    changed = s.on("root.0", f"open('big.bin', 'wb').write(os.urandom({BIG_MIB} << 20))\n"
                             "open('/tmp/t.txt', 'w').write('root.0')\ndigest('big.bin')")
    assert changed != original
    assert s.on("root.0", "digest('big.bin'), open('/tmp/t.txt').read()") == f"({changed}, 'root.0')"
    assert s.on("root.1", "digest('big.bin'), open('/tmp/t.txt').read()") == f"({original}, 'parent')"
    assert s.on("root", "digest('big.bin'), open('/tmp/t.txt').read()") == f"({original}, 'parent')"
    # a deletion in a branch is its own too
    assert s.on("root.1", "os.remove('big.bin')\nos.path.exists('big.bin')") == "False"
    assert s.on("root", "os.path.exists('big.bin')") == "True"


def test_the_parents_writes_after_the_fork_stay_out_of_existing_branches(s: Session) -> None:
    s.on("root", "open('notes.txt', 'w').write('before')\n1")
    ok(s.nb.run("%%smol fork 2 --keep all --quiet\npass"))
    s.on("root", "open('notes.txt', 'w').write('after')\nopen('new.txt', 'w').write('x')\n"
                 "open('/tmp/late.txt', 'w').write('x')\n1")
    for branch in ("root.0", "root.1"):
        seen = s.on(branch, "import os\n(open('notes.txt').read(), os.path.exists('new.txt'), os.path.exists('/tmp/late.txt'))")
        assert seen == "('before', False, False)"
    # and a second fork of the parent does see them (its layers were frozen again)
    ok(s.nb.run("%smol use root"))
    ok(s.nb.run("%%smol fork 1 --keep all --quiet\npass"))
    assert s.on("root.2", "(open('notes.txt').read(), os.path.exists('new.txt'))") == "('after', True)"


def test_nested_forks_three_deep_stack_layers(s: Session) -> None:
    s.on("root", "open('level.txt', 'w').write('0')\nopen('root.txt', 'w').write('r')\n1")
    node = "root"
    for depth in (1, 2, 3):
        ok(s.nb.run(f"%smol use {node}"))
        ok(s.nb.run("%%smol fork 2 --keep all --quiet\npass"))
        child = f"{node}.0"
        # the child sees every ancestor's files as they were at its fork, then writes its own
        seen = s.on(child, f"v = open('level.txt').read()\nopen('level.txt', 'w').write(v + '{depth}')\n"
                           f"open('only-{depth}.txt', 'w').write('x')\nopen('level.txt').read()")
        assert seen == repr("0123"[: depth + 1])
        # its sibling and its parent don't see the child's writes
        assert s.on(f"{node}.1", f"(open('level.txt').read(), os.path.exists('only-{depth}.txt'))") == \
            f"({'0123'[:depth]!r}, False)"
        node = child
    assert s.on("root", "import os\n(open('level.txt').read(), sorted(f for f in os.listdir() if f.startswith('only')))") == \
        "('0', [])"
    assert s.on("root.0.0.0", "sorted(f for f in os.listdir() if f.endswith('.txt'))") == \
        "['level.txt', 'only-1.txt', 'only-2.txt', 'only-3.txt', 'root.txt']"


def test_a_checkpoint_of_a_branch_restores_its_merged_files(s: Session) -> None:
    s.on("root", "open('base.txt', 'w').write('root')\nopen('gone.txt', 'w').write('x')\n1")
    ok(s.nb.run("%%smol fork 1 --keep all --quiet\npass"))
    s.on("root.0", "import os\nopen('mine.txt', 'w').write('branch')\nos.remove('gone.txt')\n"
                   "open('base.txt', 'a').write('+branch')\n1")
    saved = ok(s.nb.run("%smol use root.0\n"))
    del saved
    assert "saved checkpoint deep" in stream_text(ok(s.nb.run("%smol checkpoint save deep")))
    restored = stream_text(ok(s.nb.run("%smol checkpoint restore deep")))
    assert "restored deep" in restored
    files = result_text(ok(s.nb.run("%%smol\nimport os\nsorted((f, open(f).read()) for f in os.listdir())")))
    assert files == "[('base.txt', 'root+branch'), ('mine.txt', 'branch')]"
