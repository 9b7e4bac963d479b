"""The service's replicas as the registry knows them: each replica writes its row at start
and at every heartbeat; status, the API and /metrics read them (without Ray), with the
leases each one holds."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from validation_service.jobs import LEASED_JOB_STATUSES
from validation_service.registry.database import Database
from validation_service.registry.models import ServiceReplica, ValidationJob, utcnow

_replicas = ServiceReplica.__table__
_jobs = ValidationJob.__table__


@dataclass(frozen=True)
class ReplicaRecord:
    """One replica: its incarnation (owner, pid, node), its last heartbeat and the leases
    its incarnation holds now."""

    name: str
    service_name: str
    owner: str
    pid: int
    hostname: str
    node_id: str | None
    started_at: dt.datetime
    heartbeat_at: dt.datetime
    stopped_at: dt.datetime | None
    leases: int

    def heartbeat_age_s(self, now: dt.datetime | None = None) -> float:
        return ((now or utcnow()) - self.heartbeat_at).total_seconds()

    def fresh(self, lease_s: float, now: dt.datetime | None = None) -> bool:
        """Its last heartbeat is younger than a lease, and it did not stop."""
        return self.stopped_at is None and self.heartbeat_age_s(now) < lease_s


class ReplicaBook:
    """The service_replicas table."""

    def __init__(self, db: Database):
        self.db = db

    def beat(
        self,
        *,
        name: str,
        service_name: str,
        owner: str,
        pid: int,
        hostname: str,
        node_id: str | None,
        started_at: dt.datetime,
    ) -> None:
        """Writes the replica's row: a new incarnation replaces the last one's."""
        values = {
            "name": name,
            "service_name": service_name,
            "owner": owner,
            "pid": pid,
            "hostname": hostname,
            "node_id": node_id,
            "started_at": started_at,
            "heartbeat_at": utcnow(),
            "stopped_at": None,
        }
        dialect = postgresql if self.db.dialect == "postgresql" else sqlite
        statement = dialect.insert(_replicas).values(values)
        changed = {key: statement.excluded[key] for key in values if key != "name"}
        with self.db.write() as conn:
            conn.execute(statement.on_conflict_do_update(index_elements=["name"], set_=changed))

    def stopped(self, name: str, owner: str) -> None:
        """The replica stopped on purpose (its row stays, marked)."""
        with self.db.write() as conn:
            conn.execute(
                update(_replicas)
                .where(_replicas.c.name == name, _replicas.c.owner == owner)
                .values(stopped_at=utcnow())
            )

    def forget(self, service_name: str, keep: int) -> None:
        """Drops the rows of replicas past the first ``keep`` (the service runs fewer now)."""
        names = [replica_name(service_name, index) for index in range(keep)]
        with self.db.write() as conn:
            conn.execute(
                _replicas.delete().where(
                    _replicas.c.service_name == service_name, _replicas.c.name.not_in(names)
                )
            )

    def list(self, service_name: str | None = None) -> list[ReplicaRecord]:
        """The replicas (of one service), by name, with the leases each holds now."""
        with self.db.read() as session:
            return replica_records(session, service_name)


def replica_records(
    session: Session | Connection, service_name: str | None = None
) -> list[ReplicaRecord]:
    """The replicas (of one service), by name, with the leases each holds now, in the
    caller's transaction (ReplicaBook.list; the dashboard's reader for /metrics)."""
    leases = (
        select(func.count(_jobs.c.id))
        .where(
            _jobs.c.status.in_(sorted(status.value for status in LEASED_JOB_STATUSES)),
            _jobs.c.lease_owner == _replicas.c.owner,
        )
        .scalar_subquery()
    )
    query = select(_replicas, leases.label("leases")).order_by(_replicas.c.name)
    if service_name is not None:
        query = query.where(_replicas.c.service_name == service_name)
    return [ReplicaRecord(**row._mapping) for row in session.execute(query)]


def replica_name(service_name: str, index: int) -> str:
    """The Ray actor name of replica ``index``: the first one is the service itself."""
    return service_name if index == 0 else f"{service_name}-replica-{index}"
