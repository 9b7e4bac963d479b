"""`ckval revalidate` and `ckval register`: evaluations over stored checkpoints from a
shell (registry/evaluations.py does the work; Registry.revalidate is its Python form)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from typing import Any

import click

from validation_service.cli._format import echo
from validation_service.cli.common import EXIT_FAILURE, registry_of


def _report_indices(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: give report indices separated by commas, e.g. 0,3,7"
        ) from None


def _json_object(value: str | None, option: str) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        found = json.loads(value)
    except json.JSONDecodeError as exc:
        message = f"{option} is no JSON ({exc}): give an object, e.g. '{{}}'"
        raise click.BadParameter(message) from None
    if not isinstance(found, dict):
        raise click.BadParameter(f"{option} must be a JSON object, got {value!r}")
    return found


def _validate_fn(options: dict[str, Any]):
    validate_fn, command = options["validate_fn"], options["command"]
    if (validate_fn is None) == (command is None):
        raise click.UsageError("give one of --validate-fn module:fn or --command 'PROGRAM ARGS'")
    if command is None:
        if options["timeout_s"] is not None or options["env"]:
            raise click.UsageError("--timeout and --env apply to --command only")
        return validate_fn
    from validation_service.validators.command import CommandValidator

    env = dict(_assignment(item) for item in options["env"])
    return CommandValidator(shlex.split(command), env=env, timeout_s=options["timeout_s"])


def _assignment(item: str) -> tuple[str, str]:
    name, equals, value = item.partition("=")
    if not equals or not name:
        raise click.BadParameter(f"{item!r}: give --env NAME=VALUE", param_hint="--env")
    return name, value


def _command_options(command: Callable) -> Callable:
    """--command and its --timeout and --env."""
    options = [
        click.option(
            "--command",
            default=None,
            help="An outside program instead, e.g. 'python eval.py {checkpoint_dir} "
            "{result_path}' (placeholders: {checkpoint_dir} {output_dir} {step} "
            "{result_path}). It runs without CKVAL_* variables or the node's secrets: "
            "give it what it needs with --env.",
        ),
        click.option(
            "--timeout", "timeout_s", type=float, default=None, help="--command's time limit."
        ),
        click.option(
            "--env",
            multiple=True,
            metavar="NAME=VALUE",
            help="A variable of --command's environment (stored with the job, in clear); "
            "repeatable.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@click.command()
@click.argument("runs", nargs=-1)
@click.option(
    "--validator",
    required=True,
    help="Name of this evaluation; never 'default' (report()'s own validation, refused).",
)
@click.option("--validate-fn", default=None, metavar="MODULE:FN", help="The validate_fn.")
@_command_options
@click.option("--config", default=None, metavar="JSON", help="validate_config, a JSON object.")
@click.option("--reports", default=None, metavar="0,3,7", help="Only these report indices.")
@click.option("--filter", "filter_", default=None, metavar="EXPR", help="Only what search finds.")
@click.option("--force", is_flag=True, help="Queue even where this validator ran before.")
@click.option("--priority", type=int, default=0, show_default=True)
@click.option("--wait", is_flag=True, help="Wait for the jobs, with a progress line.")
@click.option("--wait-timeout", type=float, default=3600.0, show_default=True)
@click.pass_context
def revalidate(ctx: click.Context, runs: tuple[str, ...], **options: Any) -> None:
    """Queue a named evaluation for the stored checkpoints of RUNS (or of --filter's)."""
    from validation_service.registry import evaluations

    validate_fn = _validate_fn(options)
    if not runs and options["filter_"] is None:
        raise click.UsageError("give RUN names, --filter EXPR, or both")
    reports = _report_indices(options["reports"])
    registry = registry_of(ctx)
    targets: Any = list(runs)
    if options["filter_"] is not None:
        from validation_service.registry.search import MAX_K

        found = registry.search(options["filter_"], k=MAX_K)
        targets = [record for record in found if not runs or record.run in runs]
        if not targets:
            echo(f"no checkpoint matches --filter {options['filter_']!r}: nothing queued")
            return
    request = evaluations.evaluation_request(
        validate_fn,
        _json_object(options["config"], "--config"),
        None,
        options["validator"],
        options["priority"],
    )
    done = evaluations.revalidate(
        registry, targets, request, reports=reports, force=options["force"]
    )
    _echo_queued(options["validator"], done)
    if done.job_ids:
        _tell_service(registry.settings)
    if options["wait"] and done.job_ids:
        _wait(registry, options["validator"], done.job_ids, options["wait_timeout"])


def _echo_queued(validator: str, done) -> None:
    echo(f"queued {len(done.job_ids)} job(s) of validator {validator!r}")
    if done.already:
        echo(
            f"skipped {len(done.already)} checkpoint(s) this validator has a queued, running "
            "or succeeded job for (--force queues them again)"
        )
    if done.deleted:
        shown = ", ".join(f"{run} #{index}" for run, index in done.deleted[:20])
        echo(f"skipped {len(done.deleted)} deleted checkpoint(s): {shown}")


def _tell_service(settings, waiting: str = "the jobs stay QUEUED") -> None:
    """Wakes the running service for the new jobs, or says that none runs to take them
    (and what ``waiting`` for one means)."""
    from validation_service.cli.service import find_service
    from validation_service.errors import RayClusterNotFound

    try:
        handle, address = find_service(settings)
    except RayClusterNotFound as exc:
        problem = exc.reason
    else:
        if handle is not None:
            handle.nudge()
            return
        problem = f"none on the Ray cluster at {address}"
    echo(
        f"warning: no ckval service is running ({problem}): {waiting} until one runs "
        "(`ckval serve`)",
        err=True,
    )


def _wait(registry, validator: str, job_ids: list[int], timeout_s: float) -> None:
    from validation_service.registry.waiting import wait_for_jobs

    counts = wait_for_jobs(registry, job_ids, validator, timeout_s, 0.5, True)
    shown = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
    echo(f"validator {validator!r}: {shown}")
    failed = sum(counts.get(status, 0) for status in ("FAILED", "TIMED_OUT", "CANCELLED"))
    if failed:
        echo(f"{failed} job(s) did not succeed: `ckval job N --log` shows why", err=True)
        raise click.exceptions.Exit(EXIT_FAILURE)


@click.command()
@click.argument("run")
@click.argument("path_or_uri")
@click.option("--metrics", default=None, metavar="JSON", help="Its known metrics, JSON.")
@click.option("--step", type=int, default=None, help="The training step it was saved at.")
@click.pass_context
def register(
    ctx: click.Context, run: str, path_or_uri: str, metrics: str | None, step: int | None
) -> None:
    """Add an existing checkpoint folder to RUN without copying it (never deleted by gc).

    Inside ckval's storage root only a folder in RUN's own folder may be added; a folder
    holding the root or CKVAL_HOME, and system folders, are refused. A URI may carry no
    credentials: give them in CKVAL_STORAGE_OPTIONS."""
    index = registry_of(ctx).register(
        run, path_or_uri, metrics=_json_object(metrics, "--metrics"), step=step
    )
    echo(
        f"registered {path_or_uri} as report {index} of run {run!r}; evaluate it with "
        f"`ckval revalidate {run} --reports {index} --validator NAME ...`"
    )


COMMANDS: list[click.Command] = [revalidate, register]
