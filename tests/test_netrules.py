"""The network policy's rules and the proxy's request parser, without machines (issue 19).

What a machine reaches is shown through real kernels in tests/test_netpolicy.py; these pin
the decisions behind it: what `on` never reaches, what a listed name may resolve to, and
how the one place that reads a machine's proxy requests treats bad ones.
"""

from __future__ import annotations

import ipaddress

import pytest

from smolbench import netpolicy
from smolbench.gate import netreq
from smolbench.netpolicy import NetPolicy, PolicyError, internet_cidrs, parse_cidr, parse_host

A = ipaddress.ip_address
OWN = frozenset({A("172.17.0.5")})


def test_cidrs_and_hosts_take_an_optional_port() -> None:
    assert str(parse_cidr("127.0.0.2/32:8080")) == "127.0.0.2/32:8080"
    assert str(parse_cidr("10.1.2.3/8")) == "10.0.0.0/8"
    assert str(parse_cidr("[2001:db8::/32]:443")) == "[2001:db8::/32]:443"
    assert str(parse_cidr("2001:db8::/32")) == "2001:db8::/32"
    assert parse_cidr("127.0.0.2:8080").single() == A("127.0.0.2")
    assert parse_cidr("10.0.0.0/8:443").single() is None
    assert str(parse_host("PyPI.org.:443")) == "pypi.org:443"
    with pytest.raises(PolicyError, match="invalid port '0'"):
        parse_cidr("127.0.0.2/32:0")
    with pytest.raises(PolicyError, match="not an IP network"):
        parse_cidr("pypi.org")


def test_off_admits_nothing_and_on_never_the_host_or_private_networks() -> None:
    off, on = NetPolicy(), NetPolicy("on")
    assert not off.admits("1.1.1.1", 443, A("1.1.1.1"), OWN)
    assert on.admits("example.org", 443, A("93.184.215.14"), OWN)
    for addr in ("127.0.0.1", "127.0.0.2", "10.0.0.1", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
                 "0.0.0.0", "172.17.0.5", "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "224.0.0.1"):
        assert not on.admits("x.org", 443, A(addr), OWN), addr
    # the test-only stand-in for the internet
    assert on.admits("x", 80, A("127.0.0.3"), OWN, (ipaddress.ip_network("127.0.0.3/32"),))


def test_an_allow_list_admits_what_it_lists_and_a_name_never_resolves_to_the_host() -> None:
    p = NetPolicy.from_lists(False, ["pypi.org", "internal.corp:8443", "127.0.0.2:9000"], ["10.0.0.0/8:5432"])
    assert p.mode == "allow"
    assert p.admits("pypi.org", 443, A("151.101.0.223"), OWN)
    assert p.admits("internal.corp", 8443, A("192.168.3.4"), OWN)  # a private service, listed with its port: fine
    # a name listed without a port reaches the internet only (fourth audit: pypi.org rebound, or
    # split-horizon, reached the LAN, Docker's gateway and a cluster's peers on any port)
    for private in ("192.168.1.1", "10.0.0.5", "172.17.0.1", "100.64.0.1", "fd00::1"):
        assert not p.admits("pypi.org", 443, A(private), OWN), private
        assert not p.admits("pypi.org", 6379, A(private), OWN), private
    assert p.private_refusal("pypi.org", 443, A("10.0.0.5")) == (
        "pypi.org resolved to 10.0.0.5, a private address, and a name listed without a port reaches the internet "
        "only: list it with its port (pypi.org:443) to reach it there")
    assert p.private_refusal("pypi.org", 443, A("127.0.0.1")) is None  # (refused as this host's, said as before)
    assert p.private_refusal("internal.corp", 8443, A("192.168.3.4")) is None
    assert not p.admits("internal.corp", 22, A("192.168.3.4"), OWN)  # wrong port
    assert not p.admits("pypi.org", 443, A("127.0.0.1"), OWN)  # DNS rebinding to this host
    assert not p.admits("pypi.org", 443, A("172.17.0.5"), OWN)  # ... or to its own address
    assert not p.admits("pypi.org", 443, A("::ffff:127.0.0.1"), OWN)  # ... also spelled as IPv6
    assert p.admits("127.0.0.2", 9000, A("127.0.0.2"), OWN)  # listed by address
    assert not p.admits("127.0.0.2", 9001, A("127.0.0.2"), OWN)
    assert p.admits("10.9.8.7", 5432, A("10.9.8.7"), OWN) and not p.admits("10.9.8.7", 80, A("10.9.8.7"), OWN)
    assert not p.admits("example.org", 443, A("93.184.215.14"), OWN)
    assert not p.may_resolve("example.org", 443)  # an unlisted name is never even looked up
    # a range never reaches this host's own addresses; only that address with a port does
    r, own = NetPolicy.from_lists(False, [], ["127.0.0.0/8", "10.0.0.0/8", "127.0.0.1/32:8888"]), OWN | {A("127.0.0.1")}
    assert not r.admits("127.0.0.17", 22, A("127.0.0.17"), own) and r.admits("10.1.2.3", 1, A("10.1.2.3"), own)
    assert not r.admits("127.0.0.1", 22, A("127.0.0.1"), own) and r.admits("127.0.0.1", 8888, A("127.0.0.1"), own)
    assert not r.admits("172.17.0.5", 22, A("172.17.0.5"), frozenset({A("172.17.0.5")}))


def test_plain_tcp_is_funnelled_to_the_proxy_by_network_only() -> None:
    """The machine's nftables rule only redirects (every port of a listed network): the
    host-side proxy decides. 127.0.0.1 stays the machine's own."""
    from smolbench.backends import _netproxy, _netredirect

    p = NetPolicy.from_lists(False, ["pypi.org", "127.0.0.5:80"], ["127.0.0.16/28", "10.0.0.0/8:5432", "[2001:db8::/32]:443"])
    nets = _netredirect.networks(p)
    assert [str(n) for n in nets or []] == ["127.0.0.16/28", "10.0.0.0/8", "127.0.0.5/32"]
    rules = _netredirect.ruleset(nets)
    assert rules.index("ip daddr 127.0.0.1 return") < rules.index("ip daddr 127.0.0.16/28 meta l4proto tcp redirect to :3129")
    assert "dport" not in rules
    assert _netredirect.routes(nets) == [["route", "replace", "local", "10.0.0.0/8", "dev", "lo"]]
    on = _netredirect.ruleset(None, (ipaddress.ip_network("127.0.0.3/32"),))
    assert on.index("127.0.0.3/32") < on.index("ip daddr 127.0.0.0/8 return") < on.index("redirect to :3129\n  }")
    assert _netredirect.routes(None) == [["route", "replace", "local", "default", "dev", "lo"]]
    assert _netredirect.networks(NetPolicy()) == [] and _netproxy.Proxy.addresses(NetPolicy("off")) == [("127.0.0.1", 3128)]
    assert "chain refuse" not in rules and "reject" not in on
    assert _netproxy.Proxy.addresses(p) == [("127.0.0.1", 3128), ("127.0.0.1", 3129)]
    assert p.may_resolve("pypi.org", 443)


def test_what_the_host_side_refuses_by_address_and_port_is_refused_at_once() -> None:
    """A chain before the redirect rejects (connect() fails at once) what ``admits`` would
    refuse for that address and port; everything it lets through the host side still decides."""
    from smolbench.backends import _netredirect

    reject = "meta l4proto tcp counter reject with icmp type admin-prohibited"
    p = NetPolicy.from_lists(False, ["pypi.org", "127.0.0.5:80", "172.17.0.5:22"],
                             ["127.0.0.16/28", "10.0.0.0/8:5432", "127.0.0.0/31", "172.16.0.0/12"])
    own = OWN | {A("127.0.0.1"), A("10.1.1.1"), A("8.8.4.4")}
    refuse = _netredirect.refusals(p, own)
    assert refuse == [
        "ip daddr 127.0.0.5 tcp dport 80 return", "ip daddr 172.17.0.5 tcp dport 22 return",  # listed singly
        # this host inside a listed range (its own addresses, and loopback): never through a range
        "ip daddr { 10.1.1.1/32, 127.0.0.0/31, 127.0.0.5/32, 127.0.0.16/28, 172.17.0.5/32 } " + reject,
        "ip daddr 127.0.0.16/28 return", "ip daddr 10.0.0.0/8 tcp dport 5432 return", "ip daddr 127.0.0.0/31 return",
        "ip daddr 172.16.0.0/12 return", "ip daddr 127.0.0.5/32 tcp dport 80 return",
        "ip daddr 172.17.0.5/32 tcp dport 22 return",
        "ip daddr { 10.0.0.0/8, 127.0.0.0/31, 127.0.0.5/32, 127.0.0.16/28, 172.16.0.0/12 } " + reject]
    # every (address, port) the rules let through or refuse agrees with the host side's decision
    for addr, port, ok in (("10.1.1.1", 5432, False), ("10.2.3.4", 5432, True), ("10.2.3.4", 22, False),
                           ("172.17.0.5", 22, True), ("172.17.0.5", 80, False), ("127.0.0.5", 80, True),
                           ("127.0.0.5", 81, False), ("127.0.0.17", 9, False), ("172.20.0.1", 9, True)):
        assert p.admits(addr, port, A(addr), own) is ok, (addr, port)
        assert _nft_verdict(refuse, A(addr), port) is ok, (addr, port)
    text = _netredirect.ruleset(_netredirect.networks(p), (), refuse)
    assert text.index("chain refuse") < text.index("ip daddr 127.0.0.1 return") < text.index("10.1.1.1") < text.index(
        "chain out")
    # `on`: private and special networks and this host's addresses, not its loopback (the machine's own)
    stand_in = (ipaddress.ip_network("127.0.0.3/32"),)
    on = _netredirect.refusals(NetPolicy("on"), own, stand_in)
    assert on[0] == "ip daddr 127.0.0.3/32 return" and len(on) == 2
    assert "8.8.4.4/32" in on[1] and "10.0.0.0/8" in on[1] and "169.254.0.0/16" in on[1] and "127." not in on[1]
    assert _netredirect.refusals(NetPolicy(), own) == [] and _netredirect.refusals(
        NetPolicy.from_lists(False, ["pypi.org"], []), own) == []


def _nft_verdict(rules: list[str], addr: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> bool:
    """What the refuse chain does with a connection (a tiny reading of the rules it writes):
    True when it lets it on to the redirect, False when it rejects it."""
    import re

    for rule in rules:
        m = re.fullmatch(r"ip daddr (\{ (?P<set>[^}]+) \}|(?P<one>\S+))( tcp dport (?P<port>\d+))? (?P<verdict>return|.*reject.*)",
                         rule)
        assert m, rule
        nets = [ipaddress.ip_network(n.strip()) for n in (m.group("set") or m.group("one")).split(",")]
        if any(addr in n for n in nets) and (m.group("port") is None or int(m.group("port")) == port):
            return m.group("verdict") == "return"
    return True


OWN_LOOP = OWN | {A("127.0.0.1"), A("::1"), A("fe80::1")}
HOST_SPELLINGS = ("0.0.0.0", "0.1.2.3", "127.0.0.1", "127.0.0.2", "127.1.2.3", "127.255.255.254", "169.254.169.254",
                  "::", "::1", "::ffff:127.0.0.1", "::ffff:0.0.0.0", "::127.0.0.2", "::ffff:7f01:203", "fe80::1",
                  "febf::2", "172.17.0.5")


def test_no_range_ever_reaches_this_host() -> None:
    """Issue 25: the audit reached this host through `0.0.0.0/0`, `::/0` and `127.0.0.0/8`.
    Every spelling of this host is cut out of every range; only an address listed singly with
    its port reaches one, on that port."""
    wide = NetPolicy.from_lists(False, [], ["0.0.0.0/0", "::/0", "127.0.0.0/8", "169.254.0.0/16", "fe80::/10"])
    for addr in HOST_SPELLINGS:
        assert not wide.admits(addr, 8888, A(addr), OWN_LOOP), addr
    assert wide.admits("8.8.8.8", 53, A("8.8.8.8"), OWN_LOOP) and wide.admits("2001:db8::1", 1, A("2001:db8::1"), OWN_LOOP)
    assert wide.admits("::ffff:8.8.8.8", 53, A("::ffff:8.8.8.8"), OWN_LOOP)  # mapped: decided as the IPv4 it is
    single = NetPolicy.from_lists(False, ["127.0.0.9:7000"], ["0.0.0.0/0", "127.0.0.2/32:8080", "[::1]:8081"])
    assert single.admits("127.0.0.2", 8080, A("127.0.0.2"), OWN_LOOP)
    assert single.admits("x", 8080, A("::ffff:127.0.0.2"), OWN_LOOP)  # the same address, spelled as IPv6
    assert single.admits("::1", 8081, A("::1"), OWN_LOOP) and single.admits("127.0.0.9", 7000, A("127.0.0.9"), OWN_LOOP)
    for addr, port in (("127.0.0.2", 8081), ("127.0.0.3", 8080), ("0.0.0.0", 8080), ("::1", 8080), ("127.0.0.9", 7001)):
        assert not single.admits(addr, port, A(addr), OWN_LOOP), (addr, port)
    # an address in allow_hosts without a port is no single listing either
    assert not NetPolicy.from_lists(False, ["127.0.0.2"], []).admits("127.0.0.2", 80, A("127.0.0.2"), OWN_LOOP)
    # `on` never, whatever the spelling
    for addr in HOST_SPELLINGS:
        assert not NetPolicy("on").admits(addr, 80, A(addr), OWN_LOOP), addr


def test_a_listed_name_that_resolves_to_this_host_is_refused_unless_that_address_is_listed_singly() -> None:
    p = NetPolicy.from_lists(False, ["rebind.test", "db.test:5432"], ["127.0.0.0/8", "127.0.0.7/32:5432"])
    for addr in ("127.0.0.2", "0.0.0.0", "::", "::1", "::ffff:127.0.0.1", "169.254.1.1", "172.17.0.5"):
        assert not p.admits("rebind.test", 80, A(addr), OWN_LOOP), addr
    assert p.admits("db.test", 5432, A("127.0.0.7"), OWN_LOOP)  # that address, listed with that port
    assert not p.admits("db.test", 5432, A("127.0.0.8"), OWN_LOOP)
    assert p.admits("rebind.test", 80, A("93.184.215.14"), OWN_LOOP)


METADATA = ("169.254.169.254", "fd00:ec2::254", "100.100.100.200", "192.0.0.192",  # AWS v6, Alibaba, Oracle
            "168.63.129.16", "fd20:ce::254", "::ffff:168.63.129.16",  # Azure's WireServer, GCP v6 (round 4's audit)
            "64:ff9b::a9fe:a9fe", "64:ff9b::7f00:1", "64:ff9b::6464:64c8", "64:ff9b::ac11:5")  # NAT64 of them, and own


def test_cloud_metadata_and_nat64_spellings_of_this_host_are_never_reached_through_a_range() -> None:
    """Third audit: ``allow = 0.0.0.0/0,::/0`` reached AWS's IPv6 metadata service, Alibaba's
    and Oracle's, and this host through NAT64 (``64:ff9b::`` + an IPv4 address, which the
    gateway connects to): they are this host's, decided by the IPv4 address a NAT64 one embeds."""
    import asyncio

    from smolbench.backends import _netproxy, _netredirect
    from smolbench.netpolicy import sdk_cidrs

    wide = NetPolicy.from_words(None, "0.0.0.0/0,::/0")
    for addr in METADATA:
        assert not wide.admits(addr, 80, A(addr), OWN), addr
        assert not NetPolicy("on").admits(addr, 80, A(addr), OWN), addr
    # a NAT64 address of anywhere else is what it was; listed singly with a port, one is reached
    assert wide.admits("64:ff9b::808:808", 443, A("64:ff9b::808:808"), OWN)
    assert wide.admits("8.8.8.8", 443, A("8.8.8.8"), OWN) and wide.admits("2001:db8::1", 443, A("2001:db8::1"), OWN)
    single = NetPolicy.from_lists(False, [], ["[fd00:ec2::254/128]:80", "100.100.100.200/32:80"])
    assert single.admits("fd00:ec2::254", 80, A("fd00:ec2::254"), OWN)
    assert single.admits("100.100.100.200", 80, A("100.100.100.200"), OWN)
    assert not single.admits("100.100.100.200", 81, A("100.100.100.200"), OWN)
    # a listed name resolving to them: refused (by the proxy, which decides what it connects to)
    named = NetPolicy.from_lists(False, ["meta.test"], ["0.0.0.0/0", "::/0"])
    proxy = _netproxy.Proxy()
    proxy._own = (float("inf"), OWN)
    node = _netproxy.Node("root", named, proxy.budget.tree("root"))
    for addr in METADATA:
        proxy.resolve_map = {"meta.test": addr}
        assert asyncio.run(proxy.decide(node, "meta.test", 80))[0] is None, addr
    proxy.resolve_map = {"meta.test": "64:ff9b::808:808"}
    assert asyncio.run(proxy.decide(node, "meta.test", 80))[0] == A("64:ff9b::808:808")
    # plain TCP to the IPv4 ones is refused at once in the machine; the smol SDK's CIDRs leave them out
    refused = " ".join(_netredirect.refusals(wide, OWN))
    assert "100.100.100.200" in refused and "192.0.0.192" in refused
    kept = [ipaddress.ip_network(c) for c in sdk_cidrs(wide.cidrs, OWN)]
    for addr in METADATA:
        assert not any(A(addr) in n for n in kept if n.version == A(addr).version), addr
    assert any(A("64:ff9b::808:808") in n for n in kept if n.version == 6)


# IPv6 spellings of private and host-only IPv4 addresses: NAT64 (64:ff9b::/96), the local-use
# NAT64 prefix (64:ff9b:1::/48, RFC 8215) and 6to4 (2002::/16)
SPELLED = {"64:ff9b::a00:1": "10.0.0.1", "64:ff9b::c0a8:101": "192.168.1.1", "64:ff9b:1::a00:1": "10.0.0.1",
           "64:ff9b:1::7f00:1": "127.0.0.1", "64:ff9b:1::a9fe:a9fe": "169.254.169.254",
           "64:ff9b:1:0:7f:0:1::": "127.0.0.1 (its /64 form)", "2002:a00:1::": "10.0.0.1",
           "2002:7f00:1::": "127.0.0.1", "2002:ac11:5::1": "172.17.0.5 (own)"}


def test_ipv6_spellings_of_private_and_host_only_addresses_are_decided_as_them() -> None:
    """Fifth audit: a name listed without a port reached 10.0.0.1 resolved as 64:ff9b::a00:1
    (NAT64) on any port, and `on` admitted the local-use NAT64 prefix and 6to4 spellings of
    127.0.0.1 and 169.254.169.254. An IPv6 address is decided by the IPv4 address it embeds
    (``embedded_ipv4``), all of 64:ff9b:1::/48 is this host's, and `on`'s IPv6 is global
    unicast only, as the smol backend's CIDRs are."""
    import asyncio

    from smolbench.backends import _netproxy
    from smolbench.netpolicy import sdk_cidrs

    allow, on = NetPolicy.from_lists(False, ["pypi.test"], []), NetPolicy("on")
    for addr, what in SPELLED.items():
        assert not allow.admits("pypi.test", 443, A(addr), OWN), (addr, what)
        assert not on.admits("x.test", 443, A(addr), OWN), (addr, what)
    # not global unicast: only this host's routes lead there, for `on` and for a name without a port
    assert not on.admits("x.test", 443, A("4000::1"), OWN) and not allow.admits("pypi.test", 443, A("4000::1"), OWN)
    # the proxy refuses them, saying which address the IPv6 one spells
    proxy = _netproxy.Proxy()
    proxy._own = (float("inf"), OWN)
    node = _netproxy.Node("m", allow, proxy.budget.tree("m"))
    proxy.resolve_map = {"pypi.test": "64:ff9b::a00:1"}
    assert asyncio.run(proxy.decide(node, "pypi.test", 22)) == (None, (
        "is not allowed: pypi.test resolved to 64:ff9b::a00:1 (IPv6 for 10.0.0.1), a private address, and a name "
        "listed without a port reaches the internet only: list it with its port (pypi.test:22) to reach it there"))
    # spellings of the internet stay it (also this CI's answers in 203.0.113.0/24, a documentation range)
    for addr in ("64:ff9b::808:808", "2002:808:808::1", "64:ff9b::cb00:7101", "2a00:1450::1"):
        assert allow.admits("pypi.test", 443, A(addr), OWN), addr
    assert on.admits("x.test", 443, A("2002:808:808::1"), OWN) and on.admits("x.test", 443, A("2a00:1450::1"), OWN)
    assert NetPolicy.from_lists(False, ["pypi.test:8443"], []).admits("pypi.test", 8443, A("64:ff9b::a00:1"), OWN)
    # the smol backend's CIDRs agree: `on` and a listed ::/0 leave them out, keep the internet's
    on_nets = [ipaddress.ip_network(c) for c in internet_cidrs(OWN)]
    wide = [ipaddress.ip_network(c) for c in sdk_cidrs(NetPolicy.from_words(None, "::/0").cidrs, OWN)]
    for addr in SPELLED:
        assert not any(A(addr) in n for n in on_nets if n.version == 6), addr
        if not addr.startswith(("2002:a00", "64:ff9b::")):  # (10.0.0.1 is no host-only address)
            assert not any(A(addr) in n for n in wide), addr
    assert any(A("2002:808:808::1") in n for n in on_nets if n.version == 6)
    assert any(A("2002:808:808::1") in n for n in wide)


def test_an_address_with_a_zone_is_decided_as_the_address() -> None:
    """Hardening (seventh audit): no parser here makes one, but were one to reach the rules,
    ``2001:db8::5%eth0`` is this host's 2001:db8::5 and ``::ffff:127.0.0.1%1`` is 127.0.0.1."""
    own = frozenset({A("2001:db8::5")})
    assert netpolicy.is_host_only(A("2001:db8::5%eth0"), own)
    assert netpolicy.canonical(A("::ffff:127.0.0.1%1")) == A("127.0.0.1")
    assert not NetPolicy("on").admits("x.org", 443, A("2001:db8::5%eth0"), own)


def test_numeric_host_names_are_the_addresses_they_spell() -> None:
    """2130706433, 0x7f.1 and 017700000001 are 127.0.0.1 to a resolver (inet_aton, the URL
    standard): the proxy reads them so, and so refuses them as this host."""
    from smolbench.netpolicy import literal

    for spelled in ("2130706433", "0x7f.1", "017700000001", "0x7f000001", "127.1", "0177.0.0.1", "0x7F.0.0.1",
                    "127.0.1", "0x7f.0x0.0x0.0x1"):
        assert literal(spelled) == A("127.0.0.1"), spelled
        assert parse_host(f"{spelled}:80").name == "127.0.0.1"
        req = netreq.parse(f"CONNECT {spelled}:80 HTTP/1.1\r\n\r\n".encode())
        assert req.host == "127.0.0.1" and req.target == "127.0.0.1:80"
        assert netreq.parse(f"GET http://{spelled}:80/ HTTP/1.1\r\n\r\n".encode()).host == "127.0.0.1"
    assert literal("0") == A("0.0.0.0") and literal("0x0") == A("0.0.0.0")
    assert parse_host("pypi.org").name == "pypi.org" and parse_host("1password.com").name == "1password.com"
    for bad in ("a.b.1", "256.0.0.1", "1.2.3.4.5", "0x1g.1", "08.1", "4294967296"):
        with pytest.raises(PolicyError):
            parse_host(bad)
        with pytest.raises(netreq.BadRequest):
            netreq.parse(f"CONNECT {bad}:80 HTTP/1.1\r\n\r\n".encode())


def test_a_branch_policy_is_never_wider_than_its_parents() -> None:
    allow = NetPolicy.from_lists(False, ["pypi.org"], [])
    assert NetPolicy().within(allow) and allow.within(allow) and allow.within(NetPolicy("on"))
    assert not NetPolicy("on").within(allow)
    assert not NetPolicy.from_lists(False, ["pypi.org", "evil.org"], []).within(allow)


def test_up_options_make_a_policy() -> None:
    p = NetPolicy.from_words("on", "pypi.org:443,127.0.0.2/32:8080")
    assert p.describe() == "allow-list: pypi.org:443, 127.0.0.2/32:8080"
    assert NetPolicy.from_words("off", None).describe() == "off (no network)"
    with pytest.raises(PolicyError, match="--allow entry 'http://x' is a URL"):
        NetPolicy.from_words(None, "http://x")


def test_on_for_smol_is_the_internet_as_cidrs() -> None:
    nets = [ipaddress.ip_network(c) for c in internet_cidrs(frozenset({A("203.0.114.9")}))]
    for inside in ("127.0.0.0/8", "10.0.0.0/8", "192.168.0.0/16", "169.254.169.254/32", "203.0.114.9/32"):
        assert not any(n.overlaps(ipaddress.ip_network(inside)) for n in nets), inside
    assert any(A("1.1.1.1") in n for n in nets if n.version == 4)


def test_proxy_requests_are_parsed_strictly() -> None:
    req = netreq.parse(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n")
    assert (req.host, req.port, req.tunnel) == ("pypi.org", 443, True)
    req = netreq.parse(b"GET http://Index.Test:8080/simple/x/ HTTP/1.1\r\nHost: other\r\nProxy-Authorization: x\r\n"
                       b"Connection: keep-alive, X-Hop\r\nX-Hop: 1\r\nAccept: */*\r\n\r\n")
    assert (req.host, req.port, req.tunnel) == ("index.test", 8080, False)
    assert req.forward == (b"GET /simple/x/ HTTP/1.1\r\nHost: Index.Test:8080\r\nAccept: */*\r\nConnection: close\r\n\r\n")
    assert netreq.parse(b"CONNECT [::1]:80 HTTP/1.1\r\n\r\n").host == "::1"
    for bad in (b"CONNECT pypi.org HTTP/1.1\r\n\r\n", b"GET https://pypi.org/ HTTP/1.1\r\n\r\n",
                b"GET / HTTP/1.1\r\nHost: pypi.org\r\n\r\n", b"CONNECT pypi.org:99999 HTTP/1.1\r\n\r\n",
                b"GET http://p\xc3\xa9.org/ HTTP/1.1\r\n\r\n", b"GET http://a.org/ HTTP/2\r\n\r\n",
                b"CONNECT a.org:443 HTTP/1.1\r\nbad header\r\n\r\n", b"CONNECT a_b.org:443 HTTP/1.1\r\n\r\n",
                b"GET http://user@a.org/ HTTP/1.1\r\n\r\n", b"CONNECT a.org:443 HTTP/1.1\r\n" + b"X: y\r\n" * 5000 + b"\r\n"):
        with pytest.raises(netreq.BadRequest):
            netreq.parse(bad)


def test_the_proxy_admits_refuses_in_one_line_and_caps_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy's host side, in-process (a machine's listener replaced by one on the host)."""
    import asyncio
    import socket

    from smolbench.backends import _netbudget, _netproxy

    monkeypatch.setattr(_netbudget, "TREE_CONNECTIONS", 3)

    async def main() -> None:
        async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(b"hi " + await r.readline())
            await w.drain()
            w.close()

        target = await asyncio.start_server(echo, "127.0.0.2", 0)
        tport = target.sockets[0].getsockname()[1]
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        proxy = _netproxy.Proxy()
        policy = NetPolicy.from_lists(False, [], [f"127.0.0.2/32:{tport}"])
        await proxy.serve("m", policy, [listener], [("127.0.0.1", port)])

        async def ask(head: bytes) -> bytes:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(head)
            try:
                data = await asyncio.wait_for(r.read(), 10)  # until the proxy closes
            except ConnectionResetError:
                data = b""
            w.close()
            return data

        assert await ask(f"CONNECT 127.0.0.2:{tport} HTTP/1.1\r\n\r\nping\n".encode()) == (
            b"HTTP/1.1 200 Connection established\r\n\r\n" + b"hi ping\n")
        refused = await ask(b"CONNECT 127.0.0.1:22 HTTP/1.1\r\n\r\n")
        assert refused.startswith(b"HTTP/1.1 403 smolbench: 127.0.0.1:22 is not allowed by this machine's network "
                                  b"policy (allow-list: 127.0.0.2/32:")
        assert (await ask(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(b"HTTP/1.1 400 smolbench proxy: bad request")
        stats = (await proxy.handle({"op": "stats"}))["nodes"]["m"]
        assert stats["refused"] == 1 and stats["last_refused"] == "127.0.0.1:22" and stats["allowed"] == 1
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert await ask(b"CONNECT 127.0.0.1:22 HTTP/1.1\r\n\r\n") == b""  # the 4th at once: dropped
        for _, w in idle:
            w.close()
        await proxy.detach("m")
        target.close()

    asyncio.run(main())


def test_up_overrides_the_smolfile_for_a_session_and_says_so() -> None:
    from smolbench.netpolicy import session_override
    from smolbench.spec import MachineSpec

    spec, line = session_override(MachineSpec(net=True), None, "127.0.0.2/32:8080,pypi.org", "Smolfile")
    assert spec.policy.describe() == "allow-list: pypi.org, 127.0.0.2/32:8080"
    assert line == ("network for this session: allow-list: pypi.org, 127.0.0.2/32:8080 (set by %smol up, "
                    "overriding Smolfile: on (the internet; not this host or private networks))")
    assert session_override(spec, "off", None, "Smolfile")[0].policy.mode == "off"
    with pytest.raises(PolicyError, match="contradict"):
        session_override(spec, "off", "pypi.org", "Smolfile")
