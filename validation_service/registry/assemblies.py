"""Checkpoints written by several ranks: the assembly of one report's parts, and when it
may become a checkpoint.

Every rank of a sharded save (FSDP, DeepSpeed, torch.distributed.checkpoint) reports its
own folder. The ranks of one report share a group key (their worker group and the
report's call number); the first to ask reserves the report index, and each stores its
files as one part of that index's folder. Once every rank of the report has stored its
part, the lowest rank seals the assembly: the parts become one folder, registered as
one checkpoint with its validation. Until then nothing lists, ranks or validates it; an
assembly whose part never comes (its rank died) ends INCOMPLETE, and retention removes
its files.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable
from typing import Any, NamedTuple

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from validation_service.jobs import AssemblyStatus, RunStatus
from validation_service.registry.catalog import NamespaceRoom
from validation_service.registry.database import retry_on_disconnect
from validation_service.registry.models import CheckpointAssembly, CheckpointPart, Run, utcnow

_OPEN = (AssemblyStatus.ASSEMBLING.value, AssemblyStatus.SEALING.value)


class Slot(NamedTuple):
    """Where one report's parts go: its report index first (as a reservation is)."""

    report_index: int
    uri: str
    assembly_id: int


@dataclasses.dataclass(frozen=True)
class PartRecord:
    """One rank's stored part: its files (relative path -> size and digest) at
    ``location``; for a folder registered in place (NO_UPLOAD), the files of it that
    this rank hashed (its own shards), or None."""

    rank: int
    location: str
    files: dict[str, Any] | None
    size_bytes: int
    reported_metrics: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class AssemblyRecord:
    """An assembly as users see it: which report, where, how far it got, and why not."""

    run: str
    report_index: int
    uri: str
    status: AssemblyStatus
    detail: str | None
    ranks: list[int]
    created_at: dt.datetime
    ended_at: dt.datetime | None
    deleted_at: dt.datetime | None


class Assemblies(NamespaceRoom):
    """The reporter's side of multi-rank checkpoints (composition.open_report_writer;
    ``Registry.assemblies`` too); each method takes one transaction."""

    @retry_on_disconnect
    def join(self, run_id: int, group_key: str, uri_of: Callable[[int], str]) -> Slot:
        """The slot of the report ``group_key`` of the run, reserved by the first rank
        that asks (a new report index, its folder named by ``uri_of(index)``). One write
        transaction: the slot found, or the index reserved and the slot added."""
        try:
            with self.db.write() as conn:
                found = _slot(conn, run_id, group_key)
                if found is not None:
                    return found
                index = self.catalog.reserve_report_index(conn, run_id)
                assembly_id = conn.execute(
                    insert(CheckpointAssembly)
                    .values(
                        run_id=run_id,
                        group_key=group_key,
                        report_index=index,
                        uri=uri_of(index),
                        status=AssemblyStatus.ASSEMBLING.value,
                        created_at=utcnow(),
                    )
                    .returning(CheckpointAssembly.id)
                ).scalar_one()
            return Slot(index, uri_of(index), assembly_id)
        except IntegrityError:
            # Another rank added it meanwhile (PostgreSQL): its slot wins, and this
            # transaction's reservation was rolled back with it.
            with self.db.read() as session:
                found = _slot(session, run_id, group_key)
            if found is None:
                raise
            return found

    @retry_on_disconnect
    def add_part(self, assembly_id: int, part: PartRecord) -> None:
        """Records one rank's stored part; the same rank again changes nothing."""
        values = dataclasses.asdict(part)
        try:
            with self.db.write() as conn:
                conn.execute(
                    insert(CheckpointPart).values(
                        assembly_id=assembly_id, registered_at=utcnow(), **values
                    )
                )
        except IntegrityError:
            if not any(p.rank == part.rank for p in self.parts(assembly_id)):
                raise

    @retry_on_disconnect
    def parts(self, assembly_id: int) -> list[PartRecord]:
        """The parts stored so far, lowest rank first."""
        with self.db.read() as session:
            return _parts(session, assembly_id)

    def begin_sealing(self, assembly_id: int) -> list[PartRecord] | None:
        """Takes the assembly from ASSEMBLING to SEALING and returns its parts; None when
        it is not ASSEMBLING (another rank seals it, or it ended)."""
        with self.db.write() as conn:
            taken = conn.execute(
                update(CheckpointAssembly)
                .where(
                    CheckpointAssembly.id == assembly_id,
                    CheckpointAssembly.status == AssemblyStatus.ASSEMBLING.value,
                )
                .values(status=AssemblyStatus.SEALING.value)
            ).rowcount
            return _parts(conn, assembly_id) if taken == 1 else None

    @retry_on_disconnect
    def end(self, assembly_id: int, status: AssemblyStatus, detail: str | None = None) -> None:
        """Ends a SEALING or ASSEMBLING assembly as COMPLETE or INCOMPLETE."""
        with self.db.write() as conn:
            conn.execute(
                update(CheckpointAssembly)
                .where(CheckpointAssembly.id == assembly_id, CheckpointAssembly.status.in_(_OPEN))
                .values(status=status.value, detail=detail, ended_at=utcnow())
            )

    @retry_on_disconnect
    def give_up_other_groups(self, run_id: int, group_prefix: str) -> int:
        """Ends as INCOMPLETE the run's open assemblies of other worker groups: once a
        report of this group is sealed, an earlier group's missing parts never come
        (its workers were replaced). Returns how many ended."""
        return self._give_up(
            "a rank's part never came: its worker group was replaced",
            CheckpointAssembly.run_id == run_id,
            ~CheckpointAssembly.group_key.startswith(group_prefix, autoescape=True),
        )

    @retry_on_disconnect
    def give_up_ended_runs(self, run_ids: list[int] | None = None) -> int:
        """Ends as INCOMPLETE the open assemblies of runs that ended (FINISHED or FAILED):
        no rank of theirs reports any more."""
        ended = select(Run.id).where(Run.status != RunStatus.RUNNING.value)
        if run_ids is not None:
            ended = ended.where(Run.id.in_(run_ids))
        return self._give_up(
            "a rank's part never came: the run ended first",
            CheckpointAssembly.run_id.in_(ended),
        )

    def _give_up(self, detail: str, *where: Any) -> int:
        """Ends as INCOMPLETE, with ``detail``, the open assemblies ``where`` selects."""
        with self.db.write() as conn:
            return conn.execute(
                update(CheckpointAssembly)
                .where(*where, CheckpointAssembly.status.in_(_OPEN))
                .values(status=AssemblyStatus.INCOMPLETE.value, detail=detail, ended_at=utcnow())
            ).rowcount

    @retry_on_disconnect
    def incomplete_to_delete(self, run_ids: list[int] | None = None) -> list[tuple]:
        """(assembly id, folder URI, run name, namespace, storage root) of INCOMPLETE
        assemblies whose files are still there."""
        table = CheckpointAssembly
        query = (
            select(table.id, table.uri, Run.name, Run.namespace, Run.storage_root)
            .join(Run, Run.id == table.run_id)
            .where(table.status == AssemblyStatus.INCOMPLETE.value, table.deleted_at.is_(None))
        )
        if run_ids is not None:
            query = query.where(table.run_id.in_(run_ids))
        with self.db.read() as session:
            return [tuple(row) for row in session.execute(query).all()]

    @retry_on_disconnect
    def mark_deleted(self, assembly_id: int) -> None:
        with self.db.write() as conn:
            conn.execute(
                update(CheckpointAssembly)
                .where(CheckpointAssembly.id == assembly_id)
                .values(deleted_at=utcnow())
            )


def not_complete(session: Session, run_ids: list[int]) -> list[AssemblyRecord]:
    """The assemblies of these run attempts that are not (yet) a checkpoint (a user's
    read: Registry.incomplete_checkpoints)."""
    table = CheckpointAssembly
    rows = session.execute(
        select(table, Run.name)
        .join(Run, Run.id == table.run_id)
        .where(table.run_id.in_(run_ids), table.status != AssemblyStatus.COMPLETE.value)
        .order_by(table.run_id, table.report_index)
    ).all()
    ranks = _ranks(session, [row[0].id for row in rows])
    return [
        AssemblyRecord(
            run=name,
            report_index=row.report_index,
            uri=row.uri,
            status=AssemblyStatus(row.status),
            detail=row.detail,
            ranks=ranks.get(row.id, []),
            created_at=row.created_at,
            ended_at=row.ended_at,
            deleted_at=row.deleted_at,
        )
        for row, name in rows
    ]


def _slot(conn: Connection | Session, run_id: int, group_key: str) -> Slot | None:
    table = CheckpointAssembly
    row = conn.execute(
        select(table.report_index, table.uri, table.id).where(
            table.run_id == run_id, table.group_key == group_key
        )
    ).first()
    return None if row is None else Slot(*row)


def _parts(conn: Connection | Session, assembly_id: int) -> list[PartRecord]:
    table = CheckpointPart
    rows = conn.execute(
        select(table.rank, table.location, table.files, table.size_bytes, table.reported_metrics)
        .where(table.assembly_id == assembly_id)
        .order_by(table.rank)
    ).all()
    return [PartRecord(*row) for row in rows]


def _ranks(session, assembly_ids: list[int]) -> dict[int, list[int]]:
    if not assembly_ids:
        return {}
    found: dict[int, list[int]] = {}
    rows = session.execute(
        select(CheckpointPart.assembly_id, CheckpointPart.rank)
        .where(CheckpointPart.assembly_id.in_(assembly_ids))
        .order_by(CheckpointPart.rank)
    ).all()
    for assembly_id, rank in rows:
        found.setdefault(assembly_id, []).append(rank)
    return found
