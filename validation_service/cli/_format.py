"""How the command line shows values to people: 4 significant digits, local times with
their zone, short node ids and plain ``key=value`` dicts. JSON output never comes here."""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Mapping
from typing import Any

# What a terminal acts on: C0 and C1 control characters (ESC starts cursor moves, window
# titles, hyperlinks; BEL, CR, backspace rewrite what is shown), DEL, line separators and
# the bidirectional overrides that reorder text on screen.
_OTHER_CONTROLS = "\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_CONTROL_IN_TEXT = re.compile(f"[\x00-\x08\x0b-\x1f{_OTHER_CONTROLS}]")  # tab, newline stay
_CONTROL_IN_CELL = re.compile(f"[\x00-\x1f{_OTHER_CONTROLS}]")

NODE_ID_CHARS = 8
SIGNIFICANT_DIGITS = 4


def format_value(value: Any, tz: dt.tzinfo | None = None) -> str:
    """One value as a table cell: "-" for nothing, numbers to 4 significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return format_float(value)
    if isinstance(value, dt.datetime):
        return format_time(value, tz)
    if isinstance(value, Mapping):
        return format_mapping(value, tz)
    if isinstance(value, (list, tuple, set, frozenset)):
        return ",".join(format_value(v, tz) for v in value) or "-"
    if hasattr(value, "value") and isinstance(getattr(value, "value", None), str):
        return value.value  # a status enum
    return str(value)


def inert(text: str, *, cell: bool = False) -> str:
    """``text`` as it may reach a terminal: each control character shown as its escape
    (ESC as \\x1b, BEL as \\x07), so that no run name, tag value, metric name or error
    message can move the cursor, retitle the window or hide output. Newlines and tabs
    stay, except in a table ``cell``."""
    pattern = _CONTROL_IN_CELL if cell else _CONTROL_IN_TEXT
    return pattern.sub(lambda found: found.group().encode("unicode_escape").decode(), text)


def echo(message: Any = "", *, err: bool = False, nl: bool = True) -> None:
    """click.echo of ``message`` made inert: every printer of the command line uses it."""
    import click

    click.echo(inert(str(message)), err=err, nl=nl)


def format_float(value: float) -> str:
    """0.699999988 (a float32 metric) reads 0.7; 1234567.0 reads 1.235e+06."""
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.{SIGNIFICANT_DIGITS}g}"


def format_mapping(value: Mapping[str, Any], tz: dt.tzinfo | None = None) -> str:
    """``{"accuracy": 0.7, "epoch": 3}`` reads ``accuracy=0.7 epoch=3``."""
    if not value:
        return "-"
    return " ".join(f"{key}={format_value(item, tz)}" for key, item in value.items())


def format_time(value: dt.datetime, tz: dt.tzinfo | None = None) -> str:
    """A registry time (UTC) in ``tz``, by default this machine's zone, with its offset:
    ``2026-11-23 12:03:04 UTC+01:00``."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)  # the registry stores UTC
    local = value.astimezone(tz)
    offset = local.utcoffset() or dt.timedelta(0)
    sign = "-" if offset < dt.timedelta(0) else "+"
    minutes = abs(int(offset.total_seconds())) // 60
    return f"{local:%Y-%m-%d %H:%M:%S} UTC{sign}{minutes // 60:02d}:{minutes % 60:02d}"


def short_node_id(node_id: str | None) -> str | None:
    """Ray's 56-character node ids, cut like git cuts commit ids."""
    return None if node_id is None else node_id[:NODE_ID_CHARS]


def format_size(size_bytes: int | None) -> str:
    if size_bytes is None:
        return "-"
    size = float(size_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return str(size_bytes)


def format_cost(cost: Any, by: str = "pool") -> str:
    """A ValidationCost in a cell: its accelerator-seconds, then those of each ``by``
    ("pool", "validator", "accelerator_type") that held any; "" where no attempt's
    running time is known."""
    if cost is None or not cost.lines:
        return ""
    parts = [f"{name} {format_float(value)}" for name, value in cost.by(by).items() if value]
    total = format_float(cost.accelerator_s)
    return f"{total} ({', '.join(parts)})" if parts else total
