"""`ckval watch`, `ckval watches` and `ckval unwatch`: folders of step folders from any
trainer, registered and validated by the running service (Registry.watch in Python)."""

from __future__ import annotations

from typing import Any

import click

from validation_service.cli._format import echo, format_time
from validation_service.cli.common import echo_json, json_option, registry_of, render_table
from validation_service.cli.evaluations import (
    _command_options,
    _json_object,
    _tell_service,
    _validate_fn,
)


@click.command()
@click.argument("uri")
@click.option("--run", required=True, help="The run its step folders join (made if new).")
@click.option("--validate-fn", default=None, metavar="MODULE:FN", help="The validate_fn.")
@_command_options
@click.option("--validator", default="default", show_default=True, help="The evaluation's name.")
@click.option("--config", default=None, metavar="JSON", help="validate_config, a JSON object.")
@click.option(
    "--ready",
    default="auto",
    show_default=True,
    help="When a step folder is complete: auto, marker:NAME or stable:SECONDS.",
)
@click.option("--pattern", default=None, metavar="GLOB", help="Step folders' names, e.g. 'step-*'.")
@click.option("--copy", is_flag=True, help="Copy each step folder into ckval's storage first.")
@click.option(
    "--resources",
    default=None,
    metavar="JSON",
    help="validation_resources of each step folder's validation, a JSON object, e.g. "
    '\'{"num_gpus": 1, "accelerator_type": "A10G"}\' (its resource pool).',
)
@click.pass_context
def watch(ctx: click.Context, uri: str, **options: Any) -> None:
    """Register and validate each new step folder of URI (a path or any fsspec URI)."""
    validate_fn = _validate_fn(options)
    registry = registry_of(ctx)
    watch_id = registry.watch(
        uri,
        options["run"],
        validate_fn,
        validator=options["validator"],
        validate_config=_json_object(options["config"], "--config"),
        ready=options["ready"],
        pattern=options["pattern"],
        copy=options["copy"],
        validation_resources=_json_object(options["resources"], "--resources"),
    )
    echo(
        f"watch {watch_id}: the service lists {uri} every "
        f"{registry.settings.watch_interval_s:g} s and registers each complete step folder "
        f"into run {options['run']!r} (`ckval watches` shows them, `ckval unwatch "
        f"{watch_id}` ends it)"
    )
    _tell_service(registry.settings, waiting="nothing is listed or registered")


@click.command()
@click.argument("run", required=False)
@json_option
@click.pass_context
def watches(ctx: click.Context, run: str | None, as_json: bool) -> None:
    """The live watches (of RUN): step folders registered, and those waiting since when."""
    found = registry_of(ctx).watches(run)
    if as_json:
        echo_json([_as_dict(record) for record in found])
        return
    if not found:
        echo("no watches" + (f" of run {run!r}" if run else ""))
        return
    rows = [
        [
            record.id,
            record.run,
            record.uri,
            record.validator,
            record.ready + (" copy" if record.copy else ""),
            record.registered,
            _waiting(record),
            format_time(record.last_listed_at) if record.last_listed_at else "never",
        ]
        for record in found
    ]
    headers = ["ID", "RUN", "FOLDER", "VALIDATOR", "READY", "REGISTERED", "WAITING", "LISTED"]
    echo(render_table(headers, rows))
    for record in found:
        if record.last_error:
            echo(f"watch {record.id}: {record.last_error}")


def _waiting(record) -> str:
    shown = [f"{w.name} since {format_time(w.since)}" for w in record.waiting[:3]]
    more = len(record.waiting) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "") or "-"


def _as_dict(record) -> dict[str, Any]:
    import dataclasses

    data = dataclasses.asdict(record)
    data["waiting"] = [dataclasses.asdict(w) for w in record.waiting]
    return data


@click.command()
@click.argument("watch_id", type=int)
@click.pass_context
def unwatch(ctx: click.Context, watch_id: int) -> None:
    """End watch WATCH_ID (what it registered stays)."""
    registry_of(ctx).unwatch(watch_id)
    echo(f"watch {watch_id} ended; the checkpoints it registered stay")


COMMANDS: list[click.Command] = [watch, watches, unwatch]
