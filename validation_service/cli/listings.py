"""`ckval runs`, `ckval checkpoints` and `ckval best`: the registry listings, read with
sqlite3 alone from an embedded SQLite registry (cli_common.read_listing)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

from validation_service.cli._format import echo
from validation_service.cli.common import (
    echo_json,
    json_option,
    list_best_checkpoints,
    list_checkpoints,
    list_run_summaries,
    list_validation_costs,
    registry_of,
    render_table,
)
from validation_service.cli.registry import run_rows, status_option

if TYPE_CHECKING:
    from validation_service.registry.records import CheckpointRecord, ValidationCost


def _run_tags(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> dict[str, str]:
    tags = {}
    for value in values:
        key, sep, wanted = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r} is no KEY=VALUE, e.g. tune_experiment=search-1")
        tags[key] = wanted
    return tags


@click.command()
@status_option
@click.option(
    "--tag",
    "tags",
    multiple=True,
    metavar="KEY=VALUE",
    callback=_run_tags,
    help="Only runs with this run tag (repeatable), e.g. tune_experiment=NAME: the trials "
    "of one Ray Tune search side by side, with their tags shown.",
)
@json_option
@click.pass_context
def runs(ctx: click.Context, status: str | None, tags: dict[str, str], as_json: bool) -> None:
    """List runs (each attempt of a run name) with their checkpoint and validation counts."""
    summaries = list_run_summaries(ctx, status)
    if tags:
        summaries = [
            s
            for s in summaries
            if all(str(s.run.tags.get(key)) == value for key, value in tags.items())
        ]
    if as_json:
        from validation_service.api.views import run_json

        echo_json([run_json(summary) for summary in summaries])
        return
    headers, rows = run_rows(summaries)
    if tags:  # a search side by side: which trial each run is
        headers = [*headers, "tags"]
        for row, summary in zip(rows, summaries, strict=True):
            row.append(" ".join(f"{k}={v}" for k, v in sorted(summary.run.tags.items())))
    echo(render_table(headers, rows))


validator_option = click.option(
    "--validator",
    default=None,
    metavar="NAME",
    help="Show (rank by) the metrics of this named evaluation (`ckval revalidate`); "
    "default: report()'s own, merged with the reported metrics.",
)


@click.command()
@click.argument("run")
@validator_option
@json_option
@click.pass_context
def checkpoints(ctx: click.Context, run: str, validator: str | None, as_json: bool) -> None:
    """List the checkpoints of RUN with their merged metrics (or one validator's), and
    what their validations held in accelerator-seconds."""
    records = list_checkpoints(ctx, run)
    if as_json:
        _echo_checkpoints_json(records)
        return
    costs = list_validation_costs(ctx, run)
    echo(_checkpoint_table(records, validator=validator, costs=costs))
    if costs:
        echo(_cost_lines(run, costs))


@click.command()
@click.argument("run", required=False)
@click.option("--metric", required=True, help="Metric to rank by.")
@click.option(
    "--mode",
    type=click.Choice(["max", "min"]),
    default=None,
    help="max: highest first; min: lowest first (a loss or an error).  [default: max]",
)
@click.option("-k", "k", default=1, show_default=True, type=click.IntRange(min=1))
@validator_option
@json_option
@click.pass_context
def best(
    ctx: click.Context,
    run: str | None,
    metric: str,
    mode: str | None,
    k: int,
    validator: str | None,
    as_json: bool,
) -> None:
    """The best K checkpoints of RUN (of all runs when RUN is left out) by a metric."""
    from validation_service.metrics import lower_is_better

    if validator is None:
        records = list_best_checkpoints(ctx, run, metric, mode or "max", k)
    else:
        records = registry_of(ctx).best_checkpoint_records(
            run, metric, mode or "max", k, validator=validator
        )
    if mode is None and lower_is_better(metric):
        echo(
            f"warning: --mode defaulted to max, so the highest {metric!r} comes first, but "
            f"{metric!r} reads like a metric where lower is better: pass --mode min for the "
            "lowest (--mode max silences this warning).",
            err=True,
        )
    if as_json:
        _echo_checkpoints_json(records)
        return
    others = [m for m in _metric_columns(records, validator) if m != metric]
    table = _checkpoint_table(records, [metric, *others][:6], run is None, validator)
    echo(table)


def _echo_checkpoints_json(records: Sequence[CheckpointRecord]) -> None:
    from validation_service.api.views import checkpoint_json

    echo_json([checkpoint_json(record) for record in records])


def _shown_metrics(record: CheckpointRecord, validator: str | None) -> dict:
    """The record's merged metrics, or ``validator``'s (empty where it has none)."""
    return record.metrics if validator is None else record.evaluations.get(validator, {})


def _metric_columns(
    records: Sequence[CheckpointRecord], validator: str | None = None, limit: int = 6
) -> list[str]:
    names: list[str] = []
    for record in records:
        for name in _shown_metrics(record, validator):
            if name not in names:
                names.append(name)
    return names[:limit]


def _checkpoint_table(
    records: Sequence[CheckpointRecord],
    metrics: list[str] | None = None,
    with_run: bool = False,
    validator: str | None = None,
    costs: dict[int, ValidationCost] | None = None,
) -> str:
    from validation_service.cli._format import format_cost, format_size

    metrics = metrics or _metric_columns(records, validator)
    headers = ["#", *(["run"] if with_run else []), "report", "validation", *metrics, "size"]
    headers += [*(["accelerator-s"] if costs else []), "uri"]
    rows = [
        [
            i + 1,
            *([r.run] if with_run else []),
            r.report_index,
            r.validation_status,
            *[_shown_metrics(r, validator).get(m) for m in metrics],
            format_size(r.size_bytes),
            *([format_cost(costs.get(r.report_index), "validator")] if costs else []),
            r.uri,
        ]
        for i, r in enumerate(records)
    ]
    return render_table(headers, rows)


def _cost_lines(run: str, costs: dict[int, ValidationCost]) -> str:
    """What the run's validations held: accelerator-seconds in all, by validator, pool and
    accelerator type (every checkpoint's, deleted ones' too)."""
    from validation_service.cli._format import format_float
    from validation_service.registry.records import ValidationCost

    cost = ValidationCost(tuple(line for each in costs.values() for line in each.lines))
    lines = [
        f"\nvalidation cost of {run}: {format_float(cost.accelerator_s)} accelerator-seconds "
        f"({format_float(cost.accelerator_s / 3600)} h), {format_float(cost.running_s)} s "
        "running"
    ]
    for key, title in (("validator", "validator"), ("pool", "pool"), ("accelerator_type", "type")):
        parts = [f"{name} {format_float(value)}" for name, value in cost.by(key).items()]
        lines.append(f"  by {title}: {', '.join(parts)}")
    return "\n".join(lines)


COMMANDS: list[click.Command] = [runs, checkpoints, best]
