"""`ckval serve`, `ckval status`, `ckval stop` and `ckval demo`: the validation service on
the Ray cluster. Ray loads only when one of these commands runs."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING

import click

from validation_service.cli._format import echo
from validation_service.cli.common import EXIT_NOT_RUNNING, echo_json, settings_of

if TYPE_CHECKING:
    from validation_service.config import Settings
    from validation_service.service import ServiceHandle


@click.command()
@click.option("--epochs", default=5, show_default=True)
@click.option("--workers", default=2, show_default=True)
@click.option("--run", "run_name", default=None, help="Run name (default: ckval-demo-<time>).")
def demo(epochs: int, workers: int, run_name: str | None) -> None:
    """Train a small model with TorchTrainer, validate every epoch, print the best."""
    from validation_service.cli.demo import run_demo

    run_demo(epochs=epochs, num_workers=workers, run_name=run_name)


@click.command()
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
@click.option(
    "--detach",
    is_flag=True,
    help="Start the service on a running Ray cluster and return.",
)
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

    settings = settings_of(ctx, http_host=host, http_port=port)
    serves_http = http and not detach
    if serves_http:
        from validation_service.api import check_bind

        check_bind(settings)  # before Ray starts: an open API without a token never runs
    if detach:
        _connect_to_a_lasting_cluster(settings)
    handle = ValidationService.start(
        storage=storage, pools=_parse_pools(pools) or None, settings=settings
    )
    echo(json.dumps(handle.status(), indent=1, default=str))
    if detach:
        return
    if serves_http:
        _serve_http(settings)
        return
    try:
        while True:
            time.sleep(30)
    except KeyboardInterrupt:
        pass


def _connect_to_a_lasting_cluster(settings: Settings) -> None:
    """`serve --detach` leaves the service on a running cluster. A Ray it started itself
    would stop when the command returns, and take the service with it: refused, with
    nothing started."""
    from validation_service._ray_cluster import connect_existing_ray
    from validation_service.errors import RayClusterNotFound

    try:
        connect_existing_ray(settings)
    except RayClusterNotFound as exc:
        raise click.ClickException(
            f"--detach leaves the service on a running Ray cluster, and {exc.reason}: a Ray "
            "started by this command would stop when it returns, and the service with it. "
            "Start one first (`ray start --head --port 6380`, then CKVAL_RAY_ADDRESS=auto), "
            "or point CKVAL_RAY_ADDRESS at yours; or run `ckval serve` without --detach, "
            "which keeps its local Ray until Ctrl-C."
        ) from exc


def _serve_http(settings: Settings) -> None:
    """The HTTP API in the foreground, until Ctrl-C."""
    import uvicorn

    from validation_service.api import create_app

    echo(f"HTTP API on http://{settings.http_host}:{settings.http_port}")
    uvicorn.run(
        create_app(settings),
        host=settings.http_host,
        port=settings.http_port,
        log_level="warning",
        server_header=False,
    )


def _parse_pools(pools: tuple[str, ...]) -> dict[str, int]:
    parsed = {}
    for item in pools:
        name, sep, size = item.partition("=")
        if not sep or not size.isdigit():
            raise click.BadParameter(f"{item!r}: use NAME=N, e.g. A10G=4", param_hint="--pool")
        parsed[name] = int(size)
    return parsed


def find_service(settings: Settings) -> tuple[ServiceHandle | None, str]:
    """The running service and the address of its Ray cluster; never starts Ray."""
    from validation_service._ray_cluster import connect_existing_ray
    from validation_service.service import ValidationService

    address = connect_existing_ray(settings)
    return ValidationService.get(settings), address


def _service_or_exit(ctx: click.Context) -> ServiceHandle:
    from validation_service.errors import RayClusterNotFound

    try:
        handle, address = find_service(settings_of(ctx))
    except RayClusterNotFound as exc:
        echo(f"no ckval service is running ({exc.reason}; start one with `ckval serve`)")
        sys.exit(EXIT_NOT_RUNNING)
    if handle is None:
        echo(
            f"no ckval service is running on the Ray cluster at {address} "
            "(start one with `ckval serve`)"
        )
        sys.exit(EXIT_NOT_RUNNING)
    return handle


@click.command()
@click.pass_context
def status(ctx: click.Context) -> None:
    """Show the running service's status as JSON (exit status 3: none is running).

    Looks on CKVAL_RAY_ADDRESS, else RAY_ADDRESS, else a Ray running on this machine;
    never starts Ray.
    """
    handle = _service_or_exit(ctx)
    echo_json(handle.status())


@click.command()
@click.pass_context
def stop(ctx: click.Context) -> None:
    """Stop the running service (queued jobs stay queued in the registry).

    Exit status 3 when none is running; never starts Ray.
    """
    handle = _service_or_exit(ctx)
    handle.stop()
    echo(f"stopped the ckval service {handle.settings.service_name!r}")


COMMANDS: list[click.Command] = [serve, status, stop, demo]
