"""The Celery app behind a ``celery -A proj crawl ...`` invocation, for every subcommand."""

from __future__ import annotations

from typing import Any

import click

__all__ = ["app_of"]


def app_of(ctx: click.Context) -> Any:
    """The ``-A`` app from Celery's ``CLIContext`` (``ctx.obj.app`` on this or an outer context).

    Raises:
        click.UsageError: when not run under ``celery`` (no app to act on).
    """
    node: click.Context | None = ctx
    while node is not None:
        app = getattr(node.obj, "app", None)
        if app is not None:
            return app
        node = node.parent
    raise click.UsageError("run this as `celery -A proj crawl ...` so the app is known")
