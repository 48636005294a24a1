"""A machine creates sockets of the families a network namespace holds, and no others.

A machine's network is its own namespace, with the egress proxy its only way out. AF_VSOCK
ignores network namespaces: on a host that is itself a VM (this one is a Firecracker guest)
a cell with an allow-list policy reached the hypervisor with
``socket(AF_VSOCK).connect((2, 1024))``, past the namespace and the proxy. The seccomp filter
now answers EAFNOSUPPORT to socket() and socketpair() of every family but AF_UNIX, AF_INET,
AF_INET6 and AF_NETLINK. The same cell in a machine whose filter leaves that check out
(``SMOLBENCH_TEST_WEAKEN=socket-families``, tests only) shows what the check stops.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="the seccomp filter is x86_64's"),
]

AF_VSOCK, AF_PACKET, AF_BLUETOOTH, AF_ALG, AF_KEY = 40, 17, 31, 38, 15
REFUSED = {"AF_VSOCK": (AF_VSOCK, socket.SOCK_STREAM), "AF_PACKET": (AF_PACKET, socket.SOCK_RAW),
           "AF_BLUETOOTH": (AF_BLUETOOTH, socket.SOCK_STREAM), "AF_ALG": (AF_ALG, socket.SOCK_SEQPACKET),
           "AF_KEY": (AF_KEY, socket.SOCK_RAW)}
ALLOWED = {"AF_UNIX": (socket.AF_UNIX, socket.SOCK_STREAM), "AF_INET": (socket.AF_INET, socket.SOCK_STREAM),
           "AF_INET6": (socket.AF_INET6, socket.SOCK_DGRAM), "AF_NETLINK": (socket.AF_NETLINK, socket.SOCK_RAW)}

CELL = r'''
import errno, socket
def _made(family, kind):
    try:
        socket.socket(family, kind).close()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
def _pair(family, kind):
    try:
        for s in socket.socketpair(family, kind):
            s.close()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
made = {name: _made(*fk) for name, fk in %(families)r.items()}
pairs = {name: _pair(*fk) for name, fk in %(pairs)r.items()}
'''

PAIRS = {"AF_UNIX": (socket.AF_UNIX, socket.SOCK_STREAM), "AF_VSOCK": (AF_VSOCK, socket.SOCK_STREAM)}


def _ints(families: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    return {name: (int(f), int(k)) for name, (f, k) in families.items()}


def _cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weaken: str) -> Any:
    from smolbench import Session

    (tmp_path / "Smolfile").write_text('[network]\nallow_hosts = ["pypi.org"]\n')  # an allow-list: the proxy is on
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SMOLBENCH_TEST_WEAKEN", weaken)
    with Session("Smolfile", backend="sandbox", ledger=str(tmp_path / "ledger.db")) as s:
        res = s.run(CELL % {"families": _ints({**REFUSED, **ALLOWED}), "pairs": _ints(PAIRS)}, pull=["made", "pairs"], check=True)
    return res.pulled["made"], res.pulled["pairs"]


def test_only_the_families_of_a_network_namespace_can_be_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made, pairs = _cell(tmp_path, monkeypatch, "")
    assert {n: made[n] for n in REFUSED} == {n: "EAFNOSUPPORT" for n in REFUSED}, made
    assert {n: made[n] for n in ALLOWED} == {n: "ok" for n in ALLOWED}, made
    assert pairs == {"AF_UNIX": "ok", "AF_VSOCK": "EAFNOSUPPORT"}, pairs


def test_without_the_family_check_other_families_reach_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made, pairs = _cell(tmp_path, monkeypatch, "socket-families")
    assert {n: made[n] for n in ALLOWED} == {n: "ok" for n in ALLOWED}, made
    # each family's own code answers now: AF_PACKET wants CAP_NET_RAW, which no cell has
    assert made["AF_PACKET"] == "EPERM", made
    try:  # where this kernel has vsock (any VM host with the driver), a cell can open one
        socket.socket(AF_VSOCK, socket.SOCK_STREAM).close()
    except OSError as exc:
        assert exc.errno == errno.EAFNOSUPPORT
    else:
        assert made["AF_VSOCK"] == "ok", made
