"""Celery calls every bootstep hook it knows (``start``, ``stop``, ``close``, ``shutdown``,
``info``, ...) as ``hook(parent)`` on each step of a blueprint: a method of ours that shares a
hook's name must take exactly that call, or stopping the consumer raises."""

from __future__ import annotations

import inspect

import pytest
from celery import bootsteps

from celery_crawl.worker.steps import ClaimStep, LeaseStep


@pytest.mark.parametrize("cls", [LeaseStep, ClaimStep])
def test_every_method_named_like_a_bootstep_hook_takes_the_parent(cls: type) -> None:
    for name, value in vars(cls).items():
        hook = getattr(bootsteps.StartStopStep, name, None)
        if name.startswith("__") or not (inspect.isfunction(value) and callable(hook)):
            continue
        inspect.signature(value).bind(object(), object())  # (self, parent)
