"""Store URL masking and credential splitting live in :mod:`celery_crawl._urls`, below both the
settings (``config``) and the lease drivers, so neither imports the other for them."""

from __future__ import annotations

from .._urls import masked_url, split_credentials

__all__ = ["masked_url", "split_credentials"]
