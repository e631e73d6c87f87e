"""Reports as people read them: the nested dicts that plan, audit, aot and batch return,
rendered as aligned text (`--format=table`, the default), or as JSON for scripts
(`--format=json`). See docs/cli.md.
"""

from __future__ import annotations

import json
from typing import Any


def write(report: dict[str, Any], out: Any, fmt: str, title: str = "") -> None:
    """`report` to the stream `out` in `fmt` ("table" or "json")."""
    if fmt == "json":
        out.write(json.dumps(report, indent=1) + "\n")
    else:
        out.write(render(report, title) + "\n")


def render(report: dict[str, Any], title: str = "", indent: int = 0) -> str:
    """Scalars as aligned `name  value` lines, then each nested dict as an indented
    section and each list of dicts as a table with a column per key."""
    pad = " " * indent
    lines = [pad + title] if title else []
    scalars = {k: v for k, v in report.items() if not isinstance(v, dict | list)}
    width = max(map(len, scalars), default=0)
    lines += [f"{pad}{k:<{width}}  {_cell(v)}" for k, v in scalars.items()]
    for key, value in report.items():
        if isinstance(value, dict):
            lines.append(render(value, f"{key}:", indent + 2) if value else f"{pad}{key}: -")
        elif isinstance(value, list):
            lines.append(_list(key, value, indent))
    return "\n".join(lines)


def _list(key: str, rows: list, indent: int) -> str:
    pad = " " * indent
    if not rows:
        return f"{pad}{key}: none"
    if not all(isinstance(row, dict) for row in rows):
        return f"{pad}{key}: {', '.join(map(_cell, rows))}"
    columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    table = [pad + "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    table += [pad + "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True))
              for r in cells]
    return f"{pad}{key}:\n" + "\n".join("  " + line for line in table)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.4e}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)
