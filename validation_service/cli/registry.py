"""`ckval` commands over the registry's aliases, tags, retention and search, and the run
status filter of `ckval runs`. The CLI registers ``COMMANDS`` with ``main.add_command``.

Imports stay light (no Ray, no SQLAlchemy until a command runs): the CLI starts fast.
"""

from __future__ import annotations

import json
from typing import Any

import click

from validation_service.cli._format import echo, inert
from validation_service.cli._table import render
from validation_service.cli.common import registry_of
from validation_service.errors import on_ckval_error
from validation_service.secrets import mask_url

RUN_STATUSES = ("RUNNING", "FINISHED", "FAILED")

# For `ckval runs`: @status_option, then registry.run_summaries(status=status).
status_option = click.option(
    "--status",
    type=click.Choice(RUN_STATUSES, case_sensitive=False),
    default=None,
    help="Only runs in this status.",
)


def run_rows(summaries) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of `ckval runs`, with each run's attempt and end, and what its
    validations held in accelerator-seconds (by pool)."""
    from validation_service.cli._format import format_cost

    headers = ["run", "attempt", "status", "created", "ended", "checkpoints", "validations"]
    headers += ["stop", "accelerator-s (by pool)"]
    rows = [
        [
            s.run.name,
            s.run.attempt,
            s.run.status,
            s.run.created_at,
            s.run.ended_at,
            s.checkpoints,
            " ".join(f"{k}={v}" for k, v in sorted(s.job_counts.items())),
            stop_cell(s.stop),
            format_cost(s.cost),
        ]
        for s in summaries
    ]
    return headers, rows


def stop_cell(decision) -> str:
    """A run's stop decision in a table cell: "patience at report 6", "overridden", or ""."""
    if decision is None:
        return ""
    if not decision.stopped:
        return f"overridden ({decision.rule} at report {decision.report_index})"
    return f"{decision.rule} at report {decision.report_index}"


def _exit_naming(exc) -> None:
    """A ckval error ends the command with its message and exit status 2, as `ckval` does
    (``@errors_reported``, under ``@click.pass_context``: the stop commands use it too)."""
    echo(f"error: {exc}", err=True)
    raise click.exceptions.Exit(2) from None


errors_reported = on_ckval_error(_exit_naming)


def _records_table(records, metrics: list[str]) -> str:
    headers = ["run", "report", "validation", *metrics, "aliases", "tags", "uri"]
    rows = [
        [
            r.run,
            r.report_index,
            r.validation_status,
            *[r.metrics.get(m) for m in metrics],
            ",".join(r.aliases),
            " ".join(f"{k}={v}" for k, v in r.tags.items()),
            r.uri,
        ]
        for r in records
    ]
    return render(headers, rows)


def _print_records(records, as_json: bool, metrics: list[str] | None = None) -> None:
    if as_json:
        from validation_service.api.views import labelled_checkpoint_json

        echo(json.dumps([labelled_checkpoint_json(r) for r in records], indent=1, default=str))
        return
    if metrics is None:
        metrics = []
        for record in records:
            metrics += [name for name in record.metrics if name not in metrics]
    echo(_records_table(records, metrics[:6]))


@click.command("alias")
@click.argument("run")
@click.argument("alias")
@click.argument("report_index", type=int, required=False)
@click.option("--track", is_flag=True, help="Keep ALIAS on the best checkpoint by --metric.")
@click.option("--metric", default=None, help="With --track: the metric to rank by.")
@click.option("--mode", type=click.Choice(["max", "min"]), default="max", show_default=True)
@click.option("--delete", "remove", is_flag=True, help="Remove ALIAS (and its tracking).")
@click.pass_context
@errors_reported
def alias_command(
    ctx: click.Context,
    run: str,
    alias: str,
    report_index: int | None,
    track: bool,
    metric: str | None,
    mode: str,
    remove: bool,
) -> None:
    """Point ALIAS of RUN at checkpoint REPORT_INDEX, keep it on the best (--track), remove
    it (--delete), or show where it points (no REPORT_INDEX)."""
    registry = registry_of(ctx)
    if sum([report_index is not None, track, remove]) > 1:
        raise click.UsageError("give one of REPORT_INDEX, --track or --delete")
    if track:
        if not metric:
            raise click.UsageError("--track needs --metric, e.g. --metric accuracy --mode max")
        index = registry.track_alias(run, alias, metric, mode)
        where = "no checkpoint yet" if index is None else f"report {index}"
        echo(f"{run}:{alias} tracks the {mode} of {metric!r} (now {where})")
    elif remove:
        if not registry.remove_alias(run, alias):
            echo(f"{run} had no alias {alias!r}")
            return
        echo(f"removed {run}:{alias}")
    elif report_index is not None:
        registry.set_alias(run, alias, report_index)
        echo(f"{run}:{alias} -> report {report_index}")
    else:
        _print_records([registry.get_alias_record(run, alias)], as_json=False)


@click.command("tag")
@click.argument("run")
@click.argument("report_index", type=int)
@click.argument("key")
@click.argument("value", required=False)
@click.option("--delete", "remove", is_flag=True, help="Remove the tag KEY.")
@click.pass_context
@errors_reported
def tag_command(
    ctx: click.Context, run: str, report_index: int, key: str, value: str | None, remove: bool
) -> None:
    """Set tag KEY=VALUE on checkpoint REPORT_INDEX of RUN (or remove it with --delete)."""
    if (value is None) != remove:
        raise click.UsageError("give VALUE, or --delete to remove the tag")
    registry_of(ctx).tag(run, report_index, key, None if remove else value)
    echo(
        f"{run}/{report_index}: removed {key}" if remove else f"{run}/{report_index}: {key}={value}"
    )


@click.command("gc")
@click.argument("run", required=False)
@click.option("--metric", required=True, help="Metric that ranks the checkpoints.")
@click.option("--mode", type=click.Choice(["max", "min"]), default="max", show_default=True)
@click.option("--keep-best", default=0, show_default=True, help="Best N across the runs.")
@click.option("--keep-best-per-run", default=1, show_default=True, help="Best N of each run.")
@click.option("--keep-latest", default=1, show_default=True, help="Newest N of each run.")
@click.option("--dry-run", is_flag=True, help="Show what would be deleted; delete nothing.")
@click.option("--yes", is_flag=True, help="Delete without asking.")
@click.option("--save", is_flag=True, help="Also store the policy: the service applies it.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
@errors_reported
def gc_command(
    ctx: click.Context,
    run: str | None,
    metric: str,
    mode: str,
    keep_best: int,
    keep_best_per_run: int,
    keep_latest: int,
    dry_run: bool,
    yes: bool,
    save: bool,
    as_json: bool,
) -> None:
    """Delete the checkpoints of RUN (of every run of the namespace when RUN is left out)
    that no --keep-* rule keeps: those with an alias or a validation in flight and each
    run's latest stay. Files go only from inside a checkpoint's own run folder and never
    from a folder another checkpoint uses; a NO_UPLOAD checkpoint outside the storage
    root keeps its files; one under no storage root of these settings (CKVAL_STORAGE,
    CKVAL_DELETABLE_ROOTS) is kept whole and listed as such."""
    registry = registry_of(ctx)
    rule = {
        "metric": metric,
        "mode": mode,
        "keep_best": keep_best,
        "keep_best_per_run": keep_best_per_run,
        "keep_latest": keep_latest,
    }
    plan = registry.retention_plan(run, **rule)
    going = plan.deleting
    if save:
        registry.set_retention(run, **rule)
        echo(f"stored the retention policy of {run or 'the namespace'}", err=as_json)
    _say_kept_outside(plan.kept_outside, as_json)
    if not going:
        echo("[]" if as_json else "nothing to delete")
        return
    if dry_run:
        _print_records(going, as_json, [metric])
        if not as_json:
            echo(f"{len(going)} checkpoint(s) would be deleted (dry run)")
        return
    if yes or _deletion_confirmed(going, metric):
        deleted = registry.apply_retention(run, **rule)
        if as_json:
            _print_records(deleted, True)
        else:
            echo(f"deleted {len(deleted)} checkpoint(s)")


def _say_kept_outside(records, as_json: bool) -> None:
    """One line per checkpoint gc keeps because it lies outside the configured storage
    (on stderr with --json, whose stdout is the JSON)."""
    from validation_service.registry.retention import KEPT_OUTSIDE

    for record in records:
        shown = f"{record.run}/{record.report_index} at {mask_url(record.uri)}"
        echo(inert(f"{shown}: {KEPT_OUTSIDE}"), err=as_json)


def _deletion_confirmed(going, metric: str) -> bool:
    """Shows what `ckval gc` would delete and asks; says so when the answer is no."""
    _print_records(going, False, [metric])
    if click.confirm(f"Delete these {len(going)} checkpoint(s) and their files?"):
        return True
    echo("nothing deleted")
    return False


@click.command("search")
@click.argument("filter", default="")
@click.option(
    "--order-by", "order_by", multiple=True, help="e.g. 'metrics.accuracy DESC'; repeatable."
)
@click.option("-k", "k", default=100, show_default=True, help="At most this many.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
@errors_reported
def search_command(
    ctx: click.Context, filter: str, order_by: tuple[str, ...], k: int, as_json: bool
) -> None:
    """Checkpoints of every run matching FILTER, MLflow's search grammar:
    "metrics.accuracy > 0.9 and tags.split = 'val' and run LIKE 'bert-%'"."""
    records = registry_of(ctx).search(filter, order_by=list(order_by), k=k)
    _print_records(records, as_json)


COMMANDS: list[click.Command] = [alias_command, tag_command, gc_command, search_command]
