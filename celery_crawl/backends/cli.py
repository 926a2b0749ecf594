"""`celery crawl` subcommands of the backends plugin."""

from __future__ import annotations

import click

__all__ = ["register"]


def register(group: click.Group) -> None:
    """Attach this plugin's subcommands to the `crawl` group."""
