"""The egress proxy's way into a machine: a forked child that joins the machine's user and
network namespaces, binds listening sockets there (and installs the redirect) or reads the
redirect's counters, and hands the result back over a socketpair."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
from typing import Any

from . import _netredirect

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
HELPER_WAIT = 40.0  # seconds: its tools' own limits (_netredirect: 5 s of CPU, 15 s each) and then some


def _setns(fd: int, kind: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, kind) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _bind_in(pid: int, addrs: list[tuple[str, int]], redirect: tuple[Any, ...] | None = None) -> tuple[int, socket.socket]:
    """Start binding listening sockets to ``addrs`` inside the network namespace of host process
    ``pid``: a forked child joins its user namespace (where the sandbox uid owns every
    capability) and network namespace, binds, installs the ``redirect`` (``_netredirect.install``
    arguments) and sends the descriptors back (``_collect``)."""
    ours, theirs = socket.socketpair()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child
        code = 0
        try:
            ours.close()
            _enter(pid)
            fds = []
            for host, port in addrs:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                s = socket.socket(family, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
                s.listen(256)
                fds.append(s.detach())
            if redirect is not None:
                _netredirect.install(*redirect)
            socket.send_fds(theirs, [b"ok"], fds)
        except BaseException as exc:  # noqa: BLE001 - the parent gets one line
            with contextlib.suppress(OSError):
                theirs.sendall(f"{type(exc).__name__}: {exc}".encode()[:500])
            code = 1
        os._exit(code)
    theirs.close()
    return child, ours


def _enter(pid: int) -> None:  # pragma: no cover - runs in a forked child
    userfd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    netfd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    if os.readlink(f"/proc/{pid}/ns/user") != os.readlink("/proc/self/ns/user"):
        _setns(userfd, CLONE_NEWUSER)
    _setns(netfd, CLONE_NEWNET)


def _refused_in(pid: int) -> int:
    """How many connections the machine's ``refuse`` chain turned away at once (its nft
    counters, read by a forked child in the machine's namespaces); 0 when they can't be read."""
    ours, theirs = socket.socketpair()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child
        try:
            ours.close()
            _enter(pid)
            theirs.sendall(str(_netredirect.refused_count()).encode())
        except BaseException:  # noqa: BLE001 - the parent reads nothing: 0
            pass
        os._exit(0)
    theirs.close()
    try:
        ours.settimeout(HELPER_WAIT)
        data = ours.recv(32)
    except OSError:
        data = b""
    finally:
        ours.close()
        _end(child)
    return int(data) if data.isdigit() else 0


def _end(child: int) -> None:
    """Reap a namespace helper; one that hasn't answered in time is killed first."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, 9)  # (it answered and is exiting, or it is late: either way it goes now)
    os.waitpid(child, 0)


def _collect(child: int, ours: socket.socket) -> list[socket.socket]:
    try:
        ours.settimeout(HELPER_WAIT)
        msg, fds, _, _ = socket.recv_fds(ours, 1024, 64)
    except OSError as exc:
        raise OSError(f"the namespace helper did not answer in {HELPER_WAIT:.0f} s ({exc})") from None
    finally:
        ours.close()
        _end(child)
    if msg != b"ok":
        for fd in fds:
            os.close(fd)
        raise OSError(msg.decode(errors="replace") or "the namespace helper died")
    return [socket.socket(fileno=fd) for fd in fds]
