"""Counts the host keeps per uid can't be taken by one machine from the others (issue 17).

An outside audit found that every machine of a kernel (and, as root, of every kernel on the
host) runs as one host uid, and the kernel keeps some counts per uid: descriptors in flight
on Unix sockets, inotify instances, namespaces. A branch that used up one of them broke its
parent's forks (the keeper died passing the layers), its siblings' file watchers, and new
machines elsewhere. Each attack runs in the real sandbox and again with the step that stops
it left out (``SMOLBENCH_TEST_WEAKEN=keeper-nofile,ucounts,agent-log``), where it gets
through. The same goes for a file of the host's that a machine could write without end.
"""

from __future__ import annotations

import ast
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from nbhelpers import error_text, result_text, stream_text
from test_containment import Lab, _lab

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

PROBES = r'''
import array, os, resource, socket

_socks, _watches = [], []

def fill_in_flight():
    """Put as many descriptors in flight as this process may (its own limit, raised to its
    hard one): they stay in a socket nobody reads until release_in_flight()."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    a, b = socket.socketpair()
    a.setblocking(False)
    _socks.extend([a, b])
    null = os.open("/dev/null", os.O_RDONLY)
    sent = 0
    try:
        while True:
            a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [null] * 250))])
            sent += 250
    except OSError as exc:
        return {"sent": sent, "stopped_by": exc.strerror, "hard": hard}
    finally:
        os.close(null)

def release_in_flight():
    while _socks:
        _socks.pop().close()
    return True

def inotify_instances(n):
    """Open up to n inotify instances and keep them until close_inotify()."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    got = 0
    for _ in range(n):
        fd = libc.inotify_init1(0o2000000)
        if fd < 0:
            break
        _watches.append(fd)
        got += 1
    return got

def close_inotify():
    while _watches:
        os.close(_watches.pop())
    return True
'''


def _with_probes(lab: Lab) -> Lab:
    for node in ("root", "root.0", "root.1"):
        lab.ok(f"%smol use {node}")
        lab.ok("%%smol\n" + PROBES)
    return lab


@pytest.fixture(scope="module")
def real() -> Iterator[Lab]:
    for lab in _lab(""):
        yield _with_probes(lab)


@pytest.fixture(scope="module")
def weakened() -> Iterator[Lab]:
    """The set-up the audit found: every process of a machine with its keeper's limits."""
    for lab in _lab("keeper-nofile,ucounts,agent-log"):
        yield _with_probes(lab)


def _fork_root(lab: Lab) -> str:
    """Fork the root once (and drop the branch); the cell's error, or "" when it went."""
    lab.ok("%smol use root")
    cell = lab.nb.run("%%smol fork 1 --quiet\nreward = 1")
    return error_text(cell) or ("" if "1 ok" in stream_text(cell) else stream_text(cell))


def test_descriptors_a_branch_holds_in_flight_dont_stop_its_roots_forks(real: Lab, weakened: Lab) -> None:
    """A branch puts every descriptor it may in flight on a socket nobody reads (the count is
    per host uid). The root's keeper passes the layers at each fork with SCM_RIGHTS: it must
    still can, and the machines live on either way."""
    got = real.probe("fill_in_flight()", "root.0")
    assert got["stopped_by"] and got["sent"] > 0, got
    try:
        assert _fork_root(real) == ""
    finally:
        real.probe("release_in_flight()", "root.0")
    assert real.probe("1 + 1", "root") == 2
    # Weakened: the branch's limit is its keeper's, and the root's fork is refused in one line.
    weakened.probe("fill_in_flight()", "root.0")
    try:
        err = _fork_root(weakened)
    finally:
        weakened.probe("release_in_flight()", "root.0")
    assert "descriptors in flight" in err, err
    assert weakened.probe("1 + 1", "root") == 2  # its keeper lived on: the next cell runs
    assert _fork_root(weakened) == ""  # and once they are released, it forks again


def test_a_branch_cant_take_its_siblings_inotify_instances(real: Lab, weakened: Lab) -> None:
    """A branch opens inotify instances until the kernel refuses (128 per host uid on most
    hosts: a file watcher in a sibling, or on the host as a user kernel, then gets EMFILE).
    Each branch has 8 of its own, and the root's tree 32 in all."""
    try:
        assert real.probe("inotify_instances(40)", "root.0") == 8
        assert real.probe("inotify_instances(1)", "root.1") == 1
    finally:
        for node in ("root.0", "root.1"):
            real.probe("close_inotify()", node)
    try:
        assert weakened.probe("inotify_instances(20)", "root.0") == 20  # past its share: nothing stops it
    finally:
        weakened.probe("close_inotify()", "root.0")


def _agent_log(lab: Lab) -> Path:
    cell = lab.ok("__import__('smolbench')._magics.workbench.machines['root'].info['run_dir']")
    return Path(ast.literal_eval(result_text(cell) or "''")) / "agent.log"


def test_what_a_machine_writes_to_its_own_output_is_kept_within_a_limit(real: Lab, weakened: Lab) -> None:
    """A cell writes 40 MiB straight to its fd 1. That output used to be a file of the host's,
    in the run folder, with no limit (host disk, or host RAM where $TMPDIR is a tmpfs). Now the
    host reads it through a pipe and keeps 8 MiB. (A branch's fd 1 is its own /dev/null since
    the third audit, see tests/test_sibling_channels.py: what it writes there goes nowhere.)"""
    code = "[os.write(1, b'y' * (1 << 20)) for _ in range(40)] and True"
    for lab in (real, weakened):
        assert lab.probe(code, "root") is True
        assert lab.probe("1 + 1", "root") == 2  # the machine carries on
        assert lab.probe(code, "root.1") is True  # a branch's: dropped
        assert lab.probe("1 + 1", "root.1") == 2
    kept, whole = os.path.getsize(_agent_log(real)), os.path.getsize(_agent_log(weakened))
    assert kept <= (8 << 20) + 4096, kept
    assert "this log stops at 8 MiB" in _agent_log(real).read_bytes()[-200:].decode()
    assert whole >= 40 << 20, whole
