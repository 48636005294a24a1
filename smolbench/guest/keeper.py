"""A machine's keeper, after the split (see ``contain.py``): its loop, which takes the host's
``freeze`` orders on its own socket and, a root's keeper, answers the mount guard's
notifications and takes the host's grants (``mountguard.py``), until its agent is gone.

Stdlib only (runs on the machine's python3, Linux). ``m`` below is the keeper's
``contain.Machine``: its layers, its store's read-only view, its guard and test knobs.
"""

import array
import json
import os
import select
import socket
import struct

HOST_SOCKET = "k"  # the keeper's socket in the machine's run folder: the host's orders come here


def _host_listener(run):
    path = os.path.join(run, HOST_SOCKET)
    try:
        os.unlink(path)
    except OSError:
        pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.bind(path)
    s.listen(8)
    return s


def keep(m, chan, agent_pid, run):
    """The keeper's loop: do the host's ``freeze`` (and, a root's keeper, answer the mount
    guard's notifications and take the host's grants) until the agent is gone, then exit
    like it. Only the host commands a keeper: ``freeze`` comes on the keeper's own socket
    from a process outside this machine's pid namespace; the reply goes to the agent.
    From the agent (where cells run) the keeper takes only the guard's listener, once,
    before any cell ran (``keeper-agent``, tests only: the agent's ``freeze`` too)."""
    guard, buf = m.guard, b""
    host = _host_listener(run) if "keeper-agent" not in m.weak else None
    while True:
        ready = _poll([chan.fileno(), *([host.fileno()] if host else []), *(guard.fds() if guard else [])])
        if guard:
            for fd in ready:
                if fd != chan.fileno() and (host is None or fd != host.fileno()):
                    guard.ready(fd)
        if host is not None and host.fileno() in ready:
            _host_order(m, host, chan)
        if chan.fileno() not in ready:
            continue
        data, passed = _recv(chan)
        if not data:
            break
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line == b"guard" and guard is not None and guard.listener is None and len(passed) == 1:
                guard.listener = passed.pop()  # sent once, by the agent, before any cell ran
            elif line == b"freeze" and host is None:  # tests only: the old way, the agent's word
                _answer_freeze(m, chan)
            # anything else from the agent's side is a cell's: never obeyed, never answered
        for fd in passed:
            os.close(fd)
        if len(buf) > 256:
            buf = b""
    _, status = os.waitpid(agent_pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF if hasattr(os, "waitstatus_to_exitcode") else 0)

def _host_order(m, host, chan):
    """One connection on the keeper's socket: a ``freeze`` from the host (a peer outside
    this machine's pid namespaces, where every process of the machine has a pid), done,
    its reply sent to the agent, then ``ok`` to the host. A peer inside is dropped unread."""
    try:
        conn, _ = host.accept()
    except OSError:
        return
    try:
        pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        if pid != 0:
            return
        conn.settimeout(5.0)
        line = conn.makefile("rb").readline(64)
        if line.strip() == b"freeze":
            _answer_freeze(m, chan)
            conn.sendall(b"ok\n")
    except OSError:
        pass
    finally:
        conn.close()

def _answer_freeze(m, chan):
    try:
        reply = m.freeze()
    except OSError as exc:
        reply = {"error": str(exc)}
    data = json.dumps(reply).encode() + b"\n"
    # The store's read-only view goes along: the branches resolve their layers in it.
    fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [m.view]))] if "error" not in reply else []
    try:
        sent = chan.sendmsg([data], fds)
    except OSError as exc:
        # ETOOMANYREFS: descriptors in flight count per host uid, and another process of
        # that uid (another machine's) holds too many. The fork fails; the keeper lives on.
        reply = {"error": "can't pass the layers to the branches (%s: another process of this host uid holds "
                          "too many descriptors in flight); try again once it ends" % exc.strerror}
        data, sent = json.dumps(reply).encode() + b"\n", 0
    chan.sendall(data[sent:])


def _poll(fds):
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN)
    return [fd for fd, _ in p.poll()]


def _recv(chan):
    """A chunk from the agent, and the descriptors that came with it."""
    data, anc, _, _ = chan.recvmsg(4096, socket.CMSG_SPACE(4 * 4))
    fds = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
    return data, fds
