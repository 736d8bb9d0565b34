"""Where a webhook may be sent: the guard against server-side request forgery (SSRF).

A tenant names a URL and Sluice POSTs to it from inside the deployment, so an unchecked URL
would let a tenant reach what only Sluice can: Postgres, Redis, the cloud's metadata service
(instance credentials), admin consoles on the private network. A URL is therefore checked
after its name is resolved, every address it resolves to must be public, and the connection
goes to the address that was checked (``Target.address``), so a name that resolves to a
public address for the check and a private one for the connection (DNS rebinding) gains
nothing. Redirects are followed by the sender one hop at a time, each target checked again.

The address rules are the standard library's classification (``ipaddress``), not a list of
our own, plus the IPv4 address an IPv6 address may carry: IPv4-mapped and -compatible, 6to4,
Teredo (server and client) and NAT64 addresses are judged by the IPv4 address they lead to,
since ``[2002:a9fe:a9fe::]`` reaches 169.254.169.254 wherever the host has a 6to4 route.

An operator lets webhooks reach internal receivers with an allow-list (SLUICE_WEBHOOK_ALLOW):
host names and networks (CIDRs) that skip the address rules and may use plain http.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_URL_CHARS = 2048
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# Instance metadata services: AWS, GCP and Azure (IPv4 and AWS's IPv6), Alibaba, AWS ECS tasks.
METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "100.100.100.200", "169.254.170.2"))
# NAT64's well-known prefix (RFC 6052) and the local-use one (RFC 8215), whose translator is an
# operator's own and so reaches only what that network does.
NAT64 = ipaddress.ip_network("64:ff9b::/96")
NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*\.?")
# Why an address is refused, in the order the checks run; the words go into messages. Site-local
# (fec0::/10) is the deprecated forerunner of unique-local addresses: private, though the standard
# library calls it global.
_KINDS = (("loopback", "is_loopback"), ("unspecified", "is_unspecified"), ("link_local", "is_link_local"),
          ("multicast", "is_multicast"), ("private", "is_private"), ("private", "is_site_local"),
          ("reserved", "is_reserved"))


class Refused(ValueError):
    """A webhook URL that may not be used; ``reason`` is stable, ``message`` says why in words."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class AllowList:
    """Host names and networks a webhook may reach whatever the address rules say."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, spec: str | None) -> AllowList:
        """``host.example, 10.1.0.0/16, 127.0.0.2``; raises ValueError naming a bad entry."""
        hosts, networks = set(), []
        for entry in (e.strip().lower() for e in (spec or "").split(",")):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if not _HOST_NAME.fullmatch(entry):
                    raise ValueError(f"{entry!r} is neither a host name nor an address or CIDR") from None
                hosts.add(entry.rstrip("."))
        return cls(frozenset(hosts), tuple(networks))

    def host(self, name: str) -> bool:
        return name.lower().rstrip(".") in self.hosts

    def address(self, address: IPAddress) -> bool:
        return any(address in network for network in self.networks)


@dataclass(frozen=True)
class Target:
    """A checked URL: where to connect (``address``) and what to tell the server (``host``)."""

    scheme: str
    host: str
    port: int
    path: str  # path and query, at least "/"
    address: IPAddress

    @property
    def pinned_url(self) -> str:
        """The URL with its host replaced by the checked address: no second DNS lookup."""
        literal = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{self.scheme}://{literal}:{self.port}{self.path}"

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == {"http": 80, "https": 443}[self.scheme] else f"{host}:{self.port}"


Resolver = Callable[[str, int], list[IPAddress]]


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to (an address literal: itself)."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    # Strip an IPv6 zone ("fe80::1%eth0"): the address rules judge the address itself.
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos))


def _literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def refusal(address: IPAddress) -> str | None:
    """Why ``address`` may not be reached (``loopback``, ``private``, …), or None: it is public.

    An IPv6 address that carries an IPv4 address is refused for whatever refuses that IPv4
    address. IPv4-mapped, 6to4 and well-known-prefix NAT64 addresses are then judged by it
    alone: their packets go to it, so a public one is as reachable as the IPv4 address itself
    (whatever a Python version's ``is_global`` says of the prefix). Teredo, IPv4-compatible and
    local-use NAT64 addresses are judged by their prefix as well, which none of them passes."""
    if address in METADATA:
        return "metadata"
    if address.version == 6:
        carried, decisive = _carried(address)
        for embedded in carried:
            reason = refusal(embedded)
            if reason is not None:
                return reason
        if decisive:
            return None
        if address in NAT64_LOCAL:  # reserved to Python 3.11, private to 3.13: the same word on both
            return "private"
    for kind, attribute in _KINDS:
        if getattr(address, attribute, False):  # IPv4 addresses have no is_site_local
            return kind
    return None if address.is_global else "not_public"


def _carried(address: ipaddress.IPv6Address) -> tuple[tuple[ipaddress.IPv4Address, ...], bool]:
    """The IPv4 addresses ``address`` leads to, and whether they alone decide where it goes."""
    low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.ipv4_mapped is not None:
        return (address.ipv4_mapped,), True
    if address.sixtofour is not None:
        return (address.sixtofour,), True
    if address in NAT64:
        return (low32,), True
    if address.teredo is not None:
        return address.teredo, False  # (server, client)
    # A local-use prefix may place the IPv4 address elsewhere (RFC 6052 §2.2); the /96 layout is the
    # one judged, and the prefix refuses the rest.
    if address in NAT64_LOCAL:
        return (low32,), False
    if int(address) >> 32 == 0 and int(address) > 1:  # IPv4-compatible ::a.b.c.d, not :: or ::1
        return (low32,), False
    return (), False


_WORDS = {"metadata": "a cloud metadata service", "loopback": "a loopback address",
          "unspecified": "the unspecified address", "link_local": "a link-local address",
          "multicast": "a multicast address", "private": "a private network address",
          "reserved": "a reserved address", "not_public": "not a public address"}


def check(url: str, allow: AllowList, resolver: Resolver = resolve) -> Target:
    """``url`` as a Target, once it is short, well formed, resolves and may be reached; else
    :class:`Refused`. Plain http only to allow-listed receivers."""
    if len(url) > MAX_URL_CHARS:
        raise Refused("too_long", f"The URL is {len(url)} characters long; at most {MAX_URL_CHARS} are accepted.")
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme, 0)
    except ValueError:
        raise Refused("malformed", "The URL could not be parsed.") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Refused("malformed", "The URL must be an absolute http(s) URL with a host name.")
    if parts.username is not None or parts.password is not None:
        raise Refused("credentials", "The URL must not carry a user name or password; authenticate the "
                                     "receiver with the webhook signature.")
    host = parts.hostname
    try:
        addresses = resolver(host, port)
    except (OSError, UnicodeError):
        addresses = []
    if not addresses:
        raise Refused("unresolvable", f"The host {host} does not resolve to any address.")
    named = allow.host(host)
    for address in addresses:
        reason = None if named or allow.address(address) else refusal(address)
        if reason is not None:
            where = f"The address {host} is" if _literal(host) else f"The host {host} resolves to {address},"
            raise Refused(reason, f"{where} {_WORDS[reason]}; webhooks are only sent to public addresses (an "
                                  "operator may allow others with SLUICE_WEBHOOK_ALLOW).")
    if parts.scheme != "https" and not (named or all(allow.address(a) for a in addresses)):
        raise Refused("not_https", "The URL must use https.")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(parts.scheme, host, port, path, addresses[0])
