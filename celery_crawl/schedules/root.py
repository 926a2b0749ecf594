"""Where relative schedule paths resolve: the app's project root, not the working directory.

Two replicas of one app started from different directories must read the same files: a
replica that finds none would lead an empty schedule. So a relative entry of
``crawl_schedule_paths`` is taken from the directory the app's module was imported from (the
``sys.path`` entry holding its top-level package: ``celery -A proj`` run from anywhere reads
``<root of proj>/beat_schedules/*.toml``). Only an app that no imported module holds (one built
inside a function, as tests do) falls back to the working directory, and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import weakref
from pathlib import Path
from typing import Any

__all__ = ["ScheduleBase", "schedule_base"]

_cache: weakref.WeakKeyDictionary[Any, ScheduleBase] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduleBase:
    """The base directory and how it was chosen.

    Attributes:
        path: absolute directory relative schedule paths are joined to.
        module: the module holding the app it was derived from (None: the working directory).
    """

    path: Path
    module: str | None

    def describe(self) -> str:
        if self.module is None:
            return (f"{self.path} (the working directory: no imported module holds the app; "
                    "use absolute paths to be independent of it)")
        return f"{self.path} (the import root of the app's module {self.module})"


def _root_of(module: Any) -> Path | None:
    file = getattr(module, "__file__", None)
    if not file:
        return None
    spec = getattr(module, "__spec__", None)
    name = str(getattr(spec, "name", None) or getattr(module, "__name__", ""))
    top = sys.modules.get(name.split(".")[0]) if "." in name else None
    if top is not None:
        # The directory holding the top-level package (a subpackage may be mapped elsewhere).
        top_file = getattr(top, "__file__", None)
        if top_file:
            return Path(top_file).resolve().parent.parent
        top_paths = list(getattr(top, "__path__", None) or ())
        if top_paths:
            return Path(top_paths[0]).resolve().parent
    path = Path(file).resolve()
    depth = name.count(".") + (1 if path.name == "__init__.py" else 0)
    if name == "__main__":  # a script: its own directory
        depth = 0
    root = path.parent
    for _ in range(depth):
        root = root.parent
    return root


def _holder_of(app: Any) -> tuple[str, Any] | None:
    """The first imported module with the app as a global (``proj.celery`` or ``proj``: the
    same root either way)."""
    main = getattr(app, "main", None)
    candidates = [sys.modules.get(main)] if isinstance(main, str) else []
    candidates += list(sys.modules.values())
    for module in candidates:
        if module is None or not getattr(module, "__file__", None) \
                or str(getattr(module, "__name__", "")).split(".")[0] in ("celery", "kombu"):
            continue
        try:
            values = list(vars(module).values())
        except TypeError:
            continue
        if any(v is app for v in values):
            return str(getattr(module, "__name__", "?")), module
    return None


def schedule_base(app: Any) -> ScheduleBase:
    """The directory ``app``'s relative schedule paths resolve against (see the module doc)."""
    try:
        cached = _cache.get(app)
    except TypeError:  # not weak-referenceable
        cached = None
    if cached is not None:
        return cached
    found = _holder_of(app)
    root = _root_of(found[1]) if found is not None else None
    if found is None or root is None:
        # Not cached: the app's module may not be imported yet (asked again later).
        return ScheduleBase(Path(os.getcwd()), None)
    base = ScheduleBase(root, found[0])
    with contextlib.suppress(TypeError):  # not weak-referenceable: not cached
        _cache[app] = base
    return base
