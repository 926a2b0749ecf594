"""The audited result backend behind Sentinel (``crawlredis+sentinel://``), next to stock
Celery's ``SentinelBackend`` on the same sentinels, through a planned failover."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, states
from celery.app.task import Context
from celery.backends.redis import SentinelBackend

from celery_crawl.backends import AuditedRedisBackend, AuditedSentinelBackend
from celery_crawl.backends.audit import history
from celery_crawl.config import CrawlConfig
from celery_crawl.errors import ConfigError
from celery_crawl.leases import open_store
from tests.sentinels import MASTER, SentinelSet, running_sentinels
from tests.servers import CLIENT_RESULT_OPTIONS, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sentinels() -> Iterator[SentinelSet]:
    with running_sentinels() as topology:
        yield topology


def make_app(url: str, **conf: Any) -> Celery:
    app = Celery(f"t{uuid.uuid4().hex[:6]}", broker="memory://", backend=url,
                 set_as_current=False)
    options = {**CLIENT_RESULT_OPTIONS, **conf.pop("result_backend_transport_options", {})}
    app.conf.update(crawl_namespace=f"ns{uuid.uuid4().hex[:8]}", redis_socket_timeout=2,
                    redis_socket_connect_timeout=2, result_backend_transport_options=options,
                    **conf)
    return app


def test_both_url_forms_select_the_audited_sentinel_backend(sentinels: SentinelSet) -> None:
    ours = make_app("crawlredis+sentinel://" + sentinels.url().split("://", 1)[1])
    assert isinstance(ours.backend, AuditedSentinelBackend)
    assert ours.backend.crawl_master == MASTER
    # The lease store defaults to the backend's master, so token issuance is checked.
    assert CrawlConfig.from_app(ours).lease_url == sentinels.url()
    assert ours.backend.checks_token_issuance
    assert ours.backend.as_uri() == ours.backend.url  # the worker's banner prints it
    celery_form = make_app("crawlredis+" + sentinels.broker_url(),
                           result_backend_transport_options={"master_name": MASTER},
                           crawl_lease_url=sentinels.url())
    assert isinstance(celery_form.backend, AuditedSentinelBackend)
    assert celery_form.backend.checks_token_issuance
    assert isinstance(make_app("crawlsentinel://" + sentinels.url().split("://", 1)[1]).backend,
                      AuditedSentinelBackend)
    plain = make_app(f"crawlredis://127.0.0.1:{sentinels.master_port()}/0")
    assert type(plain.backend) is AuditedRedisBackend


def test_no_or_two_master_names_are_config_errors(sentinels: SentinelSet) -> None:
    with pytest.raises(ConfigError, match=r"result_backend.*no master name"):
        _ = make_app("crawlredis+" + sentinels.broker_url(),
                     crawl_lease_url=sentinels.url()).backend
    with pytest.raises(ConfigError, match=r"result_backend.*master_name is 'other'"):
        _ = make_app("crawlredis+sentinel://" + sentinels.url().split("://", 1)[1],
                     result_backend_transport_options={"master_name": "other"}).backend


def test_results_survive_a_failover_like_stock_celerys(sentinels: SentinelSet) -> None:
    old = sentinels.wait_settled()
    ours_app = make_app("crawlredis+sentinel://" + sentinels.url().split("://", 1)[1])
    stock_app = make_app(sentinels.broker_url(),
                         result_backend_transport_options={"master_name": MASTER})
    ours, stock = ours_app.backend, stock_app.backend
    assert isinstance(stock, SentinelBackend) and not isinstance(stock, AuditedRedisBackend)
    store = open_store(sentinels.url(), namespace=CrawlConfig.from_app(ours_app).namespace)
    try:
        lease = store.acquire("worker:w1", 10.0, "w1")
        assert lease is not None
        before, after = str(uuid.uuid4()), str(uuid.uuid4())
        ours.store_result(before, 1, states.SUCCESS, request=Context(
            crawl_claim_token=lease.token, hostname="w1"))
        stock.store_result(before, 1, states.SUCCESS)
        sentinels.planned_failover()
        new = sentinels.wait_new_master(old)
        # What Sentinel does to the old master eventually, done now (a write reaching it is
        # refused READONLY, never applied, and retried by Celery's policy on the new master).
        sentinels.node(old).client().execute_command("REPLICAOF", "127.0.0.1", str(new))
        ours.store_result(after, 2, states.SUCCESS, request=Context(
            crawl_claim_token=lease.token, hostname="w1"))
        stock.store_result(after, 2, states.SUCCESS)
        for backend in (ours, stock):
            assert backend.get_task_meta(after, cache=False)["result"] == 2
        wait_until(lambda: ours.get_task_meta(before, cache=False)["result"] == 1, 10,
                   what="the replicated result")
        new_master = sentinels.node(new).client()
        assert new_master.exists(ours.get_key_for_task(after))
        assert [(r.state, r.outcome) for r in history(ours, after)] == [("SUCCESS", "written")]
        # A token the store never issued is refused: the counter checked is the store's.
        forged = str(uuid.uuid4())
        ours.store_result(forged, 3, states.SUCCESS, request=Context(
            crawl_claim_token=lease.token + 10**12, hostname="w1"))
        assert [(r.state, r.outcome) for r in history(ours, forged)] == [
            ("SUCCESS", "refused-unissued")]
    finally:
        store.close()
    sentinels.wait_settled(timeout_s=60)
