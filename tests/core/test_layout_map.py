"""The Layout map (docs/layout.md) maps proxy/: every module of the proxy is named there, under
its folder, so a newcomer finds any concept's module from the folder names (issue 13)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _layout() -> str:
    """The Layout map: the docs site's page (README's section before issue 38)."""
    return (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")


def _proxy_block(layout: str) -> dict[str, str]:
    """folder ('' for proxy/ itself) -> the text of its entry in the map."""
    block = layout[layout.index("proxy/ "):layout.index("\nlocal_engine/")]
    entries: dict[str, str] = {}
    current = ""
    for line in block.splitlines()[1:]:
        head = re.match(r"  (\S+)", line)
        if head:
            name = head.group(1)
            current = name.rstrip("/") if name.endswith("/") else ""
            if not name.endswith("/"):
                entries[""] = entries.get("", "") + " " + name
                continue
        entries[current] = entries.get(current, "") + " " + line
    return entries


def test_every_proxy_module_is_on_the_map() -> None:
    entries = _proxy_block(_layout())
    missing = []
    for path in sorted((ROOT / "proxy").rglob("*.py")):
        rel = path.relative_to(ROOT / "proxy")
        if rel.name == "__init__.py":
            continue
        folder = rel.parts[0] if len(rel.parts) > 1 else ""
        if folder not in entries or not re.search(rf"\b{re.escape(rel.stem)}\b",
                                                  entries[folder]):
            missing.append(str(rel))
    assert not missing, f"proxy modules missing from docs/layout.md's map: {missing}"


def test_every_folder_on_the_map_exists() -> None:
    for folder in _proxy_block(_layout()):
        if folder:
            assert (ROOT / "proxy" / folder).is_dir(), folder
