"""The private Celery and kombu names the package relies on still exist, and only
``celery_crawl._celery_compat`` touches them.

A Celery or kombu upgrade that removes or renames one of them fails here, by name, instead of
somewhere in a worker at run time.
"""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.backends.redis import RedisBackend
from celery.contrib.testing.mocks import TaskMessage
from celery.worker.request import Request

import celery_crawl
from celery_crawl import _celery_compat as compat
from celery_crawl.backends.audited import AuditedRedisBackend

PACKAGE = Path(celery_crawl.__file__).parent
COMPAT = PACKAGE / "_celery_compat.py"
DECLARED = {name for names in compat.PRIVATE_NAMES.values() for name in names}
DECLARED |= set(compat.BACKEND_OVERRIDES)


def _class(spec: str) -> type:
    module, _, name = spec.partition(":")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


@functools.cache
def _instance(spec: str) -> Any:
    """A real object of the class, for names Celery sets in ``__init__``."""
    if spec == "celery.app.base:Celery":
        return Celery("compat", set_as_current=False)
    if spec == "celery.worker.request:Request":
        app = Celery("compat", set_as_current=False)

        @app.task(name="celery_crawl_compat_test.noop")
        def noop() -> None:
            return None

        return Request(TaskMessage("celery_crawl_compat_test.noop"), app=app)
    if spec == "celery.backends.redis:RedisBackend":
        app = Celery("compat", set_as_current=False)
        return RedisBackend(app=app, url="redis://127.0.0.1:1/0")
    if spec == "redis.connection:Connection":
        from redis.connection import Connection

        return Connection()
    if spec == "kombu.transport.virtual.base:Message":
        from kombu.transport.virtual.base import Message

        return Message({"body": "", "headers": {},
                        "properties": {"delivery_tag": "t", "delivery_info": {}}})
    return None


@pytest.mark.parametrize(
    ("spec", "name"),
    [(spec, name) for spec, names in compat.PRIVATE_NAMES.items() for name in names])
def test_private_name_exists(spec: str, name: str) -> None:
    cls = _class(spec)
    obj = _instance(spec)
    present = hasattr(cls, name) or (obj is not None and hasattr(obj, name))
    since = compat.SINCE.get(f"{spec}.{name}")
    if since is not None and not compat.at_least(*since):
        # Before the release that added it, the function using it takes its fallback.
        assert not present, f"{spec}.{name} exists before {since}: update SINCE"
        return
    assert present, f"{spec} has no {name} any more: update celery_crawl/_celery_compat.py"


def test_request_message_is_the_message_it_was_built_from() -> None:
    req = _instance("celery.worker.request:Request")
    assert compat.request_message(req) is req._message


@pytest.mark.parametrize("name", compat.BACKEND_OVERRIDES)
def test_backend_override_overrides_a_base_method(name: str) -> None:
    assert callable(getattr(RedisBackend, name, None)), f"RedisBackend has no {name} any more"
    assert name in vars(AuditedRedisBackend), f"AuditedRedisBackend does not override {name}"


def test_every_private_override_of_the_backend_is_declared() -> None:
    overridden = {name for name in vars(AuditedRedisBackend)
                  if name.startswith("_") and not name.startswith("__")
                  and hasattr(RedisBackend, name)}
    assert overridden <= set(compat.BACKEND_OVERRIDES)


def test_the_checked_versions_are_named() -> None:
    doc = " ".join((compat.__doc__ or "").lower().split())
    for package, versions in compat.CHECKED_AGAINST.items():
        name = "redis-py" if package == "redis" else package
        assert f"{name} {versions[0]}" in doc
        for version in versions[1:]:
            assert version in doc


def test_the_installed_releases_are_in_the_tested_range() -> None:
    # CI runs this on every supported minor; a release outside the range fails here first.
    assert compat.untested_versions() == []
    assert compat.fast_paths_ok()


def test_an_untested_release_is_named_once_and_turns_the_fast_paths_off(
        caplog: pytest.LogCaptureFixture) -> None:
    versions = {"celery": "5.8.1", "kombu": "5.7.0", "redis": "8.2.0"}
    assert compat.untested_versions(versions) == ["celery 5.8.1 (tested: 5.4-5.7)"]
    assert not compat.fast_paths_ok(versions)
    with caplog.at_level("WARNING", logger="celery_crawl.compat"):
        assert not compat.warn_untested("test-component", versions)
        assert not compat.warn_untested("test-component", versions)
    warnings = [r for r in caplog.records if "celery 5.8.1" in r.getMessage()]
    assert len(warnings) == 1
    assert "fast paths" in warnings[0].getMessage()
    assert compat.untested_versions({"celery": "", "kombu": "5.4.2", "redis": "5.2.1"}) == [
        "celery (unknown) (tested: 5.4-5.7)"]


def _enclosing_functions(tree: ast.AST) -> dict[int, str]:
    owner: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                owner[id(inner)] = node.name  # innermost wins: walk visits outer first
    return owner


def _is_super_call(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super")


def uses_outside_compat(path: Path) -> list[str]:
    """Where ``path`` touches a declared private name: an attribute, a ``getattr`` string, or a
    method of that name that is not a declared override."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    owner = _enclosing_functions(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and node.attr in DECLARED:
            # An override extending its base (``super()._create_client(...)`` in
            # ``_create_client``) is the one allowed use.
            if not (_is_super_call(node.value) and owner.get(id(node)) == node.attr
                    and node.attr in compat.BACKEND_OVERRIDES):
                found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in DECLARED:
            found.append(f"{where}: {node.value!r}")
        elif (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in DECLARED
              and node.name not in compat.BACKEND_OVERRIDES):
            found.append(f"{where}: def {node.name}")
    return found


def test_no_module_but_the_compat_module_touches_a_private_name() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == COMPAT or "_etcdpb" in path.parts:
            continue
        found.extend(uses_outside_compat(path))
    assert not found, "private Celery/kombu names outside _celery_compat.py:\n" + "\n".join(found)


def test_the_check_sees_a_private_name() -> None:
    assert uses_outside_compat(COMPAT), "the walk finds nothing even in the compat module"
