"""Store URLs: the lease schemes, masking for errors and logs, and splitting off credentials.

Below both ``config`` (which validates ``crawl_lease_url`` and masks URLs in its errors) and
``leases`` (whose drivers parse their URL grammars): neither has to import the other for them.

Passwords reach us percent-encoded or not. A raw ``#``, ``/``, ``?`` or ``@`` in a password
confuses ``urllib.parse`` (the rest of the password becomes a fragment, path or host, and a
"port" in an error message), so credentials are split off at the *last* ``@`` before anything
else is parsed, and masking never depends on ``urlsplit`` succeeding.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from .errors import ConfigError

__all__ = ["LEASE_SCHEMES", "REDIS_LEASE_SCHEMES", "endpoint", "masked_url", "query_options",
           "split_credentials"]

#: The schemes ``crawl_lease_url`` accepts (``memory://`` is for tests: ``open_store`` only).
REDIS_LEASE_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "redis+sentinel",
                       "rediss+sentinel")
LEASE_SCHEMES = (*REDIS_LEASE_SCHEMES, "etcd", "etcd+https", "etcd+http")

#: ``password=`` and its kin, also prefixed (``sentinel_password=``).
_SECRET_OPTIONS = re.compile(
    r"(?i)([?&](?:[a-z0-9]+_)?(?:password|passwd|pass|token|secret)=)[^&#]*")


def split_credentials(url: str) -> tuple[str, str | None, str | None, str]:
    """``(scheme, user, password, rest)`` with user and password percent-decoded (None when
    absent); ``rest`` is what follows the credentials: ``host[:port][/path][?query]``."""
    scheme, _, rest = url.partition("://")
    at = rest.rfind("@")
    if at < 0:
        return scheme, None, None, rest
    userinfo, rest = rest[:at], rest[at + 1:]
    user, colon, password = userinfo.partition(":")
    return scheme, unquote(user) or None, unquote(password) if colon else None, rest


def masked_url(url: str) -> str:
    """``url`` with its password (and any ``password=``-like query option) replaced by ``***``.

    Never raises, whatever the URL holds.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<unparsable url>" if "@" in url else url
    at = rest.rfind("@")
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        rest = f"{user}:***@{rest[at + 1:]}" if colon else rest
    return f"{scheme}://" + _SECRET_OPTIONS.sub(r"\1***", rest)


def endpoint(text: str, default_port: int, *, masked: str, bad: str) -> tuple[str | None, int]:
    """``(host, port)`` of one ``host[:port]`` (anything after it, a path or query, is ignored).

    Raises:
        ConfigError: naming ``crawl_lease_url``, the masked URL and ``bad`` (never the parser's
            own text, which would quote URL parts).
    """
    try:
        parts = urlsplit(f"//{text}")
        return parts.hostname, parts.port or default_port
    except ValueError:
        raise ConfigError(f"crawl_lease_url: {masked!r}: {bad}") from None


def query_options(query: str, known: Sequence[str], *, masked: str, secure: bool, needs: str,
                  convert: Callable[[str, str], Any] | None = None) -> dict[str, Any]:
    """The URL's query options (the last value of each, passed through ``convert(name, value)``
    when given); only ``known`` ones, and only on a ``secure`` scheme: a typo in a TLS option must
    not silently turn verification off. Options are checked in the URL's order.

    Raises:
        ConfigError: an unknown option, or one given without TLS (the message names ``needs``),
            or what ``convert`` raises.
    """
    options: dict[str, Any] = {}
    for name, values in parse_qs(query, keep_blank_values=True).items():
        if name not in known:
            raise ConfigError(f"crawl_lease_url: {masked!r}: unknown option {name!r} "
                              f"(known: {', '.join(known)})")
        if not secure:
            raise ConfigError(f"crawl_lease_url: {masked!r}: {name!r} needs {needs}")
        options[name] = values[-1] if convert is None else convert(name, values[-1])
    return options
