"""Print two benchmark JSON results side by side with head / base for every number.

    python benchmarks/ratios.py base.json head.json
"""

from __future__ import annotations

import json
import pathlib
import sys


def pairs(base: object, head: object, path: str = "") -> dict[str, dict[str, float]]:
    """Every numeric leaf present in both, keyed by its path, with the ratio."""
    if isinstance(base, dict) and isinstance(head, dict):
        out: dict[str, dict[str, float]] = {}
        for key in base.keys() & head.keys():
            out |= pairs(base[key], head[key], f"{path}.{key}" if path else key)
        return out
    if isinstance(base, list) and isinstance(head, list) and len(base) == len(head):
        out = {}
        for i, (b, h) in enumerate(zip(base, head, strict=True)):
            out |= pairs(b, h, f"{path}[{i}]")
        return out
    numeric = (int, float)
    if isinstance(base, numeric) and isinstance(head, numeric) and not isinstance(base, bool):
        ratio = round(head / base, 3) if base else None
        return {path: {"base": base, "head": head, "head_over_base": ratio}}
    return {}


def main() -> None:
    base, head = (json.loads(pathlib.Path(name).read_text()) for name in sys.argv[1:3])
    print(json.dumps(dict(sorted(pairs(base, head).items())), indent=1))


if __name__ == "__main__":
    main()
