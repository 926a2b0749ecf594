"""A real crawler built on celery-crawl: ``celery -A workers.crawler worker|beat|flower``.

Modules: ``settings`` (configuration from the environment), ``http`` (one HTTP client per
process), ``politeness`` (per-domain rate and concurrency shared by every worker), ``sink``
(fenced upserts into SQLite), ``links`` (link extraction), ``demo_site`` (a local site and
forward proxy that misbehave on purpose) and ``crawler`` (the Celery app and its tasks).
"""
