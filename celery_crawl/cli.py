"""``celery -A proj crawl ...``: a click group on Celery's ``celery.commands`` entry point.

Subcommands live beside the plugin they operate (``schedules/cli.py``, ``beat/cli.py``,
``backends/cli.py``) and are attached here.
"""

from __future__ import annotations

import click

from .backends import cli as _backends_cli
from .beat import cli as _beat_cli
from .schedules import cli as _schedules_cli

__all__ = ["crawl"]


@click.group(name="crawl", help="celery-crawl: schedules, leader status, operator commands, audit.")
def crawl() -> None:
    # Celery's CLIContext (``ctx.obj``, carrying ``.app``) flows to the subcommands untouched.
    pass


for _module in (_schedules_cli, _beat_cli, _backends_cli):
    _module.register(crawl)
