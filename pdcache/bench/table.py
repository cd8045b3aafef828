"""Printing benchmark results as a table and writing the same numbers as JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


def render_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "(no rows)"
    cols = list(columns or rows[0].keys())
    cells = [[format_value(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join([line, sep, *body])


def emit(
    title: str,
    rows: Sequence[dict[str, Any]],
    json_path: str | None = None,
    columns: Sequence[str] | None = None,
    extra: dict[str, Any] | None = None,
    out: TextIO | None = None,
) -> None:
    """Print `rows` under `title`; with `json_path`, write {"title", "rows", **extra} there."""
    out = out or sys.stdout
    print(f"\n== {title} ==", file=out)
    print(render_table(rows, columns), file=out)
    if extra:
        for key, value in extra.items():
            print(f"{key}: {format_value(value)}", file=out)
    if json_path:
        payload = {"title": title, "rows": list(rows), **(extra or {})}
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {json_path}", file=out)
