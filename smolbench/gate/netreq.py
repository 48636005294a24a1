"""What a machine asks the sandbox's egress proxy for: the head of one HTTP request.

Only the head is decoded (bounded, strict): the method, where to (``CONNECT host:port``
or an absolute ``http://host:port/...`` URL) and the headers. The proxy decides on
that; what follows is relayed as opaque bytes, never parsed. Plain HTTP requests are
rewritten for the origin server with ``Connection: close``, so a kept-alive
connection can't carry a second request to somewhere else.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from ..netpolicy import PolicyError, canonical, parse_host

MAX_HEAD = 16 * 1024  # bytes of request line + headers
MAX_HEADERS = 100
_METHOD_RE = re.compile(r"[A-Z]{3,10}")
_TOKEN_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_AUTHORITY_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^:\[\]/@?#]+)(?::(\d{1,5}))?")
_TARGET_RE = re.compile(r"http://([^/?#]+)([^\s]*)", re.IGNORECASE)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "proxy-authenticate", "te",
              "trailer", "upgrade"}


class BadRequest(ValueError):
    """A request head the proxy refuses to read (the message says why, for a 400 reply)."""


@dataclass
class ProxyRequest:
    method: str
    host: str  # a lower-case name or an IP address (no brackets)
    port: int
    tunnel: bool  # CONNECT: relay bytes both ways after a 200
    forward: bytes = b""  # plain HTTP: the head to send the origin server

    @property
    def target(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _authority(text: str, default_port: int | None) -> tuple[str, int]:
    m = _AUTHORITY_RE.fullmatch(text)
    if not m:
        raise BadRequest(f"not a host[:port]: {text[:80]!r}")
    host, port_text = m.group(1), m.group(2)
    if port_text is None:
        if default_port is None:
            raise BadRequest(f"CONNECT needs host:port, got {text[:80]!r}")
        port = default_port
    else:
        port = int(port_text)
        if not 1 <= port <= 65535:
            raise BadRequest(f"bad port in {text[:80]!r}")
    if host.startswith("["):
        try:
            addr = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise BadRequest(f"bad IPv6 address {host[:80]!r}") from None
        return str(canonical(addr)), port  # ::ffff:127.0.0.2 is 127.0.0.2, decided as such
    try:
        return parse_host(host).name, port  # numeric spellings (0x7f.1) come back as the address
    except PolicyError:
        raise BadRequest(f"not a host name: {host[:80]!r}") from None


def parse(head: bytes) -> ProxyRequest:
    """``head``: the bytes up to and including the blank line (at most MAX_HEAD)."""
    if len(head) > MAX_HEAD or not head.endswith(b"\r\n\r\n"):
        raise BadRequest("request head too long or not ended by a blank line")
    try:
        text = head[:-4].decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest("non-ASCII bytes in the request head") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _METHOD_RE.fullmatch(parts[0]) or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise BadRequest(f"not an HTTP/1 request line: {lines[0][:80]!r}")
    method, target, version = parts
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN_RE.fullmatch(name) or any(c in value for c in "\r\n\0"):
            raise BadRequest(f"bad header line {line[:80]!r}")
        headers.append((name, value.strip()))
    if len(headers) > MAX_HEADERS:
        raise BadRequest("too many headers")
    if method == "CONNECT":
        host, port = _authority(target, None)
        return ProxyRequest(method, host, port, tunnel=True)
    m = _TARGET_RE.fullmatch(target)
    if not m:
        raise BadRequest("a proxy request needs an absolute http:// URL (https goes through CONNECT)")
    host, port = _authority(m.group(1), 80)
    path = m.group(2) or "/"
    if not path.startswith("/"):
        path = "/" + path
    named = {v.strip().lower() for n, v in headers if n.lower() == "connection" for v in v.split(",")}
    kept = [(n, v) for n, v in headers if n.lower() not in HOP_BY_HOP and n.lower() not in named
            and n.lower() != "host"]
    authority = m.group(1)
    out = [f"{method} {path} {version}", f"Host: {authority}", *(f"{n}: {v}" for n, v in kept), "Connection: close"]
    return ProxyRequest(method, host, port, tunnel=False, forward=("\r\n".join(out) + "\r\n\r\n").encode("ascii"))
