"""The ACL recipes of docs/security.md, read from the file so that the tests run exactly them."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def documented_acl_rules(marker: str, user: str, namespace: str) -> list[str]:
    """The rules of the ``ACL SETUSER`` block between ``<!-- {marker}-begin -->`` and its end,
    for ``namespace`` (the recipe is written for ``crawl``), without ``reset``/``on``/password."""
    text = DOCS.read_text(encoding="utf-8")
    block = re.search(rf"<!-- {re.escape(marker)}-begin -->\s*```\s*\n(.*?)\n```", text, re.S)
    assert block, f"docs/security.md lost its {marker} block"
    words = block.group(1).split()
    assert words[:3] == ["ACL", "SETUSER", user], words[:3]
    rules = [w for w in words[3:] if not w.startswith(">") and w not in ("reset", "on")]
    return [w.replace("crawl:", f"{namespace}:") for w in rules]
