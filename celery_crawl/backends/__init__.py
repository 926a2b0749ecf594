"""Result backends: ``AuditedRedisBackend`` (fenced, precedence-checked, audited Redis results).

Selected with ``result_backend = "crawlredis://host:6379/0"`` (``crawlrediss://`` for TLS) or
``"celery_crawl.backends:AuditedRedisBackend+redis://host:6379/0"``; behind Sentinel
``"crawlredis+sentinel://s1:26379,s2:26379,s3:26379/<master>/<db>"`` (``AuditedSentinelBackend``).
"""

from __future__ import annotations

from .audited import OUTCOMES, AuditedRedisBackend, audit_stream_key, result_digest
from .sentinel import AuditedSentinelBackend

__all__ = ["OUTCOMES", "AuditedRedisBackend", "AuditedSentinelBackend", "audit_stream_key",
           "result_digest"]
