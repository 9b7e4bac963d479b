"""Plain-text tables for the CLI: every header and cell made inert (_format.inert)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from validation_service.cli._format import format_value, inert


def render(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], tz: dt.tzinfo | None = None
) -> str:
    headers = [inert(str(h), cell=True) for h in headers]
    cells = [[inert(format_value(v, tz), cell=True) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines = [line, rule, *body] if body else [line, rule, "(none)"]
    return "\n".join(text.rstrip() for text in lines)
