"""Checks that a secret never leaks into exception text, logs or other output."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable
from urllib.parse import quote, urlsplit

import pytest

from celery_crawl.errors import CrawlError


def secret_forms(secret: str) -> list[str]:
    """The raw secret and its percent-encoded form (as it appears inside a URL)."""
    return sorted({secret, quote(secret, safe="")})


def exception_text(exc: BaseException) -> str:
    """``str``, ``repr`` and the full formatted chain (causes and contexts) of ``exc``."""
    return "\n".join([str(exc), repr(exc), *traceback.format_exception(exc)])


def assert_no_secret(text: str, secrets: Iterable[str], where: str) -> None:
    for secret in secrets:
        for form in secret_forms(secret):
            assert form not in text, f"secret {form!r} leaked into {where}:\n{text[:3000]}"


def assert_refused(
    attempt: Callable[[], object],
    url: str,
    *,
    secrets: Iterable[str] = (),
    expect: type[BaseException] | tuple[type[BaseException], ...] = CrawlError,
    bound_s: float,
) -> CrawlError:
    """Run ``attempt`` (which must fail) and check the failure is a clear, bounded, masked
    ``CrawlError`` naming the store's address.

    Returns:
        The raised error, for further checks.
    """
    t0 = time.monotonic()
    with pytest.raises(CrawlError) as info:
        attempt()
    elapsed = time.monotonic() - t0
    exc = info.value
    text = exception_text(exc)
    assert elapsed < bound_s, f"refusal took {elapsed:.1f}s (bound {bound_s}s): {exc}"
    assert isinstance(exc, expect), f"expected {expect}, got {type(exc).__name__}: {exc}"
    parts = urlsplit(url)
    assert f"{parts.hostname}:{parts.port}" in str(exc), f"error does not name the URL: {exc}"
    assert_no_secret(text, secrets, "the exception")
    return exc
