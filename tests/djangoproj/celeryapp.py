"""The project's ``celery.py``, as django-celery-beat's documentation writes it."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.djangoproj.settings")

app = Celery("djbeat")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(broker_connection_retry_on_startup=True,
                broker_transport_options={"socket_timeout": 5, "socket_connect_timeout": 5})


@app.task(name="djbeat.record", bind=True)
def record(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    """Not run: the tests read the published messages from the broker."""
