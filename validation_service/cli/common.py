"""What every `ckval` command module shares: the exit statuses, the invocation's settings
and registry (--database-url, --namespace), the listings' fast read, JSON and tables.

Imports stay light (click and nothing heavy): the CLI starts fast.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

from validation_service.cli._format import echo

if TYPE_CHECKING:
    from validation_service.config import Settings
    from validation_service.registry._fast_read import FastReader
    from validation_service.registry.records import (
        CheckpointRecord,
        JobRecord,
        RunSummary,
        ValidationCost,
    )
    from validation_service.registry.registry import Registry

T = TypeVar("T")

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


def read_listing(
    ctx: click.Context, fast: Callable[[FastReader], T], slow: Callable[[Registry], T]
) -> T:
    """``fast(reader)`` with sqlite3 when the registry is an embedded SQLite file at the
    current schema (the listing then loads neither pydantic nor SQLAlchemy; see
    registry/_fast_read.py), else ``slow(registry)``. Both return the same records and
    raise the same errors."""
    obj = ctx.find_root().ensure_object(dict)
    if "registry" not in obj:
        from validation_service.registry import _fast_read

        reader = _fast_read.open_reader(obj.get("database_url"), obj.get("namespace"))
        if reader is not None:
            with reader:
                try:
                    return fast(reader)
                except _fast_read.Unavailable:
                    pass
    return slow(registry_of(ctx))


def list_run_summaries(ctx: click.Context, status: str | None) -> list[RunSummary]:
    """`ckval runs`: FastReader.run_summaries, else Registry.run_summaries."""
    return read_listing(
        ctx,
        lambda reader: reader.run_summaries(status=status),
        lambda registry: registry.run_summaries(status=status),
    )


def list_checkpoints(ctx: click.Context, run: str) -> list[CheckpointRecord]:
    """`ckval checkpoints RUN`: FastReader.checkpoints, else Registry.checkpoints."""
    return read_listing(
        ctx, lambda reader: reader.checkpoints(run), lambda registry: registry.checkpoints(run)
    )


def list_validation_costs(ctx: click.Context, run: str) -> dict[int, ValidationCost]:
    """`ckval checkpoints RUN`'s costs: FastReader.validation_costs, else
    Registry.validation_costs."""
    return read_listing(
        ctx,
        lambda reader: reader.validation_costs(run),
        lambda registry: registry.validation_costs(run),
    )


def list_best_checkpoints(
    ctx: click.Context, run: str | None, metric: str, mode: str, k: int
) -> list[CheckpointRecord]:
    """`ckval best`: FastReader.best_checkpoint_records, else
    Registry.best_checkpoint_records."""
    return read_listing(
        ctx,
        lambda reader: reader.best_checkpoint_records(run, metric, mode, k),
        lambda registry: registry.best_checkpoint_records(run, metric, mode, k),
    )


def list_jobs(
    ctx: click.Context,
    run: str | None,
    *,
    statuses: list[str] | None,
    pool: str | None,
    limit: int | None,
) -> list[JobRecord]:
    """`ckval jobs`: FastReader.list_jobs, else Registry.list_jobs."""
    return read_listing(
        ctx,
        lambda reader: reader.list_jobs(run, statuses=statuses, pool=pool, limit=limit),
        lambda registry: registry.list_jobs(run, statuses=statuses, pool=pool, limit=limit),
    )


def echo_json(value: Any) -> None:
    """Full precision, ISO 8601 UTC times: the HTTP API's JSON (views.py)."""
    echo(json.dumps(value, indent=1, default=str))


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    from validation_service.cli._table import render

    return render(headers, rows)
