"""`ckval db`: the registry's schema migrations. The CLI registers ``db`` with
``main.add_command``; imports stay light until a command runs."""

from __future__ import annotations

import sys

import click

from validation_service.cli._format import echo


@click.group()
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
                f"`ckval db downgrade {revision!r}` {what} with the data in them; "
                "pass --yes to do it without a terminal to confirm on."
            )
        registry = _unchecked_registry(ctx)
        click.confirm(
            f"Downgrade {registry.display_url} to {revision!r}? This {what} with their data",
            abort=True,
        )
    _migrate_to(ctx, "downgrade", revision)


def _migrate_to(ctx: click.Context, direction: str, revision: str) -> None:
    # An unknown revision is an InvalidInput: `ckval` prints it on one line (exit 2).
    registry = _unchecked_registry(ctx)
    getattr(registry, direction)(revision)
    echo(f"{registry}: schema at {registry.schema_revision() or 'base'}")


@db.command("current")
@click.pass_context
def db_current(ctx: click.Context) -> None:
    """Print the registry's schema revision."""
    echo(_unchecked_registry(ctx).schema_revision() or "none")


def _unchecked_registry(ctx: click.Context):
    from validation_service.config import get_settings
    from validation_service.registry.registry import Registry

    obj = ctx.find_root().obj
    settings = get_settings(database_url=obj.get("database_url"))
    return Registry(settings=settings, check_schema=False)
