"""`ckval jobs` (with --watch), `ckval job`, `ckval cancel` and `ckval retry`: the
validation jobs of the registry's queue."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import click

from validation_service.cli._format import echo
from validation_service.cli.common import (
    echo_json,
    json_option,
    list_jobs,
    registry_of,
    render_table,
    settings_of,
)
from validation_service.cli.service import find_service
from validation_service.jobs import ACTIVE_JOB_STATUSES, JobStatus

if TYPE_CHECKING:
    from validation_service.config import Settings
    from validation_service.registry.records import JobRecord

# A listing of the whole queue shows this many jobs unless --limit says otherwise.
DEFAULT_QUEUE_LIMIT = 100
_ACTIVE = frozenset(s.value for s in ACTIVE_JOB_STATUSES)


@click.command()
@click.argument("run", required=False)
@click.option(
    "--status",
    "statuses",
    multiple=True,
    callback=lambda ctx, param, values: _job_statuses(values),
    metavar="STATUS",
    help="Only jobs in this status: QUEUED, RUNNING, WAITING_FOR_RESOURCES, SUCCEEDED, "
    "FAILED, TIMED_OUT or CANCELLED (repeatable).",
)
@click.option("--pool", default=None, help="Only jobs of this resource pool, e.g. A10G.")
@click.option(
    "--limit",
    # One more than the limit is read, and a row count is a 64-bit integer.
    type=click.IntRange(min=1, max=2**63 - 2),
    default=None,
    help=f"Show the newest N jobs  [default: all of RUN; {DEFAULT_QUEUE_LIMIT} of the queue]",
)
@json_option
@click.option(
    "--watch",
    is_flag=True,
    help="Refresh until no job is QUEUED, RUNNING or WAITING_FOR_RESOURCES (Ctrl-C stops).",
)
@click.option(
    "--interval", default=1.0, show_default=True, type=click.FloatRange(min=0.1), hidden=True
)
@click.pass_context
def jobs(
    ctx: click.Context,
    run: str | None,
    statuses: tuple[str, ...],
    pool: str | None,
    limit: int | None,
    as_json: bool,
    watch: bool,
    interval: float,
) -> None:
    """List validation jobs: of RUN, or of the whole queue when RUN is left out.

    Each row shows the job's status, attempts, pool, node, and its error or wait.
    """
    if watch and as_json:
        raise click.UsageError("--watch redraws a table; leave out --json")
    if limit is None and run is None:
        limit = DEFAULT_QUEUE_LIMIT
    query = _jobs_query(ctx, run, list(statuses) or None, pool, limit)
    if watch:
        _watch_jobs(ctx, query, with_run=run is None, interval=interval)
        return
    found, more = query()
    if as_json:
        from validation_service.api.views import job_json

        echo_json([job_json(job) for job in found])
    else:
        echo(_jobs_table(found, with_run=run is None))
    if more:
        echo(f"(the newest {limit} jobs; --limit N shows more)", err=True)


def _jobs_query(
    ctx: click.Context,
    run: str | None,
    statuses: list[str] | None,
    pool: str | None,
    limit: int | None,
) -> Callable[[], tuple[list[JobRecord], bool]]:
    """The listing of `ckval jobs` as a query to run (again, when watching): the newest
    ``limit`` jobs, and whether there were more."""

    def query() -> tuple[list[JobRecord], bool]:
        found = list_jobs(
            ctx,
            run,
            statuses=statuses,
            pool=pool,
            limit=None if limit is None else limit + 1,
        )
        more = limit is not None and len(found) > limit
        return (found[1:] if more else found), more

    return query


def _job_statuses(values: tuple[str, ...]) -> tuple[str, ...]:
    names = [status.value for status in JobStatus]
    for value in values:
        if value.upper() not in names:
            raise click.BadParameter(f"{value!r} is not a job status: use {', '.join(names)}")
    return tuple(value.upper() for value in values)


def _jobs_table(found: Sequence[JobRecord], *, with_run: bool) -> str:
    from validation_service.cli._format import short_node_id

    rows = []
    for job in found:
        node = next((a.node_id for a in reversed(job.attempt_history) if a.node_id), None)
        error = f"{job.error_type}: {job.error_message}" if job.error_type else waits_for(job)
        rows.append(
            [
                job.id,
                *([job.run] if with_run else []),
                job.report_index,
                job.status,
                f"{job.attempts}/{job.max_attempts}",
                job.pool,
                short_node_id(node),
                job.validate_fn_name,
                error[:100],
            ]
        )
    headers = ["job", *(["run"] if with_run else []), "report", "status", "attempts", "pool"]
    return render_table([*headers, "node", "validate_fn", "error or wait"], rows)


def waits_for(job: JobRecord) -> str:
    """What a job WAITING_FOR_RESOURCES waits for, since when: "waiting 2m 3s for
    {GPU: 1, accelerator_type:A10G}: the autoscaler can add a node of type a10g"."""
    if job.waiting_for is None:
        return ""
    import datetime as dt

    resources = job.waiting_for.get("resources") or {}
    asked = ", ".join(
        name if name.startswith("accelerator_type:") else f"{name}: {value:g}"
        for name, value in sorted(resources.items())
    )
    since = ""
    if job.waiting_since is not None:
        seconds = int((dt.datetime.now(dt.timezone.utc) - job.waiting_since).total_seconds())
        since = f" {seconds // 60}m {seconds % 60}s" if seconds >= 60 else f" {max(seconds, 0)}s"
    note = job.waiting_for.get("note")
    return f"waiting{since} for {{{asked}}}" + (f": {note}" if note else "")


def _watch_jobs(
    ctx: click.Context,
    query: Callable[[], tuple[list[JobRecord], bool]],
    *,
    with_run: bool,
    interval: float,
) -> None:
    """Redraws the table every ``interval`` seconds on a terminal; elsewhere prints the
    table once, then one line per status change. Ends when no listed job is QUEUED or
    RUNNING, or at Ctrl-C (exit status 0 either way)."""
    import datetime as dt

    from validation_service.cli._format import format_mapping, format_time

    tty = sys.stdout.isatty()
    seen: dict[int, str] | None = None  # job id -> status at the last look
    note: str | None = None
    try:
        while True:
            found, _ = query()
            active = [job for job in found if job.status in _ACTIVE]
            now = format_time(dt.datetime.now(dt.timezone.utc))
            if tty:
                click.clear()
                echo(_jobs_table(found, with_run=with_run))
                echo(f"\n{now}  {len(active)} QUEUED, RUNNING or WAITING; Ctrl-C stops watching")
                if note:
                    echo(note, err=True)
            elif seen is None:
                echo(_jobs_table(found, with_run=with_run))
            else:
                for job in found:
                    if seen.get(job.id) != job.status:
                        echo(f"{now}  {_status_change(job, seen.get(job.id, 'new'))}")
            first_look = seen is None
            seen = {job.id: job.status for job in found}
            if not active:
                counts: dict[str, int] = {}
                for job in found:
                    counts[job.status] = counts.get(job.status, 0) + 1
                echo(
                    f"no job is QUEUED, RUNNING or WAITING_FOR_RESOURCES: {format_mapping(counts)}"
                )
                return
            if first_look:
                # Only now, with jobs waiting: connecting to Ray takes a second or two.
                note = _missing_service_note(settings_of(ctx))
                if note:
                    echo(note, err=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        echo("")


def _status_change(job: JobRecord, was: str) -> str:
    error = f" ({job.error_type}: {job.error_message})" if job.error_type else ""
    where = f"{job.run} report {job.report_index}"
    return f"job {job.id} ({where}): {was} -> {job.status}{error}"


def _missing_service_note(settings: Settings) -> str | None:
    """Why QUEUED jobs may not move: no service runs (None when one does)."""
    from validation_service.errors import RayClusterNotFound

    try:
        handle, address = find_service(settings)
    except RayClusterNotFound as exc:
        return (
            f"warning: no ckval service is running ({exc.reason}): QUEUED jobs wait for "
            "one (`ckval serve`)"
        )
    except Exception as exc:  # noqa: BLE001 - the listing goes on without the note
        return f"warning: could not look for the ckval service: {exc}"
    if handle is None:
        return (
            f"warning: no ckval service is running on the Ray cluster at {address}: "
            "QUEUED jobs wait for one (`ckval serve`)"
        )
    return None


@click.command()
@click.argument("job_id", type=int)
@json_option
@click.option("--log", "show_log", is_flag=True, help="Print what each attempt kept as its log.")
@click.pass_context
def job(ctx: click.Context, job_id: int, as_json: bool, show_log: bool) -> None:
    """Show one validation job, its attempts and its stored traceback."""
    from validation_service.cli._format import format_value

    registry = registry_of(ctx)
    record = registry.get_job(job_id, namespace=registry.namespace)
    if show_log and not as_json:
        _echo_logs(record)
        return
    if as_json:
        from validation_service.api.views import job_json

        echo_json(job_json(record))
        return
    fields = {
        "id": record.id,
        "run": record.run,
        "report_index": record.report_index,
        "validator": record.validator,
        "status": record.status,
        "attempts": f"{record.attempts}/{record.max_attempts}",
        "pool": record.pool,
        "resources": record.resources,
        "validate_fn": record.validate_fn_name,
        "priority": record.priority,
        "timeout_s": record.timeout_s,
        "created_at": record.created_at,
        "started_at": record.started_at,
        "finished_at": record.finished_at,
        "waiting": waits_for(record) or None,
        "result_metrics": record.result_metrics,
        "error_type": record.error_type,
        "error_message": record.error_message,
    }
    for name, value in fields.items():
        echo(f"{name:15} {format_value(value)}")
    echo("")
    echo(_attempts_table(record))
    for warning in record.warnings:
        echo(f"\nwarning: {warning}")
    if record.error_traceback:
        echo("\ntraceback:\n" + record.error_traceback)


def _attempts_table(record: JobRecord) -> str:
    """A job's attempts: where and when each ran, what it held, how it ended."""
    from validation_service.cli._format import short_node_id

    rows = [
        [
            a.attempt,
            a.status,
            short_node_id(a.node_id),
            a.worker_pid,
            a.started_at,
            a.finished_at,
            a.running_s,
            _held(a),
            (a.error_message or "")[:80],
        ]
        for a in record.attempt_history
    ]
    headers = ["attempt", "status", "node", "pid", "started", "finished", "running-s", "held"]
    return render_table([*headers, "error"], rows)


def _held(attempt) -> str:
    """What an attempt held: "1 x A10G, 63.2 accelerator-s"; "" where unknown."""
    if attempt.running_s is None:
        return ""
    from validation_service.cli._format import format_float

    kind = f" x {attempt.accelerator_type}" if attempt.accelerator_type else " accelerators"
    return (
        f"{format_float(attempt.accelerators or 0.0)}{kind}, "
        f"{format_float(attempt.accelerator_s or 0.0)} accelerator-s"
    )


def _echo_logs(record) -> None:
    """Each attempt's kept output (a CommandValidator's program's stdout and stderr)."""
    kept = [a for a in record.attempt_history if a.log]
    if not kept:
        echo(
            f"job {record.id} kept no log: only validators that keep their output (such as "
            "CommandValidator) store one; see `ckval job N` for its error and traceback."
        )
    for attempt in kept:
        echo(f"=== attempt {attempt.attempt} ({attempt.status}) ===")
        echo(attempt.log.rstrip("\n"))


@click.command()
@click.argument("job_ids", type=int, nargs=-1)
@click.option("--run", default=None, help="Cancel every queued or running job of this run.")
@click.pass_context
def cancel(ctx: click.Context, job_ids: tuple[int, ...], run: str | None) -> None:
    """Cancel validation jobs (queued ones never start)."""
    if not job_ids and not run:
        raise click.UsageError("give JOB ids or --run RUN")
    from validation_service.api.views import tell_service

    done = registry_of(ctx).cancel_jobs(_known_jobs(ctx, job_ids), run=run)
    echo(f"cancelled {len(done)} job(s): {done}")
    if done:
        _say_if_untold(tell_service(registry_of(ctx).settings, "check_leases", connect=True))


@click.command()
@click.argument("job_ids", type=int, nargs=-1)
@click.option("--run", default=None, help="Requeue the jobs of this run.")
@click.option("--failed", is_flag=True, help="Only FAILED and TIMED_OUT jobs, not CANCELLED ones.")
@click.pass_context
def retry(ctx: click.Context, job_ids: tuple[int, ...], run: str | None, failed: bool) -> None:
    """Requeue FAILED, TIMED_OUT and CANCELLED validation jobs."""
    if not job_ids and not run:
        raise click.UsageError("give JOB ids or --run RUN")
    statuses = [JobStatus.FAILED, JobStatus.TIMED_OUT]
    if not failed:
        statuses.append(JobStatus.CANCELLED)
    from validation_service.api.views import tell_service

    done = registry_of(ctx).retry_jobs(_known_jobs(ctx, job_ids), run=run, statuses=statuses)
    echo(f"requeued {len(done)} job(s): {done}")
    if done:
        _say_if_untold(tell_service(registry_of(ctx).settings, "nudge", connect=True))


def _known_jobs(ctx: click.Context, job_ids: tuple[int, ...]) -> list[int] | None:
    """The job ids given, each checked to exist in this namespace (as the HTTP API
    checks): an unknown one, or another namespace's, is an error naming it."""
    registry = registry_of(ctx)
    for job_id in job_ids:
        registry.get_job(job_id, namespace=registry.namespace)  # raises JobNotFound
    return list(job_ids) or None


def _say_if_untold(problem: str | None) -> None:
    """The registry changed; says so when the running service could not be told."""
    if problem:
        echo(
            f"the change is in the registry, but the ckval service could not be told "
            f"({problem}): it picks the change up at its next poll or lease check",
            err=True,
        )


COMMANDS: list[click.Command] = [jobs, job, cancel, retry]
