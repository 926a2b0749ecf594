"""workers.observe against a real redis-server: what pool children record is what the main
process exports; queue lengths per priority sub-queue; labels bounded whatever producers send."""

from __future__ import annotations

import uuid

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import RedisServer
from workers.observe import MAX_SITES, CrawlerCollector, Recorder, proxy_label, site_label


def _samples(collector: CrawlerCollector) -> list[tuple[str, dict[str, str], float]]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


def test_recorded_fetches_queue_lengths_and_bounded_labels(redis_server: RedisServer) -> None:
    client = redis_server.client(5)
    ns, worker = f"m{uuid.uuid4().hex[:6]}", "host:1"
    queue = f"q-{ns}"
    rec = Recorder(client, namespace=ns, worker=worker)
    rec.fetched(site="shop", proxy="direct", status=200, reason=None, elapsed_s=0.03)
    rec.fetched(site="shop", proxy="direct", status=503, reason="status-503", elapsed_s=0.2)
    rec.fetched(site="shop", proxy="proxy-2", status=None, reason="timeout", elapsed_s=3.0)
    rec.fetched(site="shop", proxy=None, status=None, reason="host-not-allowed", elapsed_s=None)
    rec.fetched(site="shop", proxy="direct", status=200, reason="Not A Reason!", elapsed_s=0.01)
    for i in range(MAX_SITES + 5):  # a producer inventing entry names
        rec.fetched(site=f"s{i:04d}", proxy=None, status=200, reason=None, elapsed_s=None)
    broker = redis_server.client(6)
    broker.delete(queue, f"{queue}\x06\x163")
    broker.rpush(queue, "a", "b")
    broker.rpush(f"{queue}\x06\x163", "c")
    samples = _samples(CrawlerCollector(client, namespace=ns, worker=worker, broker=broker,
                                        queues=lambda: [queue]))

    def value(name: str, **labels: str) -> float | None:
        got = [v for n, lab, v in samples if n == name and lab == labels]
        return got[0] if got else None

    assert value("crawler_http_responses_total", site="shop", code="200") == 2
    assert value("crawler_http_responses_total", site="shop", code="503") == 1
    assert value("crawler_fetch_failures_total", site="shop", reason="timeout") == 1
    assert value("crawler_fetch_failures_total", site="shop", reason="host-not-allowed") == 1
    assert value("crawler_fetch_failures_total", site="shop", reason="other") == 1
    assert value("crawler_proxy_latency_seconds_count", proxy="direct") == 3
    assert value("crawler_proxy_latency_seconds_bucket", proxy="direct", le="0.05") == 2
    assert abs((value("crawler_proxy_latency_seconds_sum", proxy="direct") or 0) - 0.24) < 1e-6
    assert value("crawler_proxy_health_ratio", proxy="direct") == 1.0  # a 503 is an answer
    assert value("crawler_proxy_health_ratio", proxy="proxy-2") == 0.0  # timed out
    assert value("crawler_queue_length", queue=queue, priority="0") == 2
    assert value("crawler_queue_length", queue=queue, priority="3") == 1
    assert value("crawler_queue_length", queue=queue, priority="9") == 0
    sites = {lab["site"] for _, lab, _ in samples if "site" in lab}
    assert len(sites) == MAX_SITES + 1 and "other" in sites  # the rest folded into other
    assert value("crawler_metrics_up") == 1


def test_labels_never_carry_urls_or_unbounded_names() -> None:
    allowed = ("127.0.0.1", "shop.example")
    assert site_label("jd-prices", "https://x/", allowed) == "jd-prices"
    assert site_label(None, "https://shop.example/a?b", allowed) == "shop.example"
    assert site_label(None, "https://elsewhere.example/", allowed) == "other"
    assert site_label(None, "https://elsewhere.example/", None) == "other"
    assert site_label("<script>", "https://shop.example/", allowed) == "shop.example"
    assert site_label("x" * 65, "https://nope/", allowed) == "other"
    proxies = ("direct", "http://user:pw@proxy:3128")
    assert [proxy_label(proxies, i) for i in (0, 1, 7)] == ["direct", "proxy-2", "proxy-2"]
