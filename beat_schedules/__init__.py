"""The schedule files shipped with celery-crawl.

Installed as the package data of ``celery_crawl._demo.schedules``, so ``celery-crawl up`` finds
them from a wheel as from a checkout; the beat reads them by glob (``crawl_schedule_paths``).
"""
