"""Network endpoints in tier options: checked before anything connects, shown without secrets.

A Redis URL or an S3 endpoint comes from a config file, a flag, a ``KVTIER_*`` or
``AWS_*`` environment variable. Client libraries take a malformed one late and
badly (obstore, a Rust library, panics on a port out of range or a space in a
host, on an I/O thread), so the tier options models check scheme, host, port and
the rest here, at validation, and every message shows the URL through
:func:`redact_url`: a password (``user:secret@``) or a secret-looking query
value (``?password=...``) is never echoed. Pure functions; any thread.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\Z")
_UNSAFE_CHAR = re.compile(r"[^\x21-\x7e]")
_SECRET_QUERY = re.compile(r"pass|secret|token|key|credential|auth|signature", re.IGNORECASE)
_SHOWN_CHARS = 200
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*\Z")


def split_scheme(url: str) -> tuple[str, str] | None:
    """``(scheme, rest)`` of ``scheme://rest``, or None when ``url`` has no '://' right after a clean
    scheme (a letter, then letters, digits, '+', '.', '-'). A '://' after anything else is no
    separator, however many follow: in ``http:/KEY://SECRET@host/bucket`` (a '/' missing) it sits
    inside the credentials, and what precedes it must never be shown as a scheme, bucket or prefix.
    Every parser of kvtier's URL arguments splits through this one rule; with None, a caller shows
    only what follows the last '@'."""
    scheme, sep, rest = url.partition("://")
    return (scheme, rest) if sep and _SCHEME.match(scheme) else None


def redact_url(url: str) -> str:
    """``url`` for messages and logs: the password of its userinfo and the values of
    secret-looking query parameters replaced by ``***``, at most 200 characters, control
    characters escaped. Never raises (an unparsable URL is shown as far as it is safe)."""
    text = str(url)
    shown = text
    try:
        parts = urlsplit(text)
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if "@" in parts.netloc or any(_SECRET_QUERY.search(k) for k, _ in pairs):
            netloc = parts.netloc
            if "@" in netloc:
                userinfo, host = netloc.rsplit("@", 1)
                user = userinfo.split(":", 1)[0]
                netloc = f"{user}:***@{host}" if ":" in userinfo else f"***@{host}" if user else f"@{host}"
            query = "&".join(
                f"{quote(k, safe='')}={'***' if _SECRET_QUERY.search(k) else quote(v, safe='/:.,')}" for k, v in pairs
            )
            shown = urlunsplit(parts._replace(netloc=netloc, query=query))
        elif "@" in text:  # not where a URL keeps credentials: hide whatever precedes it
            shown = "***@" + text.rsplit("@", 1)[1]
    except ValueError:
        if "@" in text or "?" in text:
            split = split_scheme(text)
            scheme = split[0] + "://" if split else ""
            shown = (scheme + "***@" + text.rsplit("@", 1)[1] if "@" in text else text).split("?", 1)[0]
    shown = _UNSAFE_CHAR.sub(lambda m: repr(m.group())[1:-1] if m.group() != " " else "%20", shown)
    return shown if len(shown) <= _SHOWN_CHARS else shown[: _SHOWN_CHARS - 3] + "..."


def check_host(host: str | None, where: str) -> str:
    """``host`` if it is a DNS name, an IPv4 address or an IPv6 address; else ValueError
    starting with ``where`` (e.g. ``"url 'redis://...'"``) and saying what is wrong."""
    if not host:
        raise ValueError(f"{where} has no host: give one, e.g. 127.0.0.1 or cache.internal")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
            if "%" in host:
                raise ValueError("zone")
        except ValueError:
            raise ValueError(f"{where}: host {host!r} is not an IPv6 address (without a %zone)") from None
        return host
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{where}: host {host!r} is not an IPv4 address") from None
        return host
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise ValueError(
            f"{where}: host {host!r} is not a host name (labels of letters, digits, '-' and '_', "
            "dot separated; a non-ASCII name in its xn-- form)"
        )
    return host


@dataclass(frozen=True)
class Endpoint:
    """The parts of a checked URL: scheme (lower case), host, port (None: the scheme's), path, query."""

    scheme: str
    host: str
    port: int | None
    path: str
    query: str
    username: str | None
    password: str | None


def parse_endpoint(url: str, what: str, schemes: tuple[str, ...], *, needs_host: bool = True) -> Endpoint:
    """Split ``url`` and check its scheme, characters, host and port (1-65535).

    ``what`` names the setting in messages (``"redis url"``, ``"s3 endpoint"``);
    the URL is shown redacted. Raises ValueError saying what is wrong and the fix.
    Path, query and userinfo are returned for the caller to judge.
    """
    where = f"{what} {redact_url(url)!r}"
    if not isinstance(url, str) or not url:
        raise ValueError(f"{what} is empty: give a URL such as {schemes[0]}://host:port")
    if _UNSAFE_CHAR.search(url):
        raise ValueError(f"{where} contains a space, a control or a non-ASCII character: percent-encode it")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{where} is malformed ({exc}): use {schemes[0]}://host:port") from None
    if parts.scheme not in schemes:
        shown = parts.scheme or "none"
        raise ValueError(f"{where} has scheme {shown!r}: use " + " or ".join(f"{s}://" for s in schemes))
    if parts.fragment or "#" in url:  # an empty fragment ('host:9000#') too: urlsplit drops it
        raise ValueError(f"{where} has a '#' fragment: remove it")
    netloc = parts.netloc.rsplit("@", 1)[-1]
    if port is None and re.search(r":[^\]]*$", netloc):
        raise ValueError(f"{where} has an empty port: give one (1-65535) or leave out the ':'")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{where} has port {port}: ports are 1-65535")
    host = parts.hostname or ""
    if needs_host:
        check_host(host, where)
    return Endpoint(parts.scheme, host, port, parts.path, parts.query, parts.username, parts.password)


__all__ = ["Endpoint", "check_host", "parse_endpoint", "redact_url", "split_scheme"]
