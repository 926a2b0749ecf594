"""The worker's lease state as flat ``celery inspect stats`` rows.

Flower's worker page shows every top-level key of ``inspect stats`` it does not know as one row
of its "Other" tab, and a nested dict as one unreadable blob; so the lease state is given as
``crawl_*`` keys with scalar values. ``inspect crawl_leases`` keeps the full record and claims.
"""

from __future__ import annotations

from typing import Any

__all__ = ["STATS_KEYS", "flat_stats"]

#: Row name in ``inspect stats`` for each field of ``LeaseStep.status()``, in display order.
STATS_KEYS: dict[str, str] = {
    "holder": "crawl_lease_holder",
    "lease": "crawl_lease_name",
    "token": "crawl_lease_token",
    "generation": "crawl_lease_generation",
    "lease_time_left_s": "crawl_lease_time_left_s",
    "ttl_s": "crawl_lease_ttl_s",
    "consuming": "crawl_consuming",
    "claims": "crawl_claims",
    "parked": "crawl_parked",
    "renew_ok": "crawl_renew_ok",
    "renew_failed": "crawl_renew_failed",
    "renew_success_rate": "crawl_renew_success_rate",
    "lease_losses": "crawl_lease_losses",
    "last_loss": "crawl_last_loss",
    "last_error": "crawl_last_error",
    "reaper": "crawl_reaper",
    "reaper_recovered": "crawl_recoveries",
    "fenced": "crawl_fenced",
    "duplicates_dropped": "crawl_duplicates_dropped",
    "poisoned": "crawl_poisoned",
    "backlog": "crawl_backlog",
    "store": "crawl_store",
    "pool": "crawl_pool",
    "broker": "crawl_broker",
    "on_lease_loss": "crawl_on_lease_loss",
}


def flat_stats(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` (``LeaseStep.status()``) as ``crawl_*`` rows with scalar values.

    A field this table does not name still gets a row (``crawl_<field>``), so a new figure is
    never silently dropped; a non-scalar value is shown as text rather than nested.
    """
    out: dict[str, Any] = {}
    for field in (*STATS_KEYS, *(k for k in status if k not in STATS_KEYS)):
        if field not in status:
            continue
        value = status[field]
        if not (value is None or isinstance(value, bool | int | float | str)):
            value = str(value)
        out[STATS_KEYS.get(field, f"crawl_{field}")] = value
    return out
