"""The module map of docs/design.md, enforced: which part of the package may import which.

Every ``import``/``from ... import`` of a ``celery_crawl`` module found by walking the source
(``ast``, so lazy imports inside functions count too; imports under ``if TYPE_CHECKING:`` do
not, they never run) must be allowed by ``ALLOWED`` or listed in ``EXCEPTIONS`` with its reason.
A new edge fails this test until the table (and the module map) says it is meant.
"""

from __future__ import annotations

import ast
from pathlib import Path

import celery_crawl

PACKAGE = Path(celery_crawl.__file__).parent

_BASE = {"errors", "durations", "_urls"}
_CORE = _BASE | {"config", "keys", "metrics"}
_SERVICES = _CORE | {"leases", "clock", "cliapp", "_broker", "_finishing", "_issued", "_canvas",
                        "publishes"}

#: part -> the parts it may import ("part" = first name below ``celery_crawl``; the package's
#: own ``__init__`` is ``(root)``). Lower layers never import higher ones.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "durations": {"errors"},
    "_urls": {"errors"},
    "_celery_compat": set(),
    "_broker": set(),
    "_finishing": set(),
    "_issued": set(),
    "_canvas": set(),
    "publishes": set(),
    "keys": set(),
    "metrics": {"errors"},
    "config": _BASE,
    "leases": _BASE,
    "clock": _CORE | {"leases"},
    "cliapp": set(),
    "schedules": _CORE | {"cliapp"},
    "status": _SERVICES | {"schedules"},
    "beat": _SERVICES | {"schedules", "status"},
    "worker": _SERVICES | {"status"},
    "backends": _SERVICES,
    "tasks": _SERVICES | {"worker", "backends"},
    # Composition roots: the CLI, the demo launcher and the package's public names.
    "cli": {"beat", "schedules", "backends"},
    "up": _SERVICES | {"schedules", "beat", "_demo"},
    "_demo": _SERVICES | {"schedules"},
    "(root)": _SERVICES | {"schedules", "beat", "worker", "backends", "tasks", "status"},
}
# The one module touching private Celery/kombu names imports nothing of the package, so every
# part may use it.
for _part_name, _allowed in ALLOWED.items():
    if _part_name != "_celery_compat":
        _allowed.add("_celery_compat")

#: (importing module, imported part) -> why it is allowed although the table says no.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("celery_crawl.status.view", "beat"):
        "the status view decodes the beat's durable records (beat.state); the beat serves the "
        "page, so status and beat depend on each other through these lazy imports only",
    ("celery_crawl.schedules.cli", "beat"):
        "`crawl next` and `crawl schedules check` show the app's schedule as the beat "
        "assembles it (beat.assembly); a CLI module is a composition root",
}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def _module_of(path: Path) -> tuple[str, str]:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    name = ".".join(parts)
    return name, name if is_pkg else name.rsplit(".", 1)[0]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skip.update(id(n) for n in ast.walk(inner))
    return skip


def imports_of(path: Path) -> set[str]:
    """The ``celery_crawl`` modules (or ``pkg.name`` for ``from pkg import name``) ``path``
    imports at run time."""
    module, package = _module_of(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skip = _type_checking_nodes(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "celery_crawl")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "celery_crawl":
                continue
            if target == "celery_crawl":  # ``from celery_crawl import beat`` / ``from .. import x``
                out.update(f"{target}.{a.name}" for a in node.names)
            else:
                out.add(target)
    out.discard(module)
    return out


def edges() -> list[tuple[str, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module, _ = _module_of(path)
        for target in sorted(imports_of(path)):
            if _part(target) != _part(module):
                found.append((module, _part(target)))
    return found


def test_every_part_is_in_the_table() -> None:
    parts = {_part(_module_of(p)[0]) for p in PACKAGE.rglob("*.py")}
    assert parts <= ALLOWED.keys(), f"not in the module map: {sorted(parts - ALLOWED.keys())}"


def test_no_import_breaks_the_module_map() -> None:
    bad = [f"{module} imports celery_crawl.{part}" for module, part in edges()
           if part not in ALLOWED[_part(module)] and (module, part) not in EXCEPTIONS]
    assert not bad, "imports outside docs/design.md's module map:\n" + "\n".join(bad)


def test_every_exception_is_still_needed() -> None:
    found = set(edges())
    stale = [f"{m} -> {p}" for (m, p) in EXCEPTIONS if (m, p) not in found]
    assert not stale, f"listed exceptions that no longer occur: {stale}"


def test_the_walker_sees_lazy_and_relative_imports() -> None:
    # The walk is the test: it must find an import inside a function, a ``from .. import x``
    # and skip a TYPE_CHECKING block, or the table above checks nothing.
    probe = PACKAGE / "beat" / "scheduler.py"
    found = imports_of(probe)
    assert "celery_crawl._broker" in found  # a lazy import inside a method
    assert "celery_crawl.leases" in found
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from ..config import CrawlConfig\nfrom .base import Lease\n")
    skipped = _type_checking_nodes(tree)
    kept = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and id(n) not in skipped]
    assert [n.module for n in kept] == ["typing", "base"]


def _own_import_fallbacks(tree: ast.AST) -> list[int]:
    """Lines of ``try: <import of the package> except ImportError:`` that carry on instead of
    raising: a fallback that hides a broken or cyclic import of our own code."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        own = any(isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith(
            "celery_crawl")) for stmt in node.body for n in ast.walk(stmt))
        for handler in node.handlers:
            caught = ast.unparse(handler.type) if handler.type else "BaseException"
            swallowed = not isinstance(handler.body[-1], ast.Raise)
            if own and swallowed and ("ImportError" in caught or "ModuleNotFound" in caught):
                found.append(handler.lineno)
    return found


def test_no_own_import_falls_back_on_import_error() -> None:
    # An optional *third-party* dependency may be reported as a ConfigError (leases/etcd.py
    # names the extra and raises); our own modules are always installed, so a guard that
    # swallows their ImportError only turns an import cycle into a silent second code path.
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line}"
           for path in sorted(PACKAGE.rglob("*.py"))
           for line in _own_import_fallbacks(ast.parse(path.read_text(encoding="utf-8")))]
    assert not bad, f"ImportError fallbacks around the package's own imports: {bad}"
    probe = ast.parse("try:\n    from ..leases import x\nexcept ImportError:\n    x = None\n")
    assert _own_import_fallbacks(probe) == [3]
