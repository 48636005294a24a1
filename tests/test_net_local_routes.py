"""Eighth audit: "this host" missed ``local`` routes wider than one address. A route such as
``local 203.0.114.0/24 dev lo`` (AnyIP) makes the host answer on all 256 addresses, but
``own_addresses`` kept only the ``/32 host LOCAL`` lines of ``/proc/net/fib_trie`` (and IPv6
interface addresses), so `on` and a listed ``203.0.114.0/24`` reached this host's listeners
there. Now every local route, of any prefix, IPv4 and IPv6 (and an IPv6 router's anycast
address), is host-only.

Run in a network namespace of its own (``unshare -n``, as root) so the host's routes are never
touched; skipped where that can't be made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent('''
    import ipaddress, socket, subprocess
    def sh(*argv):
        subprocess.run(argv, check=True, capture_output=True)
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "route", "add", "local", "203.0.114.0/24", "dev", "lo")
    sh("ip", "-6", "route", "add", "local", "2001:db8:5::/64", "dev", "lo")
    # a router (IPv6 forwarding on) answers on its subnet-router anycast address, prefix::
    sh("sysctl", "-w", "net.ipv6.conf.all.forwarding=1")
    sh("ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1")
    sh("ip", "link", "set", "d0", "up")
    sh("ip", "link", "set", "d1", "up")
    sh("ip", "addr", "add", "2a00:1:2:3::2/64", "dev", "d0", "nodad")
    srv = socket.socket()
    srv.bind(("203.0.114.7", 0))  # a service of this host's, on an address of the local route
    srv.listen(1)
    port = srv.getsockname()[1]
    socket.create_connection(("203.0.114.7", port), timeout=5).close()  # it is this host's listener

    from smolbench.backends import _netredirect
    from smolbench.netpolicy import NetPolicy, host_only_networks, is_host_only, own_addresses
    own = own_addresses()
    a4, a6, any6 = map(ipaddress.ip_address, ("203.0.114.7", "2001:db8:5::99", "2a00:1:2:3::"))
    wide = NetPolicy.from_lists(True, [], ["203.0.114.0/24", "2001:db8:5::/64", "2a00:1:2:3::/64"])
    print(repr({
        "host_only": [is_host_only(a, own) for a in (a4, a6, any6)],
        "on_admits": [NetPolicy("on").admits(str(a), port, a, own) for a in (a4, a6, any6)],
        "range_admits": [wide.admits(str(a), port, a, own) for a in (a4, a6, any6)],
        "nft_refuses": any("203.0.114.0/24" in r for r in _netredirect.refusals(NetPolicy("on"), own)),
        "networks": ipaddress.ip_network("203.0.114.0/24") in host_only_networks(own, 4),
        "elsewhere": is_host_only(ipaddress.ip_address("203.0.115.7"), own),
    }))
''')


def test_every_local_route_is_this_host(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip (a network namespace of the test's own)")
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no network namespace here: {probe.stderr.decode().strip()}")
    r = subprocess.run(["unshare", "-n", sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=os.environ)
    assert r.returncode == 0, r.stderr
    got = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's repr
    assert got == {"host_only": [True, True, True], "on_admits": [False, False, False],
                   "range_admits": [False, False, False], "nft_refuses": True, "networks": True,
                   "elsewhere": False}, got


@pytest.mark.parametrize("tool", ["ip", "nft"])
def test_the_sandbox_s_network_tools_are_never_taken_from_path(tool: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Eighth audit: ``nft`` and ``ip`` (run with CAP_NET_ADMIN in a machine's namespaces) were
    looked up on the kernel's PATH before the system folders. A folder first on PATH holding a
    fake one is now never used: only /usr/sbin, /sbin, /usr/bin and /bin are searched."""
    from smolbench.backends import _netredirect

    fake = tmp_path / tool
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ.get('PATH', '')}")
    where = _netredirect.found(tool)
    assert where != str(fake)
    assert where is None or os.path.dirname(where) in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"), where
