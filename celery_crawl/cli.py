"""``celery -A proj crawl ...``: a click group on Celery's ``celery.commands`` entry point.

Subcommands live beside the plugin they operate (schedules, beat, audit) and are attached here.
"""

from __future__ import annotations

import click

__all__ = ["crawl"]


@click.group(name="crawl", help="celery-crawl: schedules, leader status, operator commands, audit.")
@click.pass_context
def crawl(ctx: click.Context) -> None:
    ctx.ensure_object(dict)
