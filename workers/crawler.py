"""The crawler: a Celery app (``celery -A workers.crawler worker|beat|flower``) on celery-crawl.

Tasks (names are referenced by ``beat_schedules/*.toml``; keep them):

* ``workers.crawler.crawl_site(url)`` — fetch a site's front page, fan out to its listings
  (links matching ``listing_pattern``) and to the other pages it links to;
* ``workers.crawler.crawl_listing(url, max_pages=1)`` — fetch a listing, fan out to its item
  pages and follow its next page while ``max_pages`` allows;
* ``workers.crawler.crawl_item(url)`` — fetch one page and upsert it into the sink.

Every fetch waits for the domain's shared politeness token and slot, then fetches through this
process's httpx client. Retry decisions, each logged with its reason: 429/503 honour
``Retry-After`` (capped), else exponential backoff with jitter; 403 moves to the next entry of
``CRAWL_PROXIES``; timeouts and connection errors back off; anything else is recorded as a failed
page. A URL whose host ``CRAWL_ALLOWED_HOSTS`` does not allow (or a redirect to one) is refused
before any request and recorded as ``failed:host-not-allowed``, never retried. A crawl has a
deadline (absolute UTC, header ``crawl_deadline``): children inherit it as their deadline and
``expires``, and no retry is scheduled past it.

Scheduled runs carry ``crawl_entry``/``crawl_slot`` headers (from the leased beat); a second run
of the same slot under another task id is recorded in the sink and skipped.

Configuration comes from the environment (see ``workers.settings``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import socket
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, cast
from urllib.parse import urlsplit

import redis
from celery import Celery, Task, signals
from celery.exceptions import SoftTimeLimitExceeded
from celery.utils.log import get_task_logger

import celery_crawl
from celery_crawl.errors import ConfigError, FencedError, StoreError
from celery_crawl.metrics import start_metrics_server

from .http import FetchError, Page, close_process_fetcher, open_process_fetcher, process_fetcher
from .links import parse_page
from .observe import CrawlerCollector, Recorder, proxy_label, site_label
from .politeness import Politeness, PolitenessBusy, domain_of
from .settings import CrawlerSettings, redis_client
from .sink import PageRecord, Sink

__all__ = ["app", "backoff_s", "crawl_item", "crawl_listing", "crawl_site", "settings"]

logger = get_task_logger(__name__)
# httpx logs every request at INFO; the crawler logs its own decisions instead.
logging.getLogger("httpx").setLevel(logging.WARNING)



def _config_exit(exc: ConfigError) -> SystemExit:
    # A misconfigured worker or beat must not start; say why in one line, not a traceback.
    sys.stderr.write(f"workers.crawler: configuration error: {exc}\n")
    return SystemExit(2)


try:
    settings = CrawlerSettings.from_env()
except ConfigError as _exc:
    raise _config_exit(_exc) from None


def _audited_backend_available() -> bool:
    try:
        from celery_crawl.backends import AuditedRedisBackend  # noqa: F401
    except ImportError:
        return False
    return True


def _task_base() -> type[Task]:
    """``IdempotentTask`` (replay of finished runs, deadlines) when installed, else ``Task``."""
    try:
        from celery_crawl.tasks import IdempotentTask
    except ImportError:
        return Task
    return cast("type[Task]", IdempotentTask)


app = Celery("workers.crawler")
app.conf.update(settings.celery_conf(audited_backend=_audited_backend_available()))
# One call: settings validated, worker lease/claim steps registered, LeasedScheduler as the
# default beat scheduler, deadline propagation on every publish.
try:
    crawl_config = celery_crawl.install(app)
except ConfigError as _exc:
    raise _config_exit(_exc) from None
CrawlTask: type[Task] = _task_base()

_DEADLINE_HEADER = "crawl_deadline"
#: A child's publish id is its task id: a re-run parent's fan-out is the same publish, so a
#: finished child is not run again (celery_crawl/publishes.py).
_SENT_HEADER = "crawl_sent"


# -- per-process resources (created after fork) ---------------------------------------------
class _Resources:
    """The politeness limiter, the sink and a Redis client, owned by one process."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.redis = redis_client(settings.redis_url, socket_timeout=5,
                                  socket_connect_timeout=5, health_check_interval=30)
        self.politeness = Politeness(
            self.redis, namespace=settings.namespace, rate_per_s=settings.rate_per_s,
            burst=settings.burst, concurrency=settings.domain_concurrency,
            slot_ttl_s=settings.fetch_timeout_s + 5)
        self.sink = Sink(settings.sink)
        self.recorder = Recorder(self.redis, namespace=settings.namespace)

    def close(self) -> None:
        self.sink.close()
        self.redis.close()


_resources: _Resources | None = None


def resources() -> _Resources:
    """This process's resources; re-created when called in a forked child."""
    global _resources
    if _resources is None or _resources.pid != os.getpid():
        _resources = _Resources()
    return _resources


def _serve_metrics(**_: Any) -> None:
    # Here rather than through crawl_metrics_port, to choose the address: the plugins listen
    # on loopback, and a container's metrics must be reachable from Prometheus's container.
    start_metrics_server(settings.metrics_port, addr=settings.metrics_addr)


signals.worker_init.connect(_serve_metrics, weak=False)
signals.beat_init.connect(_serve_metrics, weak=False)


@signals.worker_init.connect
def _collect_crawler_metrics(**_: Any) -> None:
    # Before the pool forks: every child counts under this worker's id (workers.observe).
    os.environ["CRAWL_WORKER_ID"] = f"{socket.gethostname()}:{os.getpid()}"
    if settings.metrics_port is None:
        return
    from prometheus_client import REGISTRY

    broker = None
    if urlsplit(settings.broker_url).scheme in ("redis", "rediss"):
        broker = redis.Redis.from_url(settings.broker_url, socket_timeout=2,
                                      socket_connect_timeout=2)
    options = app.conf.broker_transport_options or {}
    REGISTRY.register(CrawlerCollector(
        redis_client(settings.redis_url, socket_timeout=2, socket_connect_timeout=2),
        namespace=settings.namespace, broker=broker,
        queues=lambda: list(app.amqp.queues.consume_from or app.amqp.queues),
        priority_steps=options.get("priority_steps", (0, 3, 6, 9)),
        sep=options.get("sep", "\x06\x16")))


@signals.worker_process_init.connect
def _open_in_child(**_: Any) -> None:
    open_process_fetcher(settings)
    resources()


@signals.worker_process_shutdown.connect
def _close_in_child(**_: Any) -> None:
    close_process_fetcher()
    if _resources is not None:
        _resources.close()


@signals.worker_shutdown.connect
def _close_in_main(**_: Any) -> None:
    close_process_fetcher()


# -- deadlines, tokens, retries ---------------------------------------------------------------
def task_deadline(task: Task) -> datetime:
    """The absolute UTC deadline of the running task.

    From its ``crawl_deadline`` header (set by the parent, by the caller, or by
    ``IdempotentTask``), else ``CRAWL_BUDGET`` from now (a crawl started without one).
    """
    raw = getattr(task.request, _DEADLINE_HEADER, None)
    if raw:
        try:
            when = datetime.fromisoformat(str(raw))
        except ValueError:
            logger.warning("ignoring malformed %s header %r", _DEADLINE_HEADER, raw)
        else:
            return when if when.tzinfo else when.replace(tzinfo=UTC)
    return datetime.now(UTC) + timedelta(seconds=settings.crawl_budget_s)


def _remaining_s(deadline: datetime) -> float:
    return (deadline - datetime.now(UTC)).total_seconds()


def fence_token(task: Task) -> int:
    """The fencing token of this run.

    The worker plugin's claim token when present (it grows with every hand-over of the task).
    Without the plugin, a token drawn from a Redis counter at the start of the run: a run that
    started later wins over an older one that is still writing.
    """
    token = getattr(task.request, "crawl_claim_token", None)
    if token is not None:
        return int(token)
    return int(resources().redis.incr(f"{settings.namespace}:sink-token"))


def backoff_s(retries: int, *, base_s: float, max_s: float, rng: random.Random | None = None
              ) -> float:
    """Exponential backoff with "equal jitter": half the step fixed, half random.

    The fixed half keeps a retry storm from collapsing to zero delay; the random half spreads
    workers that failed together.
    """
    step = min(max_s, base_s * (2 ** max(0, retries)))
    uniform = rng.uniform if rng is not None else random.uniform
    return float(step / 2 + uniform(0, step / 2))


def _retry_or_give_up(task: Task, exc: FetchError, deadline: datetime, url: str,
                      proxy_index: int) -> None:
    """Schedule a retry (raising ``Retry``) or return when the page should be given up."""
    retries = int(task.request.retries or 0)
    proxies = settings.proxies
    next_proxy = proxy_index
    if not exc.retryable:
        logger.warning("give up %s: %s (not retryable)", url,
                       f"{exc.reason}: {exc.detail}" if exc.detail else exc.reason)
        return
    if retries >= settings.max_retries:
        logger.warning("give up %s: %s after %d retries", url, exc.reason, retries)
        return
    if exc.reason == "forbidden":
        if proxy_index + 1 >= len(proxies):
            logger.warning("give up %s: 403 through every proxy (%d)", url, len(proxies))
            return
        next_proxy = proxy_index + 1
        countdown, why = 0.0, (f"403 via {proxies[proxy_index]}, rotating to proxy "
                               f"{next_proxy + 1}/{len(proxies)} {proxies[next_proxy]}")
    elif exc.retry_after_s is not None:
        countdown = min(exc.retry_after_s, settings.retry_after_max_s)
        capped = " (capped)" if countdown < exc.retry_after_s else ""
        why = f"{exc.reason}, honouring Retry-After {exc.retry_after_s:g}s{capped}"
    else:
        countdown = backoff_s(retries, base_s=settings.backoff_base_s,
                              max_s=settings.backoff_max_s)
        why = f"{exc.reason}, exponential backoff (attempt {retries + 1})"
    left = _remaining_s(deadline)
    if countdown >= left:
        logger.warning("give up %s: %s, but the deadline is %.1fs away", url, why, left)
        return
    logger.warning("retry %s in %.2fs: %s [retry %d/%d]", url, countdown, why, retries + 1,
                   settings.max_retries)
    kwargs = {**(task.request.kwargs or {}), "proxy_index": next_proxy}
    raise task.retry(countdown=countdown, kwargs=kwargs, exc=exc, max_retries=None,
                     headers={**_custom_headers(task), _DEADLINE_HEADER: deadline.isoformat()})


def _custom_headers(task: Task) -> dict[str, Any]:
    headers = getattr(task.request, "headers", None)
    return dict(headers) if isinstance(headers, dict) else {}


def _fetch(task: Task, url: str, deadline: datetime, proxy_index: int,
           headers: dict[str, str] | None = None) -> Page | FetchError:
    """Politeness, then the fetch; retryable failures raise ``Retry``."""
    res = resources()
    left = _remaining_s(deadline)
    if left <= 0:
        return FetchError(url, "deadline", "expired before the fetch", retryable=False)
    try:
        # A refused host is refused before it waits for (or takes) a politeness token.
        try:
            process_fetcher(settings).check_host(url)
        except FetchError as refused:  # no request made: no proxy to count it against
            _record(task, url, None, None, refused.reason, None)
            raise
        with res.politeness.slot(domain_of(url), budget_s=min(left, 10.0)) as slot:
            if slot.waited_s > 0.5:
                logger.info("politeness: waited %.2fs for %s", slot.waited_s, slot.domain)
            return _observed_fetch(task, url, proxy_index, headers, deadline)
    except PolitenessBusy as busy:
        countdown = max(busy.wait_s, 0.1)
        if countdown >= _remaining_s(deadline):
            return FetchError(url, "deadline", f"politeness: {busy}", retryable=False)
        logger.info("retry %s in %.2fs: %s", url, countdown, busy)
        raise task.retry(countdown=countdown, max_retries=None, exc=busy,
                         headers={**_custom_headers(task),
                                  _DEADLINE_HEADER: deadline.isoformat()}) from busy
    except FetchError as exc:
        _retry_or_give_up(task, exc, deadline, url, proxy_index)
        return exc
    except StoreError as exc:
        # The politeness Redis is down or slow: not the site's fault, retry with backoff.
        _retry_or_give_up(task, FetchError(url, "politeness-store", str(exc), retryable=True),
                          deadline, url, proxy_index)
        return FetchError(url, "politeness-store", str(exc), retryable=False)
    except SoftTimeLimitExceeded:
        # The time limit inherited from the parent's deadline (celery_crawl.tasks) fired
        # inside the fetch: record it as a deadline miss rather than a task failure.
        logger.warning("give up %s: soft time limit (the crawl's deadline) reached", url)
        return FetchError(url, "deadline", "soft time limit", retryable=False)


def _record(task: Task, url: str, proxy: str | None, status: int | None, reason: str | None,
            elapsed_s: float | None) -> None:
    site = site_label(getattr(task.request, "crawl_entry", None), url, settings.allowed_hosts)
    resources().recorder.fetched(site=site, proxy=proxy, status=status, reason=reason,
                                 elapsed_s=elapsed_s)


def _observed_fetch(task: Task, url: str, proxy_index: int, headers: dict[str, str] | None,
                    deadline: datetime) -> Page:
    """The fetch, counted (workers.observe): status per site, proxy latency and health."""
    proxy = settings.proxies[min(proxy_index, len(settings.proxies) - 1)]
    label = proxy_label(settings.proxies, proxy_index)
    started = time.monotonic()
    try:
        page = process_fetcher(settings).fetch(url, proxy=proxy, headers=headers,
                                               budget_s=_remaining_s(deadline))
    except FetchError as exc:
        _record(task, url, label, exc.status, exc.reason, time.monotonic() - started)
        raise
    _record(task, url, label, page.status, None, time.monotonic() - started)
    return page


def _store(task: Task, url: str, result: Page | FetchError, token: int) -> dict[str, Any]:
    entry = getattr(task.request, "crawl_entry", None)
    if isinstance(result, Page):
        title, _ = parse_page(result.url, result.text())
        record = PageRecord(url=url, outcome="ok", status=result.status,
                            content_type=result.content_type, bytes=len(result.body),
                            sha256=hashlib.sha256(result.body).hexdigest(), title=title,
                            task_id=task.request.id, entry=entry)
    else:
        record = PageRecord(url=url, outcome=f"failed:{result.reason}", status=result.status,
                            task_id=task.request.id, entry=entry)
    try:
        resources().sink.upsert(record, token)
    except FencedError as exc:
        logger.warning("stale write refused: %s", exc)
        return {"url": url, "outcome": "fenced", "token": token, "worker": task.request.hostname}
    return {"url": url, "outcome": record.outcome, "token": token,
            "worker": task.request.hostname}


def _child_id(parent_id: str, url: str) -> str:
    """A child's task id from its parent's and its URL: a re-run parent fans out the same ids,
    so the worker plugin and the result backend see duplicates as duplicates."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{parent_id}|{url}"))


def _fan_out(task: Task, links: list[str], deadline: datetime, target: Task,
             kwargs: dict[str, Any] | None = None) -> list[str]:
    ids = []
    expires = deadline if _remaining_s(deadline) > 0 else None
    headers = {_DEADLINE_HEADER: deadline.isoformat()}
    entry = getattr(task.request, "crawl_entry", None)
    if entry:
        headers["crawl_entry"] = entry
    for link in links:
        child_id = _child_id(task.request.id, link)
        child = target.apply_async(args=(link,), kwargs=kwargs or {}, task_id=child_id,
                                   headers={**headers, _SENT_HEADER: child_id},
                                   expires=expires)
        ids.append(child.id)
    return ids


def _is_next_page(listing: str, link: str) -> bool:
    """Whether ``link`` is another page of the listing ``listing`` (same path, other query)."""
    a, b = urlsplit(listing), urlsplit(link)
    return (a.netloc, a.path) == (b.netloc, b.path) and a.query != b.query


def _duplicate_run(task: Task, token: int) -> bool:
    entry = getattr(task.request, "crawl_entry", None)
    slot = getattr(task.request, "crawl_slot", None)
    if not entry or not slot:
        return False
    if resources().sink.record_run(str(entry), str(slot), task.request.id, token):
        logger.info("run of %s slot %s (token %d)", entry, slot, token)
        return False
    logger.warning("duplicate run of %s slot %s prevented (task %s)", entry, slot,
                   task.request.id)
    return True


def _crawl_page_and_fan_out(task: Task, url: str, *, listing_pattern: str | None,
                            max_items: int | None, max_pages: int, proxy_index: int,
                            headers: dict[str, str] | None = None) -> dict[str, Any]:
    deadline = task_deadline(task)
    token = fence_token(task)
    if _duplicate_run(task, token):
        return {"url": url, "outcome": "duplicate-run"}
    result = _fetch(task, url, deadline, proxy_index, headers)
    stored = _store(task, url, result, token)
    if not isinstance(result, Page) or stored["outcome"] == "fenced":
        return stored
    _, links = parse_page(result.url, result.text())
    cap = max_items or settings.max_items
    child_kwargs: dict[str, Any] = {"max_items": max_items} if max_items else {}
    if headers and "Accept-Language" in headers:
        child_kwargs["locale"] = headers["Accept-Language"]
    if listing_pattern is None:  # a listing: its next page, then its items
        pages = [u for u in links if _is_next_page(url, u)][:1] if max_pages > 1 else []
        items = [u for u in links if not _is_next_page(url, u)][:cap]
        children = _fan_out(task, pages, deadline, crawl_listing,
                            {**child_kwargs, "max_pages": max_pages - 1})
    else:  # a site: its listings, then its other pages
        listings = [u for u in links if listing_pattern in u]
        items = [u for u in links if listing_pattern not in u][:cap]
        children = _fan_out(task, listings, deadline, crawl_listing, child_kwargs)
    item_kwargs = {"locale": child_kwargs["locale"]} if "locale" in child_kwargs else {}
    children += _fan_out(task, items, deadline, crawl_item, item_kwargs)
    return {**stored, "children": len(children)}


def _locale_headers(locale: str | None) -> dict[str, str] | None:
    return {"Accept-Language": locale} if locale else None


# -- tasks ----------------------------------------------------------------------------------
@app.task(bind=True, base=CrawlTask, name="workers.crawler.crawl_site", max_retries=None)
def crawl_site(self: Task, url: str, *, listing_pattern: str = "/listing/",
               max_items: int | None = None, locale: str | None = None,
               render_js: bool = False, proxy_index: int = 0) -> dict[str, Any]:
    """Crawl a site from its front page: listings get ``crawl_listing``, other pages
    ``crawl_item`` (at most ``max_items``, default ``CRAWL_MAX_ITEMS``).

    ``locale`` is sent as ``Accept-Language`` by this task and its children. ``render_js=True``
    is refused: this crawler fetches HTML only (the page is recorded as failed, not guessed).
    """
    if render_js:
        logger.warning("give up %s: render_js=True is not supported (HTML only)", url)
        token = fence_token(self)
        return _store(self, url, FetchError(url, "render-js-unsupported", retryable=False),
                      token)
    return _crawl_page_and_fan_out(self, url, listing_pattern=listing_pattern,
                                   max_items=max_items, max_pages=1, proxy_index=proxy_index,
                                   headers=_locale_headers(locale))


@app.task(bind=True, base=CrawlTask, name="workers.crawler.crawl_listing", max_retries=None)
def crawl_listing(self: Task, url: str, *, max_pages: int = 1, max_items: int | None = None,
                  locale: str | None = None, proxy_index: int = 0) -> dict[str, Any]:
    """Crawl a listing page: fan out ``crawl_item`` to the pages it links to, and follow its
    next page (a link to the same path with another query) while ``max_pages`` allows."""
    return _crawl_page_and_fan_out(self, url, listing_pattern=None, max_items=max_items,
                                   max_pages=max(1, int(max_pages)), proxy_index=proxy_index,
                                   headers=_locale_headers(locale))


@app.task(bind=True, base=CrawlTask, name="workers.crawler.crawl_item", max_retries=None)
def crawl_item(self: Task, url: str, *, locale: str | None = None,
               proxy_index: int = 0) -> dict[str, Any]:
    """Fetch one page and upsert it (or its failure) into the sink, fenced by the run's token."""
    deadline = task_deadline(self)
    token = fence_token(self)
    if _duplicate_run(self, token):
        return {"url": url, "outcome": "duplicate-run"}
    started = time.monotonic()
    result = _fetch(self, url, deadline, proxy_index, _locale_headers(locale))
    stored = _store(self, url, result, token)
    logger.info("%s %s in %.2fs (token %d)", stored["outcome"], url,
                time.monotonic() - started, token)
    return stored
