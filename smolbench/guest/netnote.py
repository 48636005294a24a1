"""The network policy, said where a connection fails.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``).
"""

import os
import sys
import threading

_NET_ERRNOS = (111, 101, 113, 99)  # ECONNREFUSED, ENETUNREACH, EHOSTUNREACH, EADDRNOTAVAIL
_last_connect = threading.local()


def _audit(event, args):
    if event == "socket.connect":
        _last_connect.addr = args[1]


def watch_connects():
    """Remember each thread's last connect() target (an audit hook): a refused connection's
    error can then name the host, next to the machine's network policy."""
    if os.environ.get("SMOLBENCH_NET_POLICY"):
        sys.addaudithook(_audit)


def _net_note(exc):
    policy = os.environ.get("SMOLBENCH_NET_POLICY")
    seen = 0
    while exc is not None and policy and seen < 8:
        seen += 1
        if isinstance(exc, OSError) and exc.errno in _NET_ERRNOS:
            addr = getattr(_last_connect, "addr", None)
            where = "%s:%s" % addr[:2] if isinstance(addr, tuple) and len(addr) >= 2 else "that host"
            return ("\n(smolbench: %s is not reachable from this machine; its network policy is %s: "
                    "this host's own services and anything not listed are out of reach)" % (where, policy))
        exc = getattr(exc, "reason", None) if isinstance(getattr(exc, "reason", None), BaseException) else (
            exc.__cause__ or exc.__context__)
    return ""

