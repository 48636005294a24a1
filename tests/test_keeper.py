"""Only the host commands a machine's keeper (issue 25 item 6), through a real kernel.

The attack (an outside audit, as root and as a user): a cell sent ``freeze`` on the agent's
keeper channel (``smolbench_guest._agent.machine.chan``) before a fork. The keeper swapped the
machine's overlays; the fork then reopened only the descriptors on the newest one, so a log
file the cell had opened before stayed on the swapped-out overlay, whose upper entries the
freeze had moved into the layer every branch shares: both branches' writes showed in the parent.

Now the keeper takes ``freeze`` only on its own socket, from a peer outside the machine's pid
namespaces (the host), never from the agent's side where cells run; and a fork reopens the
descriptors on every overlay the machine ever had. The weakened run
(``SMOLBENCH_TEST_WEAKEN=keeper-agent``: the agent asks for the freeze, the way it was) must
show the leak.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from nbformat import NotebookNode
from nbhelpers import NotebookSession, error_text, result_text

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

ATTACK = r"""
import fcntl, os, socket, struct, termios, time, smolbench_guest
log = open('/workspace/log.txt', 'a')   # the warm state keeps a log open across forks
log.write('parent\n'); log.flush()

def mnt(path):
    fd = os.open(path, os.O_PATH)
    try:
        return next(l.split()[1] for l in open('/proc/self/fdinfo/%d' % fd) if l.startswith('mnt_id'))
    finally:
        os.close(fd)

before = mnt('/workspace'), mnt('/tmp')
chan = smolbench_guest._agent.machine.chan
for order in (b'freeze\n', b'freeze\nfreeze\n', b'  freeze\n', b'freeze\r\n', b'guard\n'):
    chan.sendall(order)
# the keeper's own socket, from inside the machine: dropped unread
answers = []
for path in ('/run/smolbench/k',):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        s.sendall(b'freeze\n')
        s.settimeout(5)
        answers.append(s.recv(16))
    except OSError as exc:
        answers.append(type(exc).__name__)
    finally:
        s.close()

def read_by_the_keeper(data):  # sent, and taken off the socket by the keeper (nothing of ours unread)
    chan.sendall(data)
    deadline = time.monotonic() + 60
    while struct.unpack('i', fcntl.ioctl(chan.fileno(), termios.TIOCOUTQ, b'\0' * 4))[0]:
        assert time.monotonic() < deadline, "the keeper never read its channel"
        time.sleep(0.01)

read_by_the_keeper(b'\n')
read_by_the_keeper(b'\n')  # read once the keeper was done with every order before it (its loop is one thread)
obeyed = (mnt('/workspace'), mnt('/tmp')) != before
obeyed, answers
"""


def ok(cell: NotebookNode) -> NotebookNode:
    err = error_text(cell)
    assert not err, f"{cell.source[:60]!r} raised:\n{err}"
    return cell


def on(nb: NotebookSession, node: str, code: str) -> str:
    ok(nb.run(f"%smol use {node}"))
    value = result_text(ok(nb.run("%%smol\n" + code)))
    assert value is not None, code
    return value


@pytest.fixture(params=["", "keeper-agent"], ids=["real", "weakened"])
def attacked(request: pytest.FixtureRequest, open_tmp: Path) -> Iterator[tuple[NotebookSession, bool]]:
    old = os.environ.get("SMOLBENCH_TEST_WEAKEN")
    os.environ["SMOLBENCH_TEST_WEAKEN"] = request.param
    try:
        nb = NotebookSession(open_tmp, timeout=300).__enter__()
    finally:
        if old is None:
            os.environ.pop("SMOLBENCH_TEST_WEAKEN", None)
        else:
            os.environ["SMOLBENCH_TEST_WEAKEN"] = old
    try:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
        yield nb, request.param != ""
    finally:
        nb.__exit__(None, None, None)


def test_a_cell_cant_command_its_keeper_and_a_log_held_across_forks_stays_each_machines(
        attacked: tuple[NotebookSession, bool]) -> None:
    nb, weak = attacked
    obeyed, answers = eval(on(nb, "root", ATTACK))
    ok(nb.run("%%smol fork 2 --keep all --quiet\npass"))  # root.0, root.1
    for node in ("root.0", "root.1"):
        on(nb, node, f"log.write('{node}\\n'); log.flush(); 1")
    on(nb, "root", "log.write('parent again\\n'); log.flush(); 1")
    seen = {node: on(nb, node, "open('/workspace/log.txt').read()") for node in ("root", "root.0", "root.1")}
    if weak:  # the old set-up: the keeper obeyed the cell, and the branches' writes reach the parent
        assert obeyed
        assert "root.0" in seen["root"] and "root.1" in seen["root"], seen
        return
    assert not obeyed
    # the keeper's socket closes on a peer inside the machine, unread (before or after its order went)
    assert answers[0] in (b"", "BrokenPipeError", "ConnectionResetError"), answers
    assert seen == {"root": repr("parent\nparent again\n"), "root.0": repr("parent\nroot.0\n"),
                    "root.1": repr("parent\nroot.1\n")}, seen
    # and the next fork still works: the host orders the keeper, the stray orders changed nothing
    ok(nb.run("%smol use root"))
    ok(nb.run("%%smol fork 1 --keep all --quiet\npass"))  # root.2
    assert on(nb, "root.2", "open('/workspace/log.txt').read()") == repr("parent\nparent again\n")
