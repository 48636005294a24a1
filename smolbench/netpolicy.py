"""A machine's network policy: one meaning on every backend.

* ``off`` (the default): no network at all;
* ``on`` (``net = true``, no ``[network]`` table): the internet, but never this host
  (its loopback, its own addresses) or private networks;
* ``allow`` (``[network] allow_hosts`` / ``allow_cidrs``): only these hosts or networks,
  each optionally with a port. An address listed explicitly (``127.0.0.2/32:8080``) is
  reachable even on this host; nothing else on it is.

Pure data and decisions (stdlib only): the Smolfile parser, the backends, the
sandbox's egress proxy and ``%smol status`` all use it. Stand-ins for tests:
``SMOLBENCH_TEST_INTERNET`` (CIDRs ``on`` treats as the internet) and
``SMOLBENCH_TEST_RESOLVE`` (``name=address,...`` the proxy resolves without DNS).
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, replace
from typing import Any

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

TEST_INTERNET_VAR = "SMOLBENCH_TEST_INTERNET"
TEST_RESOLVE_VAR = "SMOLBENCH_TEST_RESOLVE"

# What `on` never reaches: this host, private and special-purpose networks.
INTERNAL = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24",
    "203.0.113.0/24", "224.0.0.0/3",
    "::/127", "::ffff:0:0/96", "64:ff9b::/96", "100::/64", "2001:db8::/32", "fc00::/7", "fe80::/10",
    "ff00::/8"))
# Even a listed *name* never resolves to these (DNS rebinding): only a listed address does.
HOST_ONLY = tuple(ipaddress.ip_network(n) for n in ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16",
                                                     "::/127", "fe80::/10"))

_LABEL_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_CIDR_PORT_RE = re.compile(r"\[(?P<v6>[^\]]+)\](?::(?P<port6>[^:]*))?|(?P<v4>[^:]+)(?::(?P<port4>[^:]*))?")
HOST_FIX = 'write a hostname like "pypi.org", optionally with a port like "pypi.org:443"'
CIDR_FIX = ('write an address or CIDR like "10.0.0.0/8" or "192.168.1.7", optionally with a port '
            'like "127.0.0.2/32:8080" ("[2001:db8::/32]:443" for IPv6)')


class PolicyError(ValueError):
    """A policy entry that can't be understood (the message names it and the fix)."""


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
        """The one address of a /32 (/128) rule with a port: raw TCP straight to it."""
        if self.port is not None and self.network.num_addresses == 1:
            return self.network.network_address
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
    return HostRule(name.lower(), port)


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
                        raise PolicyError(f"--allow entry {word!r} {exc}") from None
                    hosts.append(word)
            return cls.from_lists(True, hosts, cidrs)
        if net not in ("on", "off"):
            raise PolicyError(f"--net must be on or off, got {net!r}; or list what to allow: --allow pypi.org,10.0.0.0/8")
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

    # -- decisions (the sandbox's egress proxy) ---------------------------------------------

    def listed_host(self, name: str, port: int) -> HostRule | None:
        key = name.lower().rstrip(".")
        for rule in self.hosts:
            if rule.name == key and rule.port in (None, port):
                return rule
        return None

    def listed_address(self, addr: IPAddress, port: int, own: frozenset[IPAddress] = frozenset()) -> CidrRule | None:
        """The rule listing ``addr:port``. This host's own addresses (``own``) count as listed
        only by a rule naming that one address and port: a range never reaches them."""
        for rule in self.cidrs:
            if addr.version == rule.network.version and addr in rule.network and rule.port in (None, port):
                if addr not in own or rule.single() == addr:
                    return rule
        return None

    def admits(self, name: str, port: int, addr: IPAddress, own: frozenset[IPAddress],
               internet: tuple[IPNetwork, ...] = ()) -> bool:
        """May a connection asked for as ``name:port``, resolved to ``addr``, go there?"""
        addr = unmapped(addr)
        if self.mode == "off":
            return False
        if self.mode == "on":
            if any(addr in n for n in internet if n.version == addr.version):
                return True
            return addr not in own and not any(addr in n for n in INTERNAL if n.version == addr.version)
        if self.listed_address(addr, port, own):
            return True  # listed by address (this host's own only by address and port)
        rule = self.listed_host(name, port)
        if rule is None:
            return False
        if literal(rule.name) is not None:
            return literal(rule.name) == addr
        return addr not in own and not any(addr in n for n in HOST_ONLY if n.version == addr.version)

    def may_resolve(self, name: str, port: int) -> bool:
        """Names are looked up only when the answer could be admitted (no DNS side channel)."""
        return self.mode == "on" or self.listed_host(name, port) is not None


def unmapped(addr: IPAddress) -> IPAddress:
    """``::ffff:127.0.0.1`` is 127.0.0.1: decided (and connected to) as IPv4."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def session_override(spec: Any, net: str | None, allow: str | None, source: str) -> tuple[Any, str]:
    """``%smol up --net on|off`` / ``--allow ...``: ``spec`` (a MachineSpec) with this session's
    policy instead of the Smolfile's, and the line that says so."""
    if net == "off" and allow:
        raise PolicyError("--net off and --allow contradict each other: drop one")
    policy = NetPolicy.from_words(net or "on", allow)
    before = spec.policy
    spec = replace(spec, net=policy.enabled, allow_hosts=tuple(str(h) for h in policy.hosts),
                   allow_cidrs=tuple(str(c) for c in policy.cidrs))
    return spec, f"network for this session: {policy.describe()} (set by %smol up, overriding {source}: {before.describe()})"


def literal(name: str) -> IPAddress | None:
    try:
        return unmapped(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        return None


def stand_in_internet() -> tuple[IPNetwork, ...]:
    """Test stand-ins for the internet (never set outside tests)."""
    raw = os.environ.get(TEST_INTERNET_VAR, "")
    return tuple(ipaddress.ip_network(w.strip(), strict=False) for w in raw.split(",") if w.strip())


def stand_in_resolve() -> dict[str, str]:
    """Test stand-ins for DNS: name -> address (never set outside tests)."""
    raw = os.environ.get(TEST_RESOLVE_VAR, "")
    pairs = (w.split("=", 1) for w in raw.split(",") if "=" in w)
    return {k.strip().lower(): v.strip() for k, v in pairs}


def own_addresses() -> frozenset[IPAddress]:
    """This host's own addresses (its interfaces'), from /proc: what `on` never reaches."""
    found: set[IPAddress] = set()
    try:
        with open("/proc/net/fib_trie") as fh:
            last = None
            for line in fh:
                words = line.split()
                if len(words) >= 2 and words[0] in ("|--", "+--"):
                    last = words[1]
                elif "/32 host LOCAL" in line and last:
                    found.add(ipaddress.ip_address(last))
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


def internet_cidrs(own: frozenset[IPAddress] = frozenset()) -> list[str]:
    """`on` as CIDRs (for the smol SDK, which scopes by CIDR): the IPv4 space minus INTERNAL
    and this host's addresses, plus global IPv6 unicast minus what INTERNAL holds of it."""
    out: list[str] = []
    for version, whole in ((4, "0.0.0.0/0"), (6, "2000::/3")):
        nets: list[IPNetwork] = [ipaddress.ip_network(whole)]
        minus = [n for n in INTERNAL if n.version == version]
        minus += [ipaddress.ip_network(a) for a in own if a.version == version]
        for cut in minus:
            nxt: list[IPNetwork] = []
            for net in nets:
                if net.overlaps(cut):
                    if cut.supernet_of(net):  # type: ignore[arg-type]
                        continue
                    nxt.extend(net.address_exclude(cut))  # type: ignore[arg-type]
                else:
                    nxt.append(net)
            nets = nxt
        out += [str(n) for n in ipaddress.collapse_addresses(nets)]  # type: ignore[type-var]
    return out
