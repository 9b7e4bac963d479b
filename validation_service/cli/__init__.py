"""`ckval` command line: the registry, the service and the demo from a shell.

Importing this module loads click and nothing heavy, so that `ckval --help` and the
registry listings start fast: every command imports what it uses (SQLAlchemy for the
registry, Ray only to reach the service); the listings (runs, checkpoints, best, jobs)
read an embedded SQLite registry with sqlite3 alone (registry/_fast_read.py). The
commands live in this package's modules (listings, jobs, service, registry, stopping,
evaluations, watching, db, ui) and join here with ``main.add_command(command)``, following the
same rule.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from validation_service.cli import (
    evaluations,
    jobs,
    listings,
    registry,
    service,
    stopping,
    watching,
)
from validation_service.cli._format import echo
from validation_service.cli.common import EXIT_FAILURE, EXIT_NOT_RUNNING, EXIT_USAGE
from validation_service.cli.db import db
from validation_service.cli.ui import ui_command

EPILOG = """\b
Exit status:
  0  done; `status`: the service is running; `stop`: it was stopped
  1  another failure (the registry database is unreachable, ...)
  2  bad usage or input (an unknown run, metric, job or option)
  3  `status`, `stop`: no ckval service is running (nothing is started)
"""


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
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # Bytes that are not UTF-8 reach Python's argv as lone surrogates, which no
        # registry stores and no terminal prints: refused before anything runs.
        for arg in args:
            try:
                arg.encode("utf-8")
            except UnicodeEncodeError:
                echo(
                    f"error: the argument {arg!r} is not UTF-8 text (the escapes mark bytes "
                    "that do not decode as UTF-8); pass names and values in UTF-8",
                    err=True,
                )
                raise click.exceptions.Exit(EXIT_USAGE) from None
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            code = _exit_code(exc)
            if code is None:
                raise
            echo(f"error: {exc}", err=True)
            sys.exit(code)


@click.group(cls=_Group, epilog=EPILOG)
@click.option("--database-url", envvar="CKVAL_DATABASE_URL", help="Registry database URL.")
@click.option("--namespace", envvar="CKVAL_NAMESPACE", help="Run namespace.")
@click.pass_context
def main(ctx: click.Context, database_url: str | None, namespace: str | None) -> None:
    """ckval: asynchronous checkpoint validation for Ray Train."""
    ctx.ensure_object(dict).update(database_url=database_url, namespace=namespace)


for _command in (
    *listings.COMMANDS,
    *jobs.COMMANDS,
    *service.COMMANDS,
    *registry.COMMANDS,
    *stopping.COMMANDS,
    *evaluations.COMMANDS,
    *watching.COMMANDS,
    db,
    ui_command,
):
    main.add_command(_command)
