"""Which webhook URLs may be called: a user's URL is an attacker's (server-side request forgery).

A URL must be http or https, name a host, hold no credentials, and every address its host
resolves to must be public: no loopback, private, link-local (the cloud metadata service at
169.254.169.254), shared (CGNAT), reserved, unspecified or multicast address, IPv4-mapped IPv6
included. Checked when settings are saved and again at each delivery, which connects to the
addresses checked. ``ORRERY_WEBHOOK_ALLOW_PRIVATE`` lets an operator allow private targets (a
site whose receivers live on its own network).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.conf import settings


class UnsafeWebhook(ValueError):
    """A webhook URL that may not be called: its scheme, its form, or where its host resolves."""


@dataclass(frozen=True)
class Target:
    """A webhook URL taken apart, with the addresses its host resolved to (all allowed)."""

    scheme: str
    host: str
    port: int
    path: str
    addresses: tuple[str, ...]


def check_webhook_url(url: str) -> Target:
    """The URL's target when it may be called: http or https, a host, no credentials, and every
    address the host resolves to public (or ``ORRERY_WEBHOOK_ALLOW_PRIVATE``). Resolves the
    host; raises ``UnsafeWebhook`` saying why not."""
    if len(url) > 500:
        raise UnsafeWebhook("must be at most 500 characters")
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise UnsafeWebhook("must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UnsafeWebhook(f"not a valid URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in {"http", "https"}:
        raise UnsafeWebhook("must be an http:// or https:// URL")
    if not parts.hostname:
        raise UnsafeWebhook("must name a host")
    if parts.username is not None or parts.password is not None:
        raise UnsafeWebhook("must not hold credentials; verify the signature instead")
    host = parts.hostname
    port = port or (443 if scheme == "https" else 80)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, OSError) as exc:
        raise UnsafeWebhook(f"the host {host!r} cannot be resolved ({exc})") from None
    addresses = tuple(dict.fromkeys(str(info[4][0]).split("%")[0] for info in found))
    if not addresses:
        raise UnsafeWebhook(f"the host {host!r} cannot be resolved")
    if not settings.ORRERY_WEBHOOK_ALLOW_PRIVATE:
        for address in addresses:
            if not is_public(address):
                raise UnsafeWebhook(
                    f"the host {host!r} resolves to {address}, which is not a public address "
                    "(loopback, private, link-local and reserved addresses are refused)"
                )
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(scheme, host, port, path, addresses)


def is_public(address: str) -> bool:
    """True for a public unicast address: not loopback, private, link-local (cloud metadata),
    shared (CGNAT), reserved, unspecified or multicast — also when written as IPv4-mapped IPv6."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast
