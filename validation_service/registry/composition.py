"""The registry's composition root: the one place its parts are built, on one Database,
and handed to each audience with only what that audience uses.

- a reporting process: a ``ReportWriter`` (the Ledger and the Assemblies);
- a service replica: its ``ServiceParts`` (the JobQueue and the ReplicaBook);
- a user: the ``Registry``, whose ``RegistryParts`` are all of them (its ``dashboard``
  is the dashboard's and /metrics' reader); ``Registry.on_database`` makes one on a
  Database opened already (a reporting process's queries share its writer's).

No part opens another: each gets the Database and the parts it calls.
"""

from __future__ import annotations

import dataclasses

from sqlalchemy import Engine

from validation_service.config import Settings
from validation_service.names import check_name
from validation_service.registry.assemblies import Assemblies
from validation_service.registry.catalog import Catalog
from validation_service.registry.dashboard_reads import DashboardReader
from validation_service.registry.database import Database
from validation_service.registry.housekeeping import Housekeeping
from validation_service.registry.jobs import JobQueue
from validation_service.registry.ledger import Ledger
from validation_service.registry.replicas import ReplicaBook
from validation_service.registry.stopping import StopRules
from validation_service.registry.watch_listings import WatchBook
from validation_service.retry import RetryPolicy


def namespace_of(namespace: str | None, settings: Settings) -> str:
    """The namespace a door works in: the one asked for, else the settings'."""
    return check_name("namespace", namespace or settings.namespace)


def open_database(
    settings: Settings,
    database_url: str | None = None,
    *,
    upgrade: bool | None = None,
    check_schema: bool = True,
) -> Database:
    """The registry database of ``database_url`` (default: the settings'), its schema
    checked: an embedded SQLite is migrated (``upgrade`` None), a server database must
    be at the head revision already (``ckval db upgrade``)."""
    url = database_url or settings.resolved_database_url()
    db = Database(url, source=_url_source(database_url, settings))
    if check_schema:
        try:
            db.check_schema(db.is_sqlite() if upgrade is None else upgrade)
        except BaseException:
            db.close()
            raise
    return db


@dataclasses.dataclass(frozen=True)
class _OwnDatabase:
    """Parts on a Database opened for them, which ``close()`` closes."""

    db: Database

    def close(self) -> None:
        self.db.close()


def _open_for_namespace(settings: Settings) -> tuple[Database, Catalog]:
    """The settings' registry (schema checked) and the catalog of their namespace."""
    catalog = Catalog(namespace_of(None, settings))
    return open_database(settings), catalog


@dataclasses.dataclass(frozen=True)
class ReportWriter(_OwnDatabase):
    """What a reporting process writes with: its run, report indices and registrations
    (``ledger``), and the ranks' parts of sharded checkpoints (``assemblies``)."""

    ledger: Ledger
    assemblies: Assemblies


def open_report_writer(settings: Settings) -> ReportWriter:
    """A reporting process's writer, on the settings' registry (schema checked)."""
    db, catalog = _open_for_namespace(settings)
    return ReportWriter(db, Ledger(db, catalog), Assemblies(db, catalog))


@dataclasses.dataclass(frozen=True)
class ServiceParts(_OwnDatabase):
    """What a service replica's scheduler works with: the queue's claims, leases and
    outcomes (``job_queue``, which has housekeeping judged after them), the replicas'
    rows (``replicas``), the watched folders' listings (``watch_listings``) and the
    sharded reports whose worker group ended (``assemblies``);
    ``engine`` for the replica's wake-ups (wakeups.QueueListener)."""

    job_queue: JobQueue
    replicas: ReplicaBook
    watch_listings: WatchBook
    assemblies: Assemblies

    @property
    def engine(self) -> Engine:
        return self.db.engine

    @property
    def display_url(self) -> str:
        return self.db.display_url


def open_service_parts(settings: Settings) -> ServiceParts:
    """A service replica's parts, on the settings' registry (schema checked)."""
    db, catalog = _open_for_namespace(settings)
    return ServiceParts(
        db,
        _job_queue(db, catalog, settings),
        ReplicaBook(db),
        WatchBook(db),
        Assemblies(db, catalog),
    )


@dataclasses.dataclass(frozen=True)
class RegistryParts:
    """Every part, for the users' Registry: its own queries use the catalog; the others
    are there for the tools and tests that act as a reporter or a scheduler."""

    catalog: Catalog
    ledger: Ledger
    stopping: StopRules
    housekeeping: Housekeeping
    job_queue: JobQueue
    assemblies: Assemblies
    dashboard: DashboardReader
    replicas: ReplicaBook
    watch_listings: WatchBook


def registry_parts(db: Database, namespace: str, settings: Settings) -> RegistryParts:
    catalog = Catalog(namespace)
    job_queue = _job_queue(db, catalog, settings)
    return RegistryParts(
        catalog=catalog,
        ledger=Ledger(db, catalog),
        stopping=job_queue.housekeeping.stopping,
        housekeeping=job_queue.housekeeping,
        job_queue=job_queue,
        assemblies=Assemblies(db, catalog),
        dashboard=DashboardReader(db, catalog),
        replicas=ReplicaBook(db),
        watch_listings=WatchBook(db),
    )


def _job_queue(db: Database, catalog: Catalog, settings: Settings) -> JobQueue:
    """The job queue, with the housekeeping it has done after an outcome."""
    housekeeping = Housekeeping(db, catalog, settings, StopRules(db))
    return JobQueue(db, catalog, housekeeping, RetryPolicy.from_settings(settings))


def _url_source(database_url: str | None, settings: Settings) -> str:
    """Where a registry's URL came from, for the errors that say what to fix."""
    if database_url:
        return "the database_url argument"
    return "CKVAL_DATABASE_URL" if settings.database_url else "CKVAL_HOME"
