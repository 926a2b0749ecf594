"""Whether every claim token this process's task requests carry was issued by the lease store.

With the Redis lease store on its server, the audited result backend checks that a result
write's claim token was issued (``token <= GET {namespace}:token``), so that a token forged
into a task message cannot pass. In a worker running the plugins no forged token reaches a
request: the claim step removes ``crawl_claim_token`` from every message it receives, wherever
the message carries it (headers, the protocol-2 embed Celery merges over them, a protocol-1
body: ``worker/unforged.py``), and sets it only from the reply of a claim the store issued,
before Celery builds the request. There the check could only confirm what the worker already
knows, at the price of one round trip on almost every write (a new task's token is above every
counter value the backend read before it).

The claim step vouches when Celery builds the consumer, before a prefork pool forks its
children, which inherit it. A process nobody vouched for (a stock worker sharing the backend, a
script, the CLI) keeps the check. A request built by hand inside a task is not the worker's:
code that forges a token there can write to the store directly anyway.

The module sits below ``worker`` and ``backends``, so neither imports the other for it.
"""

from __future__ import annotations

__all__ = ["unvouch", "vouch", "vouched"]

_vouched = False


def vouch() -> None:
    """This process (and every child it forks from now on) runs tasks only through the claim
    step, which sets every request's claim token from an issued claim."""
    global _vouched
    _vouched = True


def vouched() -> bool:
    """Whether the claim tokens of this process's task requests need no issuance check."""
    return _vouched


def unvouch() -> None:
    """The worker stopped: this process may now write for requests nobody vetted."""
    global _vouched
    _vouched = False
