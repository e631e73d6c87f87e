"""docs/architecture.md's layout names every module under jaxinfer/ (package
`__init__.py` files aside), each at its place in the tree, and nothing that is gone."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[A-Za-z_][\w.]*(?:\.py|/))(?:\s|$)")


def _documented() -> set[str]:
    """The paths the layout's tree names, from its indentation (two spaces a level)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("## 2. Layout")
    block = text[text.index("```", start) + 3:text.index("```", text.index("```", start) + 3)]
    path: list[str] = []
    names = set()
    for line in block.splitlines():
        match = ENTRY.match(line)
        if match is None:
            continue
        depth = len(match["indent"]) // 2
        path = [*path[:depth], match["name"]]
        names.add("".join(path))
    return names


def test_the_layout_names_every_module():
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "jaxinfer").rglob("*.py")
               if p.name != "__init__.py" and "demo" not in p.parts}
    documented = _documented()
    assert sorted(modules - documented) == [], "modules the layout does not name"
    named_modules = {n for n in documented if n.endswith(".py") and not
                     n.endswith("__init__.py")}
    assert sorted(named_modules - modules) == [], "names in the layout with no module"
