"""Edits made the way the Django admin makes them (model ``save()``/``delete()``, so
django-celery-beat's signals move ``PeriodicTasks.last_update``), from the command line::

    python -m tests.djangoproj.admin '[{"op": "migrate"}, {"op": "interval", "name": "t", ...}]'

Ops: ``migrate``; ``interval`` (name, every, [period]); ``crontab`` (name, minute, hour, tz);
``set`` (name, fields); ``delete`` (name). The task is ``djbeat.record`` unless given.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main(ops: list[dict[str, Any]]) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.djangoproj.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

    for op in ops:
        kind = op["op"]
        task = op.get("task", "djbeat.record")
        if kind == "migrate":
            call_command("migrate", "django_celery_beat", verbosity=0)
        elif kind == "interval":
            every, _ = IntervalSchedule.objects.get_or_create(
                every=op["every"], period=op.get("period", "seconds"))
            PeriodicTask(name=op["name"], task=task, interval=every).save()
        elif kind == "crontab":
            cron = CrontabSchedule.objects.create(minute=op["minute"], hour=op["hour"],
                                                  timezone=op["tz"])
            PeriodicTask(name=op["name"], task=task, crontab=cron).save()
        elif kind == "set":
            row = PeriodicTask.objects.get(name=op["name"])
            for field, value in op["fields"].items():
                setattr(row, field, value)
            row.save()
        elif kind == "delete":
            PeriodicTask.objects.get(name=op["name"]).delete()
        else:
            raise SystemExit(f"unknown op {kind!r}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
