"""`ckval` command line: the registry, the service and the demo from a shell."""

from __future__ import annotations

import json
import sys
import time

import click

from validation_service._table import render
from validation_service.config import get_settings
from validation_service.errors import CkvalError
from validation_service.jobs import JobStatus
from validation_service.views import checkpoint_json, tell_service


def _registry(ctx: click.Context):
    from validation_service.registry.registry import Registry

    obj = ctx.ensure_object(dict)
    if "registry" not in obj:
        settings = get_settings(
            database_url=obj.get("database_url"), namespace=obj.get("namespace")
        )
        obj["registry"] = Registry(settings=settings)
    return obj["registry"]


def _metric_columns(records, limit: int = 6) -> list[str]:
    names: list[str] = []
    for record in records:
        for name in record.metrics:
            if name not in names:
                names.append(name)
    return names[:limit]


def _checkpoint_table(records, extra: list[str] | None = None) -> str:
    metrics = extra or _metric_columns(records)
    headers = ["#", "report", "validation", *metrics, "size", "uri"]
    rows = [
        [
            i + 1,
            r.report_index,
            r.validation_status,
            *[r.metrics.get(m) for m in metrics],
            _size(r.size_bytes),
            r.uri,
        ]
        for i, r in enumerate(records)
    ]
    return render(headers, rows)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except CkvalError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.option("--database-url", envvar="CKVAL_DATABASE_URL", help="Registry database URL.")
@click.option("--namespace", envvar="CKVAL_NAMESPACE", help="Run namespace.")
@click.pass_context
def main(ctx: click.Context, database_url: str | None, namespace: str | None) -> None:
    """ckval: asynchronous checkpoint validation for Ray Train."""
    ctx.ensure_object(dict).update(database_url=database_url, namespace=namespace)


@main.command()
@click.option("--epochs", default=5, show_default=True)
@click.option("--workers", default=2, show_default=True)
@click.option("--run", "run_name", default=None, help="Run name (default: ckval-demo-<time>).")
def demo(epochs: int, workers: int, run_name: str | None) -> None:
    """Train a small model with TorchTrainer, validate every epoch, print the best."""
    from validation_service.demo import run_demo

    run_demo(epochs=epochs, num_workers=workers, run_name=run_name)


@main.command()
@click.pass_context
def runs(ctx: click.Context) -> None:
    """List runs."""
    rows = [
        [
            summary.run.name,
            summary.run.status,
            summary.run.created_at,
            summary.checkpoints,
            " ".join(f"{k}={v}" for k, v in sorted(summary.job_counts.items())),
        ]
        for summary in _registry(ctx).run_summaries()
    ]
    click.echo(render(["run", "status", "created", "checkpoints", "validations"], rows))


@main.command()
@click.argument("run")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def checkpoints(ctx: click.Context, run: str, as_json: bool) -> None:
    """List the checkpoints of RUN with their merged metrics."""
    records = _registry(ctx).checkpoints(run)
    if as_json:
        click.echo(json.dumps([checkpoint_json(r) for r in records], indent=1, default=str))
        return
    click.echo(_checkpoint_table(records))


@main.command()
@click.argument("run", required=False)
@click.option("--metric", required=True, help="Metric to rank by.")
@click.option("--mode", type=click.Choice(["max", "min"]), default="max", show_default=True)
@click.option("-k", "k", default=1, show_default=True, help="How many checkpoints.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def best(ctx: click.Context, run: str | None, metric: str, mode: str, k: int, as_json: bool):
    """The best K checkpoints of RUN (of all runs when RUN is left out) by a metric."""
    records = _registry(ctx).best_checkpoint_records(run, metric, mode, k)
    if as_json:
        click.echo(json.dumps([checkpoint_json(r) for r in records], indent=1, default=str))
        return
    others = [m for m in _metric_columns(records) if m != metric]
    click.echo(_checkpoint_table(records, [metric, *others][:6]))


@main.command()
@click.argument("run")
@click.pass_context
def jobs(ctx: click.Context, run: str) -> None:
    """List the validation jobs of RUN, with the error of each failed one."""
    rows = []
    for job in _registry(ctx).validations(run):
        node = next((a.node_id for a in reversed(job.attempt_history) if a.node_id), None)
        error = f"{job.error_type}: {job.error_message}" if job.error_type else ""
        rows.append(
            [
                job.id,
                job.report_index,
                job.status,
                f"{job.attempts}/{job.max_attempts}",
                job.pool,
                (node or "")[:12],
                job.validate_fn_name,
                error[:100],
            ]
        )
    headers = ["job", "report", "status", "attempts", "pool", "node", "validate_fn", "error"]
    click.echo(render(headers, rows))


@main.command()
@click.argument("job_id", type=int)
@click.pass_context
def job(ctx: click.Context, job_id: int) -> None:
    """Show one validation job, its attempts and its stored traceback."""
    record = _registry(ctx).get_job(job_id)
    for field in (
        "id",
        "run",
        "report_index",
        "status",
        "attempts",
        "max_attempts",
        "pool",
        "resources",
        "validate_fn_name",
        "priority",
        "timeout_s",
        "created_at",
        "started_at",
        "finished_at",
        "result_metrics",
        "error_type",
        "error_message",
    ):
        click.echo(f"{field:17} {getattr(record, field)}")
    rows = [
        [
            a.attempt,
            a.status,
            a.node_id,
            a.worker_pid,
            a.started_at,
            a.finished_at,
            (a.error_message or "")[:80],
        ]
        for a in record.attempt_history
    ]
    click.echo(render(["attempt", "status", "node", "pid", "started", "finished", "error"], rows))
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


@main.command()
def status() -> None:
    """Show the running service's status."""
    from validation_service.service import ValidationService

    handle = ValidationService.get()
    if handle is None:
        click.echo("no ckval service is running on this Ray cluster")
        sys.exit(1)
    click.echo(json.dumps(handle.status(), indent=1, default=str))


@main.command()
def stop() -> None:
    """Stop the running service (queued jobs stay queued in the registry)."""
    from validation_service.service import ValidationService

    handle = ValidationService.get()
    if handle is None:
        click.echo("no ckval service is running on this Ray cluster")
        return
    handle.stop()
    click.echo("stopped")


if __name__ == "__main__":
    main()
