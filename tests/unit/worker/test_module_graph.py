"""No worker module imports another in a circle (type-only imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parents[3] / "celery_crawl" / "worker"


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(alias.name for alias in node.names)
    return out


def test_no_worker_module_imports_another_in_a_circle() -> None:
    graph = {p.stem: _imports(p) for p in WORKER.glob("*.py")}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = [*path[path.index(name):], name]
            raise AssertionError(f"import circle: {' -> '.join(cycle)}")
        if name in done or name not in graph:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*path, name])
        done.add(name)

    for module in sorted(graph):
        visit(module, [])
