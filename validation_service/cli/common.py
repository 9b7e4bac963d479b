"""What every `ckval` command module shares: the exit statuses, the invocation's settings
and registry (--database-url, --namespace), the listings' fast read, JSON and tables.

Imports stay light (click and nothing heavy): the CLI starts fast.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from validation_service.cli._format import echo

if TYPE_CHECKING:
    from validation_service.config import Settings
    from validation_service.registry.registry import Registry

# Exit statuses: the same situation ends with the same one in every command.
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NOT_RUNNING = 3

json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print JSON (full precision, UTC times)."
)


def get_settings(**overrides: Any) -> Settings:
    """The configured Settings with the given overrides (loads pydantic on first use)."""
    from validation_service.config import get_settings as configured

    return configured(**overrides)


def settings_of(ctx: click.Context, **overrides: Any) -> Settings:
    """The Settings of this invocation: --database-url, --namespace, then ``overrides``."""
    obj = ctx.find_root().obj or {}
    return get_settings(
        database_url=obj.get("database_url"), namespace=obj.get("namespace"), **overrides
    )


def registry_of(ctx: click.Context) -> Registry:
    """The registry of this invocation (--database-url, --namespace), opened once."""
    from validation_service.registry.registry import Registry

    obj = ctx.find_root().ensure_object(dict)
    if "registry" not in obj:
        obj["registry"] = Registry(settings=settings_of(ctx))
    return obj["registry"]


def listing(ctx: click.Context, method: str, *args: Any, **kwargs: Any) -> Any:
    """``Registry.<method>(*args, **kwargs)`` for the registry listings: read with sqlite3
    when the registry is an embedded SQLite file at the current schema (the listing then
    loads neither pydantic nor SQLAlchemy; see registry/_fast_read.py), else through the
    Registry. Both return the same records and raise the same errors."""
    obj = ctx.find_root().ensure_object(dict)
    if "registry" not in obj:
        from validation_service.registry import _fast_read

        reader = _fast_read.open_reader(obj.get("database_url"), obj.get("namespace"))
        if reader is not None:
            with reader:
                try:
                    return getattr(reader, method)(*args, **kwargs)
                except _fast_read.Unavailable:
                    pass
    return getattr(registry_of(ctx), method)(*args, **kwargs)


def echo_json(value: Any) -> None:
    """Full precision, ISO 8601 UTC times: the HTTP API's JSON (views.py)."""
    echo(json.dumps(value, indent=1, default=str))


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    from validation_service.cli._table import render

    return render(headers, rows)
