"""When to assemble the schedule again: a poll of the schedule files' names, mtimes and sizes.

A ``stat`` of each file every second is cheap and works on every filesystem (inotify does not
see a ConfigMap's symlink swap, nor NFS); the schedule is assembled again only when the
signature changed. Which entries changed is decided by fingerprint, so touching a file without
changing it restarts nothing.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FileWatch", "changed_names"]


class FileWatch:
    """Tells whether the files matched by ``patterns`` changed since the last call."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = tuple(patterns)
        self._sig: tuple[tuple[str, int, int], ...] | None = None

    def signature(self) -> tuple[tuple[str, int, int], ...]:
        """``(path, mtime_ns, size)`` of every matched file, sorted by path."""
        files = sorted({p for pat in self.patterns for p in glob.glob(pat, recursive=True)})
        items = []
        for path in files:
            try:
                st = os.stat(path)
            except OSError:  # removed between the glob and the stat: the next poll sees it
                continue
            items.append((path, st.st_mtime_ns, st.st_size))
        return tuple(items)

    def changed(self, *, force: bool = False) -> bool:
        """Whether the signature differs from the last call's (always True with ``force``)."""
        sig = self.signature()
        if not force and sig == self._sig:
            return False
        self._sig = sig
        return True


def changed_names(old: Mapping[str, Any], new: Mapping[str, Any]) -> set[str]:
    """Names added, removed or with another fingerprint between two ``name -> entry`` maps."""
    return {n for n in old.keys() | new.keys()
            if n not in old or n not in new or old[n].fingerprint != new[n].fingerprint}
