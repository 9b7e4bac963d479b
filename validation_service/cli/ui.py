"""`ckval ui`: the HTTP API, the dashboard and /metrics over a registry, without the service.

For looking at runs from a laptop or a read-only replica: nothing here starts Ray or the
validation service; jobs stay as they are until a service (`ckval serve`) runs them.
"""

from __future__ import annotations

import click

from validation_service.cli._format import echo


@click.command("ui")
@click.option("--host", default=None, help="Address to listen on (default: CKVAL_HTTP_HOST).")
@click.option("--port", type=int, default=None, help="Port (default: CKVAL_HTTP_PORT).")
@click.pass_context
def ui_command(ctx: click.Context, host: str | None, port: int | None) -> None:
    """Serve the dashboard and the HTTP API over the registry, without the service."""
    import uvicorn

    from validation_service.api import check_bind, create_app
    from validation_service.config import get_settings
    from validation_service.errors import CkvalError
    from validation_service.registry.registry import Registry

    obj = ctx.find_root().obj or {}
    # The address served is a Host the API answers (allowed_hosts reads http_host).
    settings = get_settings(
        database_url=obj.get("database_url"), namespace=obj.get("namespace"), http_host=host
    )
    host = settings.http_host
    port = settings.http_port if port is None else port
    if not 0 < port < 65536:
        raise click.BadParameter(f"{port} is not a TCP port: use 1-65535", param_hint="--port")
    check_bind(settings, host)  # no open dashboard without CKVAL_API_TOKEN
    # Opened (and its schema checked) before listening: a wrong URL fails here, clearly.
    try:
        registry = Registry(settings=settings)
    except CkvalError as exc:
        raise click.ClickException(str(exc)) from exc
    echo(f"ckval dashboard on http://{host}:{port}/ui/ over {registry.display_url}")
    try:
        uvicorn.run(create_app(settings, registry), host=host, port=port, log_level="warning")
    finally:
        registry.close()
