"""Raw TCP to listed networks: a transparent redirect in a sandbox machine's own netns.

A cell's plain ``socket.connect`` to a listed network (``127.0.0.16/28``, ``10.0.0.0/8``;
for ``net = true``, any address not on the machine's loopback) is turned, by an nftables
``nat output`` rule in the machine's network namespace, into a connection to the relay
listener ``127.0.0.1:3129`` there. The egress proxy (``_netproxy``) holds that listener's
other side: it reads where the cell meant to go (``SO_ORIGINAL_DST``) and decides by the
same policy as for ``CONNECT``. Before the redirect, a ``filter`` chain refuses at once
(ICMP admin-prohibited: ``connect()`` fails with EHOSTUNREACH, which the agent turns into
one line naming the host and the policy) what the host side would refuse by address and
port alone (``refusals``); it only narrows, the host side stays the authority. The proxy's namespace helper installs the
rule (and ``local`` routes, so a listed non-loopback network has a route at all) while it
holds CAP_NET_ADMIN over the namespace; cells have no capability there, so they can't
change either.
"""

from __future__ import annotations

import ctypes
import ipaddress
import re
import resource
import shutil
import socket
import struct
import subprocess

from ..netpolicy import INTERNAL, IPAddress, IPNetwork, NetPolicy, Own, host_only_networks, literal

RELAY_PORT = 3129
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
CAP_NET_ADMIN = 12
TABLE = "smolbench"
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
REJECT = "icmp type admin-prohibited"  # connect() fails at once (a tcp reset to a local SYN can go unseen)
SBIN = "/usr/sbin:/sbin:/usr/bin:/bin"
# ``nft`` and ``ip`` run in a machine's namespaces, whose rules a branch that kept its
# capabilities may have filled (500,000 rules: nft took 1 GB and half a minute to list them),
# charged to no machine: each gets this much memory, CPU and time
TOOL_MEMORY = 256 << 20
TOOL_CPU = 5
TOOL_TIMEOUT = 15


def _bounded() -> None:  # runs in the tool's child, before its exec
    resource.setrlimit(resource.RLIMIT_AS, (TOOL_MEMORY, TOOL_MEMORY))
    resource.setrlimit(resource.RLIMIT_CPU, (TOOL_CPU, TOOL_CPU))


def networks(policy: NetPolicy) -> list[IPNetwork] | None:
    """The IPv4 networks a machine's plain TCP is funnelled to the proxy for; ``None``: every
    address off the machine's loopback (``net = true``). IPv6 networks go by ``CONNECT`` only."""
    if policy.mode == "off":
        return []
    if policy.mode == "on":
        return None
    nets = [r.network for r in policy.cidrs if r.network.version == 4]
    addrs = [literal(h.name) for h in policy.hosts]  # a host listed by its address: that address
    return nets + [ipaddress.ip_network(a) for a in addrs if a is not None and a.version == 4]


def refusals(policy: NetPolicy, own: Own = frozenset(),
             internet: tuple[IPNetwork, ...] = ()) -> list[str]:
    """Rules refusing at once the redirected TCP the host side would refuse by address and port
    alone (``NetPolicy.admits`` for a literal address), from the same rule: for ``on``, private
    and special networks and this host's addresses (the machine's loopback stays its own); for
    an allow-list, the host-only part of every listed range (``host_only_networks``) except the
    addresses listed singly with their port, and a listed network's unlisted ports."""
    reject = f"meta l4proto tcp counter reject with {REJECT}"
    if policy.mode == "on":
        cut: list[IPNetwork] = [n for n in INTERNAL if n.version == 4 and not n.subnet_of(LOOPBACK)]  # type: ignore[arg-type]
        cut += [n for n in host_only_networks(own) if not n.subnet_of(LOOPBACK)]  # type: ignore[arg-type]
        rules = [f"ip daddr {n} return" for n in internet if n.version == 4]  # admitted first, as by admits()
        return rules + [f"ip daddr {{ {_collapsed(cut)} }} {reject}"]
    nets = networks(policy)
    if not nets:
        return []
    singles = sorted((a, p) for a, p in policy.singles() if a.version == 4)
    rules = [f"ip daddr {a} tcp dport {p} return" for a, p in singles]
    host = [h if h.subnet_of(n) else n for h in host_only_networks(own) for n in nets  # type: ignore[arg-type]
            if h.overlaps(n)]
    if host:  # this host, inside a listed range: never through a range
        rules.append(f"ip daddr {{ {_collapsed(host)} }} {reject}")
    listed: list[tuple[IPNetwork, int | None]] = [(r.network, r.port) for r in policy.cidrs if r.network.version == 4]
    listed += [(ipaddress.ip_network(a), h.port) for h in policy.hosts if (a := literal(h.name)) is not None and a.version == 4]
    rules += [f"ip daddr {net}" + (f" tcp dport {port}" if port else "") + " return" for net, port in listed]
    return rules + [f"ip daddr {{ {_collapsed(nets)} }} {reject}"]


def _collapsed(nets: list[IPNetwork]) -> str:
    """IPv4 networks as one nft set's elements (overlaps merged: nft refuses them in a set)."""
    v4 = [n for n in nets if isinstance(n, ipaddress.IPv4Network)]
    return ", ".join(map(str, ipaddress.collapse_addresses(v4)))


def ruleset(nets: list[IPNetwork] | None, internet: tuple[IPNetwork, ...] = (), refuse: list[str] | None = None) -> str:
    """The nftables table: 127.0.0.1 stays the machine's own (its proxy, relay and listeners).
    ``refuse`` (``refusals``) goes in a chain before the redirect sees a packet."""
    redirect = f"meta l4proto tcp redirect to :{RELAY_PORT}"
    rules = ["ip daddr 127.0.0.1 return"]
    if nets is None:
        # the test-only stand-in internet may be on loopback; everything else off it goes out
        rules += [f"ip daddr {n} {redirect}" for n in internet if n.version == 4]
        rules += [f"ip daddr {LOOPBACK} return", redirect]
    else:
        rules += [f"ip daddr {n} {redirect}" for n in nets]
    body = "\n    ".join(rules)
    first = ""
    if refuse:
        first = ("  chain refuse {\n    type filter hook output priority -150; policy accept;\n"
                 "    ip daddr 127.0.0.1 return\n    " + "\n    ".join(refuse) + "\n  }\n")
    return (f"table ip {TABLE} {{\n{first}  chain out {{\n    type nat hook output priority -100; policy accept;\n"
            f"    {body}\n  }}\n}}\n")


def routes(nets: list[IPNetwork] | None) -> list[list[str]]:
    """``local`` routes for what isn't on loopback: without a route, connect() fails before
    any rule sees the packet."""
    wanted = ["default"] if nets is None else [str(n) for n in nets if not n.subnet_of(LOOPBACK)]  # type: ignore[arg-type]
    return [["route", "replace", "local", n, "dev", "lo"] for n in wanted]


TOOLS = {"nft": "nftables", "ip": "iproute2"}  # what the rule and the routes are made with, and their Debian packages


def found(name: str, search: str | None = None) -> str | None:
    """Where tool ``name`` is: on ``search`` (default: the system folders ``SBIN`` only, never
    PATH: a folder of the kernel's PATH, such as a user's or a virtualenv's, could hold an ``ip``
    or ``nft`` that would then run with CAP_NET_ADMIN in a machine's namespaces), else None."""
    return shutil.which(name, path=SBIN if search is None else search)


def _tool(name: str) -> str:
    path = found(name)
    if path is None:
        raise OSError(f"{name} is not installed; raw TCP to listed networks needs it (apt-get install {TOOLS[name]})")
    return path


def _keep_net_admin() -> None:
    """Our capabilities in the machine's user namespace survive exec only as ambient ones
    (the sandbox uid is not 0 there): raise CAP_NET_ADMIN, for nft and ip."""
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    hdr, data = Header(0x20080522, 0), (Data * 2)()
    if libc.capget(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[0].inheritable |= 1 << CAP_NET_ADMIN
    if libc.capset(ctypes.byref(hdr), data) != 0 or libc.prctl(47, 2, CAP_NET_ADMIN, 0, 0) != 0:  # PR_CAP_AMBIENT_RAISE
        raise OSError(ctypes.get_errno(), "can't keep CAP_NET_ADMIN for nft")


def install(nets: list[IPNetwork] | None, internet: tuple[IPNetwork, ...], refuse: list[str] | None = None) -> None:
    """In the machine's namespaces (the proxy's helper child): the routes and the rule."""
    nft, ip = _tool("nft"), _tool("ip")
    _keep_net_admin()
    env = {"PATH": SBIN, "LANG": "C"}
    for argv in routes(nets):
        r = subprocess.run([ip, *argv], capture_output=True, text=True, env=env, timeout=TOOL_TIMEOUT,
                           preexec_fn=_bounded)
        if r.returncode != 0:
            raise OSError(f"ip {' '.join(argv)}: {r.stderr.strip()[:200]}")
    r = subprocess.run([nft, "-f", "-"], input=ruleset(nets, internet, refuse), capture_output=True, text=True, env=env,
                       timeout=TOOL_TIMEOUT, preexec_fn=_bounded)
    if r.returncode != 0:
        raise OSError(f"nft: {r.stderr.strip()[:300]}")


def refused_count() -> int:
    """In the machine's namespaces: the packets (one per refused connect) the refuse chain rejected."""
    nft = _tool("nft")
    _keep_net_admin()
    r = subprocess.run([nft, "list", "chain", "ip", TABLE, "refuse"], capture_output=True, text=True,
                       env={"PATH": SBIN, "LANG": "C"}, timeout=TOOL_TIMEOUT, preexec_fn=_bounded)
    return sum(int(n) for n in re.findall(r"counter packets (\d+)", r.stdout)) if r.returncode == 0 else 0


def original_destination(sock: socket.socket) -> tuple[IPAddress, int]:
    """Where a redirected connection was headed (its conntrack entry, in the machine's netns)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack("!2xH4s8x", raw)
    return ipaddress.ip_address(addr), port
