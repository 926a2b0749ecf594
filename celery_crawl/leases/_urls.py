"""Store URLs: masking for errors and logs, and splitting off credentials safely.

Passwords reach us percent-encoded or not. A raw ``#``, ``/``, ``?`` or ``@`` in a password
confuses ``urllib.parse`` (the rest of the password becomes a fragment, path or host, and a
"port" in an error message), so credentials are split off at the *last* ``@`` before anything
else is parsed, and masking never depends on ``urlsplit`` succeeding.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["masked_url", "split_credentials"]

_SECRET_OPTIONS = re.compile(r"(?i)([?&](?:password|passwd|pass|token|secret)=)[^&#]*")


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
