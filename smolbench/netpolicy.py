"""A machine's network policy: one meaning on every backend.

* ``off`` (the default): no network at all;
* ``on`` (``net = true``, no ``[network]`` table): the internet, but never this host
  (its loopback, its own addresses) or private networks;
* ``allow`` (``[network] allow_hosts`` / ``allow_cidrs``): only these hosts or networks,
  each optionally with a port.

**This host is never reachable through a range.** Host-only addresses (``HOST_ONLY``:
``0.0.0.0/8``, ``127.0.0.0/8``, ``::``, ``::1``, link-local, also spelled as IPv6
(``embedded_ipv4``: IPv4-mapped or -compatible, NAT64, 6to4), the local-use NAT64 prefix
``64:ff9b:1::/48``, and every address of this host's interfaces) are cut out of every listed
range; only an address listed singly with its port (``127.0.0.2/32:8080``) reaches one, on
that port. A listed name resolving to a host-only address is refused unless that address
is listed so. The egress proxy (``admits``) and the sandbox's nftables chain
(``host_only_networks``, ``singles``) apply this one rule.

Pure data and decisions (stdlib only): the Smolfile parser, the backends, the
sandbox's egress proxy and ``%smol status`` all use it. Stand-ins for tests:
``SMOLBENCH_TEST_INTERNET`` (CIDRs ``on`` treats as the internet),
``SMOLBENCH_TEST_RESOLVE`` (``name=address,...`` the proxy resolves without DNS) and
``SMOLBENCH_TEST_FAR`` (loopback CIDRs that count as far networks, not this host).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# this host: its addresses, and the networks of its `local` routes of any prefix (AnyIP: a
# `local 203.0.113.0/24` route makes the host answer on every address of it), see own_addresses
Own = frozenset[IPAddress | IPNetwork]

TEST_INTERNET_VAR = "SMOLBENCH_TEST_INTERNET"
TEST_RESOLVE_VAR = "SMOLBENCH_TEST_RESOLVE"
TEST_FAR_VAR = "SMOLBENCH_TEST_FAR"
# tests only (the proxy's ``--weak``): "net-hostonly" brings back the old rule, where only
# this host's interface addresses were this host (what the audit got through)
TEST_WEAKEN: set[str] = set()

# What `on` never reaches: this host, private and special-purpose networks.
INTERNAL = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24",
    "203.0.113.0/24", "224.0.0.0/3",
    "::/96", "::ffff:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48", "100::/64", "2001::/32", "2001:db8::/32",
    "fc00::/7", "fe80::/10", "ff00::/8", "168.63.129.16/32"))
# `on`'s IPv6 is global unicast only (as the smol backend's CIDRs are): nothing outside it is
# routed on the internet, so an address there goes wherever this host's own routes send it.
GLOBAL6 = ipaddress.IPv6Network("2000::/3")
# This host, whatever a range says (plus its interfaces' addresses): reached only by an address
# listed singly with its port. IPv4-mapped/-compatible spellings are decided as IPv4 (canonical);
# a NAT64 (64:ff9b::/96) or 6to4 (2002::/16) address is this host's when the IPv4 address it
# embeds is (``embedded_ipv4``), and all of the local-use NAT64 prefix 64:ff9b:1::/48 is (RFC
# 8215: where in it the IPv4 address sits depends on the prefix length its operator picked,
# RFC 6052, and some reading of nearly every address in it is 0.0.0.0/8 or private). With them,
# the cloud metadata services that answer this host only (its credentials): link-local
# 169.254.169.254 (most clouds), AWS's IPv6 fd00:ec2::254, Alibaba's 100.100.100.200,
# Oracle's 192.0.0.192, Azure's WireServer 168.63.129.16 (a public address only the host's VM
# reaches: its agent's goal state and extension settings) and GCP's IPv6 fd20:ce::254.
CLOUD_HOST_ONLY = ("100.100.100.200/32", "192.0.0.192/32", "168.63.129.16/32", "fd00:ec2::254/128",
                   "fd20:ce::254/128")
HOST_ONLY = tuple(ipaddress.ip_network(n) for n in ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16",
                                                     "::/128", "::1/128", "fe80::/10", "64:ff9b:1::/48",
                                                     *CLOUD_HOST_ONLY))
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # the well-known prefix: the low 32 bits are an IPv4 address
SIX_TO_FOUR = ipaddress.IPv6Network("2002::/16")  # 6to4: bits 16-47 are the IPv4 address of its relay

_LABEL_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_CIDR_PORT_RE = re.compile(r"\[(?P<v6>[^\]]+)\](?::(?P<port6>[^:]*))?|(?P<v4>[^:]+)(?::(?P<port4>[^:]*))?")
HOST_FIX = 'write a hostname like "pypi.org", optionally with a port like "pypi.org:443"'
CIDR_FIX = ('write an address or CIDR like "10.0.0.0/8" or "192.168.1.7", optionally with a port '
            'like "127.0.0.2/32:8080" ("[2001:db8::/32]:443" for IPv6)')


class PolicyError(ValueError):
    """A policy entry that can't be understood (the message names it and the fix; ``api``: the
    same line in :class:`smolbench.Session`'s words, when it names an option of ``%smol up``)."""

    def __init__(self, *args: object, api: str | None = None) -> None:
        super().__init__(*args)
        self.api = api


@dataclass(frozen=True)
class HostRule:
    name: str  # lower case, no trailing dot
    port: int | None = None

    def __str__(self) -> str:
        return f"{self.name}:{self.port}" if self.port else self.name


@dataclass(frozen=True)
class CidrRule:
    network: IPNetwork
    port: int | None = None

    def __str__(self) -> str:
        net = str(self.network)
        if self.port is None:
            return net
        return f"[{net}]:{self.port}" if self.network.version == 6 else f"{net}:{self.port}"

    def single(self) -> IPAddress | None:
        """The one address of a /32 (/128) rule with a port (canonical): the only kind of rule
        that reaches a host-only address."""
        if self.port is not None and self.network.num_addresses == 1:
            return canonical(self.network.network_address)
        return None


def _port(text: str, entry: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise PolicyError(f"has an invalid port {text!r}; use a number from 1 to 65535")
    return int(text)


def host_problem(host: str) -> str | None:
    """Why ``host`` is not a valid ``hostname`` or ``hostname:port`` (None when it is)."""
    try:
        parse_host(host)
    except PolicyError as exc:
        return str(exc)
    return None


def parse_host(host: str) -> HostRule:
    """``pypi.org`` or ``pypi.org:443`` (an IPv4 address is a name here too)."""
    if not host:
        raise PolicyError(f"is empty; {HOST_FIX}")
    if "://" in host:
        bare = host.split("://", 1)[1].split("/", 1)[0]
        raise PolicyError(f'is a URL, not a hostname; write just the host, like "{bare}"')
    if any(ch.isspace() for ch in host):
        raise PolicyError(f"contains whitespace; {HOST_FIX}")
    if "/" in host:
        raise PolicyError(f"contains '/'; {HOST_FIX} (use allow_cidrs for IP ranges)")
    name, sep, port_text = host.rpartition(":") if ":" in host else (host, "", "")
    port = None
    if sep:
        if ":" in name:
            raise PolicyError("has more than one ':'; IPv6 addresses belong in allow_cidrs")
        port = _port(port_text, host)
    name = name[:-1] if name.endswith(".") else name
    if not name or len(name) > 253:
        raise PolicyError(f"is not a valid hostname; {HOST_FIX}")
    for label in name.split("."):
        if not _LABEL_RE.fullmatch(label):
            raise PolicyError(f"is not a valid hostname (bad label {label!r}: use letters, digits and '-', "
                              f"not at either end); {HOST_FIX}")
    numeric = numeric_ipv4(name)  # 2130706433, 0x7f.1, 017700000001: an address, in its one spelling
    return HostRule(str(numeric) if numeric is not None else name.lower(), port)


def _ipv4_number(part: str) -> int | None:
    """One part of an IPv4 address as the URL standard (and inet_aton) reads it: decimal,
    ``0x`` hex or ``0``-prefixed octal; None when it is not a number."""
    low = part.lower()
    if low.startswith("0x"):
        digits, base = low[2:], 16
    elif len(low) > 1 and low.startswith("0"):
        digits, base = low[1:], 8
    else:
        digits, base = low, 10
    if digits == "":
        return 0 if base == 16 else None
    try:
        return int(digits, base) if digits.isalnum() and digits.isascii() else None
    except ValueError:
        return None


def numeric_ipv4(name: str) -> ipaddress.IPv4Address | None:
    """The address a host name that ends in a number spells (``127.1``, ``2130706433``,
    ``0x7f.1``); None for a real name. One that ends in a number but spells no address is
    refused, as the URL standard does (a resolver might read it either way)."""
    parts = name.rstrip(".").split(".")
    if not parts[-1] or _ipv4_number(parts[-1]) is None:
        return None
    nums = [_ipv4_number(p) for p in parts]
    if len(parts) > 4 or any(n is None for n in nums):
        raise PolicyError(f"ends in a number but is not an IPv4 address ({name[:80]!r}); {HOST_FIX}")
    values = [n for n in nums if n is not None]
    if any(n > 255 for n in values[:-1]) or values[-1] >= 256 ** (5 - len(values)):
        raise PolicyError(f"is out of range for an IPv4 address ({name[:80]!r}); {HOST_FIX}")
    value = values[-1] + sum(n << (8 * (3 - i)) for i, n in enumerate(values[:-1]))
    return ipaddress.IPv4Address(value)


def parse_cidr(entry: str) -> CidrRule:
    """``10.0.0.0/8``, ``192.168.1.7``, ``127.0.0.2/32:8080`` or ``[2001:db8::/32]:443``."""
    text = entry.strip()
    match = _CIDR_PORT_RE.fullmatch(text)
    if match and (match.group("v6") or match.group("v4")):
        net_text = match.group("v6") or match.group("v4")
        port_text = match.group("port6") if match.group("v6") else match.group("port4")
    else:  # a bare IPv6 network (colons, no brackets)
        net_text, port_text = text, None
    try:
        network = ipaddress.ip_network(net_text, strict=False)
    except ValueError:
        raise PolicyError(f"is not an IP network; {CIDR_FIX}") from None
    return CidrRule(network, None if port_text is None else _port(port_text, entry))


@dataclass(frozen=True)
class NetPolicy:
    """What a machine may reach. Build it with :meth:`from_spec` or :meth:`from_words`."""

    mode: str = "off"  # "off" | "on" | "allow"
    hosts: tuple[HostRule, ...] = ()
    cidrs: tuple[CidrRule, ...] = ()

    @classmethod
    def from_lists(cls, net: bool, hosts: tuple[str, ...] | list[str], cidrs: tuple[str, ...] | list[str]) -> NetPolicy:
        if hosts or cidrs:
            return cls("allow", tuple(parse_host(h) for h in hosts), tuple(parse_cidr(c) for c in cidrs))
        return cls("on" if net else "off")

    @classmethod
    def from_words(cls, net: str | None, allow: str | None) -> NetPolicy:
        """``%smol up --net off|on`` / ``--allow a,b``: entries that parse as networks are CIDRs."""
        if allow:
            hosts, cidrs = [], []
            for word in (w.strip() for w in allow.split(",")):
                if not word:
                    continue
                try:
                    cidrs.append(str(parse_cidr(word)))
                except PolicyError:
                    try:
                        parse_host(word)
                    except PolicyError as exc:
                        raise PolicyError(f"--allow entry {word!r} {exc}", api=f"allow= entry {word!r} {exc}") from None
                    hosts.append(word)
            return cls.from_lists(True, hosts, cidrs)
        if net not in ("on", "off"):
            raise PolicyError(f"--net must be on or off, got {net!r}; or list what to allow: --allow pypi.org,10.0.0.0/8",
                              api=f"net must be 'on' or 'off', got {net!r}; or list what to allow: "
                              "allow=['pypi.org', '10.0.0.0/8']")
        return cls(net)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def describe(self) -> str:
        """One line for ``%smol status``, the ledger and refusals."""
        if self.mode == "off":
            return "off (no network)"
        if self.mode == "on":
            return "on (the internet; not this host or private networks)"
        return "allow-list: " + ", ".join(str(r) for r in (*self.hosts, *self.cidrs))

    def as_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "hosts": [str(h) for h in self.hosts], "cidrs": [str(c) for c in self.cidrs]}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> NetPolicy:
        hosts = data.get("hosts") or []
        cidrs = data.get("cidrs") or []
        assert isinstance(hosts, list) and isinstance(cidrs, list)
        if data.get("mode") == "allow":
            return cls("allow", tuple(parse_host(str(h)) for h in hosts), tuple(parse_cidr(str(c)) for c in cidrs))
        return cls("on" if data.get("mode") == "on" else "off")

    def within(self, other: NetPolicy) -> bool:
        """True when this policy allows nothing ``other`` doesn't (a branch's can't be wider)."""
        if self.mode == "off" or self == other:
            return True
        if self.mode == "on":
            return other.mode == "on"
        if other.mode == "on":
            return True
        return set(self.hosts) <= set(other.hosts) and set(self.cidrs) <= set(other.cidrs)

    # -- decisions (the sandbox's egress proxy and its nftables chain) -------------------------

    def listed_host(self, name: str, port: int) -> HostRule | None:
        key = name.lower().rstrip(".")
        for rule in self.hosts:
            if rule.name == key and rule.port in (None, port):
                return rule
        return None

    def singles(self) -> frozenset[tuple[IPAddress, int]]:
        """The addresses listed singly with a port (a ``/32`` or ``/128`` rule, or an address in
        ``allow_hosts``): the only ones that reach a host-only address, on that port."""
        out = {(a, r.port) for r in self.cidrs if (a := r.single()) is not None and r.port is not None}
        out |= {(a, h.port) for h in self.hosts if (a := literal(h.name)) is not None and h.port is not None}
        return frozenset(out)

    def listed_address(self, addr: IPAddress, port: int, own: Own = frozenset()) -> bool:
        """Does a rule list ``addr:port``? A host-only address only by being listed singly."""
        addr = canonical(addr)
        if is_host_only(addr, own):
            return (addr, port) in self.singles()
        return any(addr.version == r.network.version and addr in r.network and r.port in (None, port)
                   for r in self.cidrs)

    def admits(self, name: str, port: int, addr: IPAddress, own: Own,
               internet: tuple[IPNetwork, ...] = ()) -> bool:
        """May a connection asked for as ``name:port``, resolved to ``addr``, go there?"""
        addr = canonical(addr)
        if self.mode == "off":
            return False
        if self.mode == "on":
            if within(addr, internet):
                return True
            return not is_host_only(addr, own) and not internal(addr)
        if self.listed_address(addr, port, own):
            return True
        rule = self.listed_host(name, port)
        if rule is None:
            return False
        if literal(rule.name) is not None:
            return literal(rule.name) == addr and not is_host_only(addr, own)  # host-only: singles only (above)
        if is_host_only(addr, own):
            return False  # a listed name that resolves to this host: DNS rebinding
        if within(addr, internet):
            return True
        # a name listed without a port reaches the internet only, as `on` does: pypi.org rebound (or
        # split-horizon) into a private range would reach the LAN, Docker's gateway or a cluster's
        # peers on any port. A private service is listed with its port (internal.corp:8443).
        return rule.port is not None or not private(addr)

    def private_refusal(self, name: str, port: int, addr: IPAddress,
                        own: Own = frozenset()) -> str | None:
        """Why ``name:port`` (listed without a port) was refused at ``addr``, a private address
        (not this host's); None when that is not why."""
        rule = self.listed_host(name, port)
        if self.mode != "allow" or rule is None or rule.port is not None or literal(rule.name) is not None \
                or is_host_only(addr, own) or not private(addr):
            return None
        spelled = ", ".join(map(str, embedded_ipv4(addr)))
        where = f"{addr} (IPv6 for {spelled})" if spelled else f"{addr}"
        return (f"{name} resolved to {where}, a private address, and a name listed without a port reaches the "
                f"internet only: list it with its port ({name}:{port}) to reach it there")

    def may_resolve(self, name: str, port: int) -> bool:
        """Names are looked up only when the answer could be admitted (no DNS side channel)."""
        return self.mode == "on" or self.listed_host(name, port) is not None


# Ranges that address a LAN, a container bridge (Docker's 172.17.0.1) or a cluster's peers: where a
# name listed without a port never leads. (Not the documentation and benchmarking ranges INTERNAL
# also holds: some networks answer public names there through their own egress, as this CI's does.)
PRIVATE = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16",
    "fc00::/7", "fe80::/10"))


def within(addr: IPAddress, networks: tuple[IPNetwork, ...]) -> bool:
    """Is ``addr`` in one of ``networks`` (of its own IP version)?"""
    return any(addr in n for n in networks if n.version == addr.version)


def private(addr: IPAddress) -> bool:
    """In :data:`PRIVATE`, an IPv6 spelling of an address that is (``embedded_ipv4``), or an
    IPv6 address outside global unicast, which only this host's own routes lead to (a test's
    far stand-ins on loopback are far)."""
    if within(addr, stand_in_far()):
        return False
    inner = embedded_ipv4(addr)
    if addr.version == 6 and not inner and addr not in GLOBAL6:
        return True
    return within(addr, PRIVATE) or any(private(a) for a in inner)


def internal(addr: IPAddress) -> bool:
    """What `on` never reaches: in :data:`INTERNAL`, IPv6 outside global unicast, or an IPv6
    spelling of an internal IPv4 address (``2002:a00:1::``, 6to4 of 10.0.0.1)."""
    if within(addr, INTERNAL) or (addr.version == 6 and addr not in GLOBAL6):
        return True
    return any(within(inner, INTERNAL) for inner in embedded_ipv4(addr))


def canonical(addr: IPAddress) -> IPAddress:
    """``::ffff:127.0.0.1`` (IPv4-mapped) and ``::127.0.0.1`` (IPv4-compatible) are 127.0.0.1:
    decided, and connected to, as IPv4. ``::`` and ``::1`` stay themselves. A zone (``%eth0``)
    is dropped: an address is decided by its number, never missed in a set for its zone."""
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.scope_id is not None:
            addr = ipaddress.IPv6Address(int(addr))
        if addr.ipv4_mapped is not None:
            return addr.ipv4_mapped
        if int(addr) >> 32 == 0 and int(addr) > 1:
            return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return addr


unmapped = canonical


def embedded_ipv4(addr: IPAddress) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 address an IPv6 address reaches, or is, in the IPv4 network: IPv4-mapped
    (``::ffff:a.b.c.d``) and -compatible (``::a.b.c.d``), NAT64's well-known prefix
    (``64:ff9b::a.b.c.d``: its gateway connects there) and 6to4 (``2002:AABB:CCDD::/48``: the
    relay that address is tunnelled to). Decisions about an IPv6 address are also decided on
    these. Not here: the local-use NAT64 prefix 64:ff9b:1::/48, decided whole (INTERNAL,
    HOST_ONLY: the IPv4 address's place in it is its operator's choice), and Teredo
    (2001::/32, INTERNAL whole: its server address is no destination, its client's is reached
    by UDP through a Teredo relay, never as a TCP connection there)."""
    if not isinstance(addr, ipaddress.IPv6Address):
        return ()
    value = int(addr)
    if addr.ipv4_mapped is not None or addr in NAT64 or (value >> 32 == 0 and value > 1):
        return (ipaddress.IPv4Address(value & 0xFFFFFFFF),)
    if addr in SIX_TO_FOUR:
        return (ipaddress.IPv4Address((value >> 80) & 0xFFFFFFFF),)
    return ()


def ipv6_spellings(net: ipaddress.IPv4Network) -> list[ipaddress.IPv6Network]:
    """The IPv6 networks whose addresses ``embedded_ipv4`` reads as in ``net`` (NAT64 and 6to4;
    the mapped and compatible spellings are cut by their whole ``/96``, see ``sdk_cidrs``)."""
    v4, plen = int(net.network_address), net.prefixlen
    return [ipaddress.IPv6Network((int(NAT64.network_address) | v4, 96 + plen)),
            ipaddress.IPv6Network((int(SIX_TO_FOUR.network_address) | v4 << 80, 16 + plen))]


def is_host_only(addr: IPAddress, own: Own = frozenset()) -> bool:
    """Is ``addr`` this host (``HOST_ONLY``, one of its own addresses or in one of its ``local``
    routes' networks), whatever a range says?"""
    addr = canonical(addr)
    if addr in own or addr in canonical_set(own):
        return True
    if "net-hostonly" in TEST_WEAKEN:
        return False  # the old rule: only the interfaces' addresses
    if any(is_host_only(inner, own) for inner in embedded_ipv4(addr)):
        return True
    if within(addr, stand_in_far()):
        return False
    return within(addr, HOST_ONLY) or within(addr, own_networks(own))


def _network(item: IPAddress | IPNetwork) -> IPNetwork | None:
    return item if isinstance(item, (ipaddress.IPv4Network, ipaddress.IPv6Network)) else None


def own_networks(own: Own) -> tuple[IPNetwork, ...]:
    """The networks (local routes wider than one address) in ``own``."""
    return tuple(n for a in own if (n := _network(a)) is not None)


def canonical_set(addrs: Own) -> Own:
    return frozenset(a if _network(a) is not None else canonical(a) for a in addrs)  # type: ignore[arg-type]


def host_only_networks(own: Own, version: int = 4) -> list[IPNetwork]:
    """The host-only networks of one IP version (``is_host_only`` as networks, for nftables),
    the test-only far stand-ins cut out."""
    nets: list[IPNetwork] = [ipaddress.ip_network(a) for a in canonical_set(own)
                             if a.version == version and _network(a) is None]
    if "net-hostonly" not in TEST_WEAKEN:
        wide = [n for n in HOST_ONLY if n.version == version] + [n for n in own_networks(own) if n.version == version]
        nets += _minus(wide, [n for n in stand_in_far() if n.version == version])
        if version == 6:  # the NAT64 and 6to4 spellings of the IPv4 ones
            nets += [s for n in host_only_networks(own, 4) if isinstance(n, ipaddress.IPv4Network)
                     for s in ipv6_spellings(n)]
    return nets


def _minus(nets: list[IPNetwork], cuts: list[IPNetwork]) -> list[IPNetwork]:
    for cut in cuts:
        nxt: list[IPNetwork] = []
        for net in nets:
            if not net.overlaps(cut):
                nxt.append(net)
            elif not cut.supernet_of(net):  # type: ignore[arg-type]
                nxt.extend(net.address_exclude(cut))  # type: ignore[arg-type]
        nets = nxt
    return nets


def session_override(spec: Any, net: str | None, allow: str | None, source: str) -> tuple[Any, str]:
    """``%smol up --net on|off`` / ``--allow ...``: ``spec`` (a MachineSpec) with this session's
    policy instead of the Smolfile's, and the line that says so."""
    if net == "off" and allow:
        raise PolicyError("--net off and --allow contradict each other: drop one",
                          api="net='off' and allow= contradict each other: drop one")
    policy = NetPolicy.from_words(net or "on", allow)
    before = spec.policy
    spec = replace(spec, net=policy.enabled, allow_hosts=tuple(str(h) for h in policy.hosts),
                   allow_cidrs=tuple(str(c) for c in policy.cidrs))
    return spec, f"network for this session: {policy.describe()} (set by %smol up, overriding {source}: {before.describe()})"


def literal(name: str) -> IPAddress | None:
    """The address a host spells (any spelling, canonical), or None for a name."""
    try:
        return canonical(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        pass
    try:
        return numeric_ipv4(name)
    except PolicyError:
        return None


def stand_in_internet() -> tuple[IPNetwork, ...]:
    """Test stand-ins for the internet (never set outside tests)."""
    raw = os.environ.get(TEST_INTERNET_VAR, "")
    return tuple(ipaddress.ip_network(w.strip(), strict=False) for w in raw.split(",") if w.strip())


def stand_in_far() -> tuple[IPNetwork, ...]:
    """Test stand-ins for far networks on this host's loopback (never set outside tests)."""
    raw = os.environ.get(TEST_FAR_VAR, "")
    return tuple(ipaddress.ip_network(w.strip(), strict=False) for w in raw.split(",") if w.strip())


def stand_in_resolve() -> dict[str, str]:
    """Test stand-ins for DNS: name -> address (never set outside tests)."""
    raw = os.environ.get(TEST_RESOLVE_VAR, "")
    pairs = (w.split("=", 1) for w in raw.split(",") if "=" in w)
    return {k.strip().lower(): v.strip() for k, v in pairs}


RTF_LOCAL = 0x80000000  # /proc/net/ipv6_route's flags: a route to this host
RTF_ANYCAST = 0x00100000  # and to one of its anycast addresses (a router's subnet-router anycast)


def own_addresses() -> Own:
    """This host, from /proc: what `on` never reaches. Its interfaces' addresses and every
    ``local`` route of any prefix, IPv4 (the ``LOCAL`` entries of ``/proc/net/fib_trie``) and
    IPv6 (``RTF_LOCAL`` and ``RTF_ANYCAST`` routes of ``/proc/net/ipv6_route``, every table):
    a route ``local 203.0.113.0/24 dev lo`` (AnyIP) makes the host answer on all 256 addresses.
    A route of one address is that address; a wider one is its network."""
    found: set[IPAddress | IPNetwork] = set()

    def add(addr: str, prefix: int) -> None:
        net = ipaddress.ip_network(f"{addr}/{prefix}", strict=False)
        found.add(net.network_address if net.num_addresses == 1 else net)

    try:
        with open("/proc/net/fib_trie") as fh:
            last = None
            for line in fh:
                words = line.split()
                if len(words) >= 2 and words[0] == "|--":
                    last = words[1]
                elif last and len(words) >= 3 and words[0].startswith("/") and words[2] == "LOCAL":
                    add(last, int(words[0][1:]))
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/net/ipv6_route") as fh:
            for line in fh:
                words = line.split()
                if len(words) >= 9 and int(words[8], 16) & (RTF_LOCAL | RTF_ANYCAST):
                    add(":".join(words[0][i:i + 4] for i in range(0, 32, 4)), int(words[1], 16))
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/net/if_inet6") as fh:
            for line in fh:
                hexa = line.split()[0]
                found.add(ipaddress.ip_address(":".join(hexa[i:i + 4] for i in range(0, 32, 4))))
    except (OSError, ValueError, IndexError):
        pass
    return frozenset(found)


def sdk_cidrs(rules: Iterable[CidrRule], own: Own = frozenset()) -> list[str]:
    """An allow-list as CIDRs for the smol SDK (which scopes by CIDR, without ports): each range
    less this host (``host_only_networks``, IPv4-mapped and -compatible spellings included), so a
    microVM's ``0.0.0.0/0`` or ``127.0.0.0/8`` reaches the host no more than a sandbox's does.
    An address listed singly with its port stays as listed: the one way to reach the host."""
    out: list[str] = []
    for rule in rules:
        net = rule.network
        if rule.single() is not None:
            out.append(str(net))
            continue
        cuts = host_only_networks(own, net.version)
        if net.version == 6 and "net-hostonly" not in TEST_WEAKEN:
            cuts += [ipaddress.ip_network("::ffff:0:0/96"), ipaddress.ip_network("::/96")]
        kept = _minus([net], cuts)
        out += [str(n) for n in ipaddress.collapse_addresses(kept)]  # type: ignore[type-var]
    return list(dict.fromkeys(out))


def internet_cidrs(own: Own = frozenset()) -> list[str]:
    """`on` as CIDRs (for the smol SDK, which scopes by CIDR): the IPv4 space minus INTERNAL
    and this host's addresses, plus global IPv6 unicast minus what INTERNAL holds of it."""
    out: list[str] = []
    for version, whole in ((4, "0.0.0.0/0"), (6, "2000::/3")):
        minus = [n for n in INTERNAL if n.version == version]
        minus += [ipaddress.ip_network(a) for a in own if a.version == version]
        if version == 6:  # the 6to4 (and NAT64) spellings of the IPv4 ones, as `internal` reads them
            minus += [s for n in INTERNAL if isinstance(n, ipaddress.IPv4Network) for s in ipv6_spellings(n)]
            minus += [s for a in own if a.version == 4
                      for s in ipv6_spellings(ipaddress.IPv4Network(ipaddress.ip_network(a)))]
        nets = _minus([ipaddress.ip_network(whole)], minus)
        out += [str(n) for n in ipaddress.collapse_addresses(nets)]  # type: ignore[type-var]
    return out
