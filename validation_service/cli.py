"""`ckval` command line: the registry, the service and the demo from a shell.

Importing this module loads click and nothing heavy, so that `ckval --help` and the
registry listings start fast: every command imports what it uses (SQLAlchemy for the
registry, Ray only to reach the service); the listings (runs, checkpoints, best, jobs)
read an embedded SQLite registry with sqlite3 alone (registry/_fast_read.py). Commands
defined in another module join with one line, ``main.add_command(command)``, and follow
the same rule.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

from validation_service.cli_registry import COMMANDS as REGISTRY_COMMANDS
from validation_service.cli_registry import run_rows, status_option
from validation_service.dashboard.cli import ui_command
from validation_service.jobs import ACTIVE_JOB_STATUSES, JobStatus

if TYPE_CHECKING:
    from validation_service.config import Settings
    from validation_service.registry.records import CheckpointRecord, JobRecord
    from validation_service.registry.registry import Registry
    from validation_service.service import ServiceHandle

# Exit statuses: the same situation ends with the same one in every command.
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NOT_RUNNING = 3

EPILOG = """\b
Exit status:
  0  done; `status`: the service is running; `stop`: it was stopped
  1  another failure (the registry database is unreachable, ...)
  2  bad usage or input (an unknown run, metric, job or option)
  3  `status`, `stop`: no ckval service is running (nothing is started)
"""

# A listing of the whole queue shows this many jobs unless --limit says otherwise.
DEFAULT_QUEUE_LIMIT = 100
_ACTIVE = frozenset(s.value for s in ACTIVE_JOB_STATUSES)


def get_settings(**overrides: Any) -> Settings:
    """The configured Settings with the given overrides (loads pydantic on first use)."""
    from validation_service.config import get_settings as configured

    return configured(**overrides)


def _settings(ctx: click.Context) -> Settings:
    obj = ctx.find_root().obj or {}
    return get_settings(database_url=obj.get("database_url"), namespace=obj.get("namespace"))


def _registry(ctx: click.Context) -> Registry:
    """The registry of this invocation (--database-url, --namespace), opened once."""
    from validation_service.registry.registry import Registry

    obj = ctx.find_root().ensure_object(dict)
    if "registry" not in obj:
        obj["registry"] = Registry(settings=_settings(ctx))
    return obj["registry"]


def _listing(ctx: click.Context, method: str, *args: Any, **kwargs: Any) -> Any:
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
    return getattr(_registry(ctx), method)(*args, **kwargs)


def _echo_json(value: Any) -> None:
    """Full precision, ISO 8601 UTC times: the HTTP API's JSON (views.py)."""
    click.echo(json.dumps(value, indent=1, default=str))


def _render(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    from validation_service._table import render

    return render(headers, rows)


def _exit_code(exc: BaseException) -> int | None:
    """The exit status for an error ckval raised on purpose; None for anything else."""
    errors = sys.modules.get("validation_service.errors")
    if errors is None or not isinstance(exc, errors.CkvalError):
        return None  # not loaded: nothing could have raised one of its errors
    if isinstance(exc, errors.RayClusterNotFound):
        return EXIT_NOT_RUNNING
    # RegistryUnavailable exists once something made one (see errors.py).
    unavailable = vars(errors).get("RegistryUnavailable")
    if unavailable is not None and isinstance(exc, unavailable):
        return EXIT_FAILURE
    return EXIT_USAGE


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            code = _exit_code(exc)
            if code is None:
                raise
            click.echo(f"error: {exc}", err=True)
            sys.exit(code)


@click.group(cls=_Group, epilog=EPILOG)
@click.option("--database-url", envvar="CKVAL_DATABASE_URL", help="Registry database URL.")
@click.option("--namespace", envvar="CKVAL_NAMESPACE", help="Run namespace.")
@click.pass_context
def main(ctx: click.Context, database_url: str | None, namespace: str | None) -> None:
    """ckval: asynchronous checkpoint validation for Ray Train."""
    ctx.ensure_object(dict).update(database_url=database_url, namespace=namespace)


_json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print JSON (full precision, UTC times)."
)


@main.command()
@click.option("--epochs", default=5, show_default=True)
@click.option("--workers", default=2, show_default=True)
@click.option("--run", "run_name", default=None, help="Run name (default: ckval-demo-<time>).")
def demo(epochs: int, workers: int, run_name: str | None) -> None:
    """Train a small model with TorchTrainer, validate every epoch, print the best."""
    from validation_service.demo import run_demo

    run_demo(epochs=epochs, num_workers=workers, run_name=run_name)


# ------------------------------------------------------------------ registry listings
@main.command()
@status_option
@_json_option
@click.pass_context
def runs(ctx: click.Context, status: str | None, as_json: bool) -> None:
    """List runs (each attempt of a run name) with their checkpoint and validation counts."""
    summaries = _listing(ctx, "run_summaries", status=status)
    if as_json:
        from validation_service.views import run_json

        _echo_json([run_json(summary) for summary in summaries])
        return
    headers, rows = run_rows(summaries)
    click.echo(_render(headers, rows))


@main.command()
@click.argument("run")
@_json_option
@click.pass_context
def checkpoints(ctx: click.Context, run: str, as_json: bool) -> None:
    """List the checkpoints of RUN with their merged metrics."""
    records = _listing(ctx, "checkpoints", run)
    if as_json:
        _echo_checkpoints_json(records)
        return
    click.echo(_checkpoint_table(records))


@main.command()
@click.argument("run", required=False)
@click.option("--metric", required=True, help="Metric to rank by.")
@click.option(
    "--mode",
    type=click.Choice(["max", "min"]),
    default=None,
    help="max: highest first; min: lowest first (a loss or an error).  [default: max]",
)
@click.option("-k", "k", default=1, show_default=True, type=click.IntRange(min=1))
@_json_option
@click.pass_context
def best(
    ctx: click.Context, run: str | None, metric: str, mode: str | None, k: int, as_json: bool
) -> None:
    """The best K checkpoints of RUN (of all runs when RUN is left out) by a metric."""
    from validation_service.metrics import lower_is_better

    records = _listing(ctx, "best_checkpoint_records", run, metric, mode or "max", k)
    if mode is None and lower_is_better(metric):
        click.echo(
            f"warning: --mode defaulted to max, so the highest {metric!r} comes first, but "
            f"{metric!r} reads like a metric where lower is better: pass --mode min for the "
            "lowest (--mode max silences this warning).",
            err=True,
        )
    if as_json:
        _echo_checkpoints_json(records)
        return
    others = [m for m in _metric_columns(records) if m != metric]
    click.echo(_checkpoint_table(records, [metric, *others][:6], with_run=run is None))


def _echo_checkpoints_json(records: Sequence[CheckpointRecord]) -> None:
    from validation_service.views import checkpoint_json

    _echo_json([checkpoint_json(record) for record in records])


def _metric_columns(records: Sequence[CheckpointRecord], limit: int = 6) -> list[str]:
    names: list[str] = []
    for record in records:
        for name in record.metrics:
            if name not in names:
                names.append(name)
    return names[:limit]


def _checkpoint_table(
    records: Sequence[CheckpointRecord], metrics: list[str] | None = None, with_run: bool = False
) -> str:
    from validation_service._format import format_size

    metrics = metrics or _metric_columns(records)
    headers = ["#", *(["run"] if with_run else []), "report", "validation", *metrics, "size", "uri"]
    rows = [
        [
            i + 1,
            *([r.run] if with_run else []),
            r.report_index,
            r.validation_status,
            *[r.metrics.get(m) for m in metrics],
            format_size(r.size_bytes),
            r.uri,
        ]
        for i, r in enumerate(records)
    ]
    return _render(headers, rows)


# ----------------------------------------------------------------------------- jobs
@main.command()
@click.argument("run", required=False)
@click.option(
    "--status",
    "statuses",
    multiple=True,
    callback=lambda ctx, param, values: _job_statuses(values),
    metavar="STATUS",
    help="Only jobs in this status: QUEUED, RUNNING, SUCCEEDED, FAILED, TIMED_OUT or "
    "CANCELLED (repeatable).",
)
@click.option("--pool", default=None, help="Only jobs of this resource pool, e.g. A10G.")
@click.option(
    "--limit",
    # One more than the limit is read, and a row count is a 64-bit integer.
    type=click.IntRange(min=1, max=2**63 - 2),
    default=None,
    help=f"Show the newest N jobs  [default: all of RUN; {DEFAULT_QUEUE_LIMIT} of the queue]",
)
@_json_option
@click.option(
    "--watch", is_flag=True, help="Refresh until no job is QUEUED or RUNNING (Ctrl-C stops)."
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

    Each row shows the job's status, attempts, pool, node and the error of a failed one.
    """
    if watch and as_json:
        raise click.UsageError("--watch redraws a table; leave out --json")
    if limit is None and run is None:
        limit = DEFAULT_QUEUE_LIMIT
    wanted = list(statuses) or None

    def query() -> tuple[list[JobRecord], bool]:
        found = _listing(
            ctx,
            "list_jobs",
            run,
            statuses=wanted,
            pool=pool,
            limit=None if limit is None else limit + 1,
        )
        more = limit is not None and len(found) > limit
        return (found[1:] if more else found), more

    if watch:
        _watch_jobs(ctx, query, with_run=run is None, interval=interval)
        return
    found, more = query()
    if as_json:
        from validation_service.views import job_json

        _echo_json([job_json(job) for job in found])
    else:
        click.echo(_jobs_table(found, with_run=run is None))
    if more:
        click.echo(f"(the newest {limit} jobs; --limit N shows more)", err=True)


def _job_statuses(values: tuple[str, ...]) -> tuple[str, ...]:
    names = [status.value for status in JobStatus]
    for value in values:
        if value.upper() not in names:
            raise click.BadParameter(f"{value!r} is not a job status: use {', '.join(names)}")
    return tuple(value.upper() for value in values)


def _jobs_table(found: Sequence[JobRecord], *, with_run: bool) -> str:
    from validation_service._format import short_node_id

    rows = []
    for job in found:
        node = next((a.node_id for a in reversed(job.attempt_history) if a.node_id), None)
        error = f"{job.error_type}: {job.error_message}" if job.error_type else ""
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
    return _render([*headers, "node", "validate_fn", "error"], rows)


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

    from validation_service._format import format_mapping, format_time

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
                click.echo(_jobs_table(found, with_run=with_run))
                click.echo(f"\n{now}  {len(active)} QUEUED or RUNNING; Ctrl-C stops watching")
                if note:
                    click.echo(note, err=True)
            elif seen is None:
                click.echo(_jobs_table(found, with_run=with_run))
            else:
                for job in found:
                    if seen.get(job.id) != job.status:
                        click.echo(f"{now}  {_status_change(job, seen.get(job.id, 'new'))}")
            first_look = seen is None
            seen = {job.id: job.status for job in found}
            if not active:
                counts: dict[str, int] = {}
                for job in found:
                    counts[job.status] = counts.get(job.status, 0) + 1
                click.echo(f"no job is QUEUED or RUNNING: {format_mapping(counts)}")
                return
            if first_look:
                # Only now, with jobs waiting: connecting to Ray takes a second or two.
                note = _missing_service_note(_settings(ctx))
                if note:
                    click.echo(note, err=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        click.echo("")


def _status_change(job: JobRecord, was: str) -> str:
    error = f" ({job.error_type}: {job.error_message})" if job.error_type else ""
    where = f"{job.run} report {job.report_index}"
    return f"job {job.id} ({where}): {was} -> {job.status}{error}"


def _missing_service_note(settings: Settings) -> str | None:
    """Why QUEUED jobs may not move: no service runs (None when one does)."""
    from validation_service.errors import RayClusterNotFound

    try:
        handle, address = _find_service(settings)
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


@main.command()
@click.argument("job_id", type=int)
@_json_option
@click.pass_context
def job(ctx: click.Context, job_id: int, as_json: bool) -> None:
    """Show one validation job, its attempts and its stored traceback."""
    from validation_service._format import format_value, short_node_id

    record = _registry(ctx).get_job(job_id)
    if as_json:
        from validation_service.views import job_json

        _echo_json(job_json(record))
        return
    fields = {
        "id": record.id,
        "run": record.run,
        "report_index": record.report_index,
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
        "result_metrics": record.result_metrics,
        "error_type": record.error_type,
        "error_message": record.error_message,
    }
    for name, value in fields.items():
        click.echo(f"{name:15} {format_value(value)}")
    rows = [
        [
            a.attempt,
            a.status,
            short_node_id(a.node_id),
            a.worker_pid,
            a.started_at,
            a.finished_at,
            (a.error_message or "")[:80],
        ]
        for a in record.attempt_history
    ]
    click.echo("")
    click.echo(_render(["attempt", "status", "node", "pid", "started", "finished", "error"], rows))
    if record.error_traceback:
        click.echo("\ntraceback:\n" + record.error_traceback)


@main.command()
@click.argument("job_ids", type=int, nargs=-1)
@click.option("--run", default=None, help="Cancel every queued or running job of this run.")
@click.pass_context
def cancel(ctx: click.Context, job_ids: tuple[int, ...], run: str | None) -> None:
    """Cancel validation jobs (queued ones never start)."""
    if not job_ids and not run:
        raise click.UsageError("give JOB ids or --run RUN")
    from validation_service.views import tell_service

    done = _registry(ctx).cancel_jobs(list(job_ids) or None, run=run)
    if done:
        tell_service(_registry(ctx).settings, "check_leases", connect=True)
    click.echo(f"cancelled {len(done)} job(s): {done}")


@main.command()
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
    from validation_service.views import tell_service

    done = _registry(ctx).retry_jobs(list(job_ids) or None, run=run, statuses=statuses)
    if done:
        tell_service(_registry(ctx).settings, "nudge", connect=True)
    click.echo(f"requeued {len(done)} job(s): {done}")


@main.group()
def db() -> None:
    """Registry schema migrations."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
@click.pass_context
def db_upgrade(ctx: click.Context, revision: str) -> None:
    """Migrate the registry database to REVISION."""
    _migrate_to(ctx, "upgrade", revision)


@db.command("downgrade")
@click.argument("revision")
@click.option("--yes", is_flag=True, help="Do not ask; downgrading may drop tables and data.")
@click.pass_context
def db_downgrade(ctx: click.Context, revision: str, yes: bool) -> None:
    """Migrate the registry database back to REVISION ('base' drops every table)."""
    if not yes:
        what = "drops every table" if revision == "base" else "may drop tables and columns"
        if not sys.stdin.isatty():
            raise click.UsageError(
                f"`ckval db downgrade {revision}` {what} with the data in them; "
                "pass --yes to do it without a terminal to confirm on."
            )
        registry = _unchecked_registry(ctx)
        click.confirm(
            f"Downgrade {registry.display_url} to {revision}? This {what} with their data",
            abort=True,
        )
    _migrate_to(ctx, "downgrade", revision)


def _migrate_to(ctx: click.Context, direction: str, revision: str) -> None:
    registry = _unchecked_registry(ctx)
    getattr(registry, direction)(revision)
    click.echo(f"{registry}: schema at {registry.schema_revision() or 'base'}")


@db.command("current")
@click.pass_context
def db_current(ctx: click.Context) -> None:
    """Print the registry's schema revision."""
    click.echo(_unchecked_registry(ctx).schema_revision() or "none")


def _unchecked_registry(ctx: click.Context):
    from validation_service.registry.registry import Registry

    obj = ctx.find_root().obj
    settings = get_settings(database_url=obj.get("database_url"))
    return Registry(settings=settings, check_schema=False)


@main.command()
@click.option("--pool", "pools", multiple=True, help="Concurrency cap per pool, e.g. A10G=4.")
@click.option("--storage", default=None, help="Checkpoint storage URI.")
@click.option("--http/--no-http", default=True, show_default=True, help="Serve the HTTP API.")
@click.option(
    "--host",
    default=None,
    help="Address the HTTP API binds to (default CKVAL_HTTP_HOST, 127.0.0.1). Anything "
    "but a loopback address needs CKVAL_API_TOKEN.",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Port of the HTTP API (default CKVAL_HTTP_PORT, 8780).",
)
@click.option("--detach", is_flag=True, help="Start the service on the cluster and return.")
@click.pass_context
def serve(
    ctx: click.Context,
    pools: tuple[str, ...],
    storage: str | None,
    http: bool,
    host: str | None,
    port: int | None,
    detach: bool,
) -> None:
    """Start the validation service on the Ray cluster (CKVAL_RAY_ADDRESS, else local)."""
    from validation_service.service import ValidationService

    obj = ctx.find_root().obj
    settings = get_settings(
        database_url=obj.get("database_url"),
        namespace=obj.get("namespace"),
        http_host=host,
        http_port=port,
    )
    serves_http = http and not detach
    if serves_http:
        from validation_service.api import check_bind

        check_bind(settings)  # before Ray starts: an open API without a token never runs
    handle = ValidationService.start(
        storage=storage, pools=_parse_pools(pools) or None, settings=settings
    )
    click.echo(json.dumps(handle.status(), indent=1, default=str))
    if detach:
        return
    if serves_http:
        import uvicorn

        from validation_service.api import create_app

        click.echo(f"HTTP API on http://{settings.http_host}:{settings.http_port}")
        uvicorn.run(
            create_app(settings),
            host=settings.http_host,
            port=settings.http_port,
            log_level="warning",
            server_header=False,
        )
        return
    try:
        while True:
            time.sleep(30)
    except KeyboardInterrupt:
        pass


def _parse_pools(pools: tuple[str, ...]) -> dict[str, int]:
    parsed = {}
    for item in pools:
        name, sep, size = item.partition("=")
        if not sep or not size.isdigit():
            raise click.BadParameter(f"{item!r}: use NAME=N, e.g. A10G=4", param_hint="--pool")
        parsed[name] = int(size)
    return parsed


# --------------------------------------------------------------------- the service
def _find_service(settings: Settings) -> tuple[ServiceHandle | None, str]:
    """The running service and the address of its Ray cluster; never starts Ray."""
    from validation_service._ray_cluster import connect_existing_ray
    from validation_service.service import ValidationService

    address = connect_existing_ray(settings)
    return ValidationService.get(settings), address


def _service_or_exit(ctx: click.Context) -> ServiceHandle:
    from validation_service.errors import RayClusterNotFound

    try:
        handle, address = _find_service(_settings(ctx))
    except RayClusterNotFound as exc:
        click.echo(f"no ckval service is running ({exc.reason}; start one with `ckval serve`)")
        sys.exit(EXIT_NOT_RUNNING)
    if handle is None:
        click.echo(
            f"no ckval service is running on the Ray cluster at {address} "
            "(start one with `ckval serve`)"
        )
        sys.exit(EXIT_NOT_RUNNING)
    return handle


@main.command()
@click.pass_context
def status(ctx: click.Context) -> None:
    """Show the running service's status as JSON (exit status 3: none is running).

    Looks on CKVAL_RAY_ADDRESS, else RAY_ADDRESS, else a Ray running on this machine;
    never starts Ray.
    """
    handle = _service_or_exit(ctx)
    _echo_json(handle.status())


@main.command()
@click.pass_context
def stop(ctx: click.Context) -> None:
    """Stop the running service (queued jobs stay queued in the registry).

    Exit status 3 when none is running; never starts Ray.
    """
    handle = _service_or_exit(ctx)
    handle.stop()
    click.echo(f"stopped the ckval service {handle.settings.service_name!r}")


for _command in (*REGISTRY_COMMANDS, ui_command):
    main.add_command(_command)

if __name__ == "__main__":
    main()
