"""A task message arrives with no claim token of its own, wherever a producer put one.

The token a run carries comes from its claim alone: the claim step writes it into the message's
headers before Celery builds the request. Celery builds the request's context from the headers
and then merges the protocol-2 body's third element (the "embed": callbacks, errbacks, chain,
chord) over them, in the pool process that runs the task, from the message's raw body. A token
a producer put in the embed would therefore win over the claim's, and in a worker that vouches
for its tokens (``_issued.py``) reach the audited backend unchecked, pinning the fence of that
task id above every token the store will ever issue. So the key is taken out of every place a
message can carry it before anything else reads the message: the headers, the embed (the body is
re-encoded with its own serializer; rare, only when a producer put the key there) and a protocol
1 body. Nothing here reads a claim or imports Celery.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.serialization import dumps, registry

from .context import CLAIM_HEADER

__all__ = ["strip_claim_token"]

logger = logging.getLogger("celery_crawl.worker")


def strip_claim_token(message: Any) -> bool:
    """Remove ``crawl_claim_token`` from ``message`` wherever it carries one (headers, the
    protocol-2 embed, a protocol-1 body). True when one was found (logged: a producer forged
    it). A body kombu cannot decode is left alone: Celery refuses that message itself."""
    found = False
    headers = message.headers
    if isinstance(headers, dict) and CLAIM_HEADER in headers:
        headers.pop(CLAIM_HEADER, None)
        # A header of our own name is normal on a redelivery through a worker that wrote it
        # (kombu's Redis restore keeps the headers): not worth a warning by itself.
    try:
        payload = message.payload  # decoded once; Celery's strategy reads the same cache
    except Exception:
        return False
    if isinstance(payload, dict):  # task protocol 1: the request is built from the body
        if CLAIM_HEADER in payload:
            payload.pop(CLAIM_HEADER, None)
            found = True
    elif isinstance(payload, list | tuple) and len(payload) == 3 and isinstance(
            payload[2], dict) and CLAIM_HEADER in payload[2]:
        payload[2].pop(CLAIM_HEADER, None)
        found = True
        _reencode(message, payload)
    if found:
        logger.warning("celery-crawl: %s[%s] carried a %s in its body; removed (a run's token "
                       "comes from its claim only)",
                       (headers or {}).get("task") if isinstance(headers, dict) else None,
                       (headers or {}).get("id") if isinstance(headers, dict) else None,
                       CLAIM_HEADER)
    return found


def _reencode(message: Any, payload: Any) -> None:
    """Write the cleaned payload back as the raw body the pool decodes (same serializer)."""
    name = registry.type_to_name.get(message.content_type)
    if name is None:
        raise ValueError(f"cannot re-encode a {message.content_type!r} body")
    _, encoding, data = dumps(payload, serializer=name)
    message.body = data.encode(encoding) if isinstance(data, str) else data
    message.content_encoding = encoding
