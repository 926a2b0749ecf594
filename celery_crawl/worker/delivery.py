"""What Celery handed a task's strategy for one message, kept until the claim is decided.

A delivery is claimed before Celery builds its request, and the claim may be decided later (off
the event loop, or after parking behind another worker's claim): the strategy's arguments wait
here, named and typed, until the consumer step runs the strategy or settles the message itself.
This module does not import Celery.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["Delivery"]


@dataclasses.dataclass(frozen=True)
class Delivery:
    """The arguments of one call of a task's strategy, and the consumer it came through."""

    #: Celery's strategy of the task (run once the claim says so).
    strategy: Callable[..., Any]
    body: Any
    ack: Callable[..., Any]
    reject: Callable[..., Any]
    callbacks: Any
    kwargs: dict[str, Any]
    #: The consumer the message arrived on: a decision made off the loop is not applied once the
    #: consumer was rebuilt (Celery dropped the old connection's deliveries).
    consumer: Any = None
