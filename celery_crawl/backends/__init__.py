"""Result backends: ``AuditedRedisBackend`` (fenced, precedence-checked, audited Redis results).

Selected with ``result_backend = "crawlredis://host:6379/0"`` (``crawlrediss://`` for TLS) or
``"celery_crawl.backends:AuditedRedisBackend+redis://host:6379/0"``.
"""

from __future__ import annotations

from .audited import OUTCOMES, AuditedRedisBackend, audit_stream_key, result_digest

__all__ = ["OUTCOMES", "AuditedRedisBackend", "audit_stream_key", "result_digest"]
