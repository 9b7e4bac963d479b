"""Checkpoints written by several ranks: the assembly of one report's parts, and when it
may become a checkpoint.

In a worker group of several ranks every report() call has a key, the same on each rank
(the worker group and the call's number), and each rank moves its progress on at each
call, with or without a checkpoint. A rank that reports a folder (a sharded save: FSDP,
DeepSpeed, torch.distributed.checkpoint; or rank 0's whole checkpoint) joins the call's
assembly first, in the same transaction: the first to join reserves the report index,
and each stores its files into that index's folder as its part. Once every rank of the
worker group has reported past the call and every rank that joined has stored its part,
the lowest rank with a part seals the assembly: the parts become one folder, registered
as one checkpoint with its validation in one transaction with the assembly's end
(``seal``): a checkpoint row exists only for a COMPLETE assembly. Until then nothing
lists, ranks or validates it. An assembly with a failed part, or whose rank never comes
(it died), ends INCOMPLETE, and retention removes its files, never a folder a checkpoint
row uses. Nothing here waits for another rank: ranks learn of
each other through these rows, never through a collective.

An open assembly is given up only once no part has been stored in it for
ASSEMBLY_LEASE_S (its seal begins right after its last part), except one still
ASSEMBLING in an older worker group of the run, given up by the seal of a newer group's
report (those ranks were replaced).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable
from typing import Any, NamedTuple

from sqlalchemy import and_, insert, or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from validation_service.errors import AssemblyGivenUp
from validation_service.jobs import AssemblyStatus, PartStatus, RunStatus
from validation_service.registry import ledger
from validation_service.registry.catalog import NamespaceRoom
from validation_service.registry.database import retry_on_disconnect
from validation_service.registry.models import (
    CheckpointAssembly,
    CheckpointPart,
    ReportProgress,
    Run,
    utcnow,
)
from validation_service.registry.records import Registration, ReportCall
from validation_service.registry.retention import used_folders

_OPEN = (AssemblyStatus.ASSEMBLING.value, AssemblyStatus.SEALING.value)
# How long an open assembly stays open with no part stored since (its last part comes
# right before its seal begins): a run that ended, or a newer worker group's seal, gives
# it up only after that. A seal that comes later is refused (AssemblyGivenUp).
ASSEMBLY_LEASE_S = 3600.0


class Slot(NamedTuple):
    """Where one report's parts go: its report index first (as a reservation is)."""

    report_index: int
    uri: str
    assembly_id: int


@dataclasses.dataclass(frozen=True)
class PartRecord:
    """One rank's part: its stored files (relative path -> size and digest) at
    ``location``, or, for a folder registered in place (NO_UPLOAD), the files of it this
    rank hashed (its own shards); a part that failed (``detail`` says why); or one still
    being stored (PENDING). ``reported_metrics`` are the rank's own: the checkpoint keeps
    the lowest rank's."""

    rank: int
    location: str | None
    files: dict[str, Any] | None
    size_bytes: int
    reported_metrics: dict[str, Any]
    status: PartStatus = PartStatus.STORED
    detail: str | None = None

    @classmethod
    def failed(cls, rank: int, metrics: dict[str, Any], detail: str) -> PartRecord:
        """A rank whose part could not be stored: the report stays INCOMPLETE."""
        return cls(rank, None, None, 0, metrics, PartStatus.FAILED, detail)


@dataclasses.dataclass(frozen=True)
class Standing:
    """Where one call's assembly stands: its status, the parts so far (lowest rank
    first), and the ranks of the worker group that have not reported past the call."""

    status: AssemblyStatus
    parts: list[PartRecord]
    behind: list[int]

    @property
    def settled(self) -> bool:
        """Every rank reported past the call and every part that joined arrived."""
        return not self.behind and all(p.status is not PartStatus.PENDING for p in self.parts)

    @property
    def stored(self) -> list[PartRecord]:
        return [p for p in self.parts if p.status is PartStatus.STORED]

    @property
    def failed(self) -> list[PartRecord]:
        return [p for p in self.parts if p.status is PartStatus.FAILED]


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
    def join(self, run_id: int, report: ReportCall, uri_of: Callable[[int], str]) -> Slot:
        """A rank with a part at ``report``: moves its progress on and joins the call's
        slot, reserved by the first rank that joins (a new report index, its folder
        named by ``uri_of(index)``). One write transaction."""
        try:
            with self.db.write() as conn:
                _advance(conn, run_id, report)
                found = _slot(conn, run_id, report.group_key)
                if found is not None:
                    _pending(conn, found.assembly_id, report.rank)
                    return found
                index = self.catalog.reserve_report_index(conn, run_id)
                assembly_id = conn.execute(
                    insert(CheckpointAssembly)
                    .values(
                        run_id=run_id,
                        group_key=report.group_key,
                        report_index=index,
                        uri=uri_of(index),
                        status=AssemblyStatus.ASSEMBLING.value,
                        world_size=report.world_size,
                        created_at=utcnow(),
                    )
                    .returning(CheckpointAssembly.id)
                ).scalar_one()
                _pending(conn, assembly_id, report.rank)
            return Slot(index, uri_of(index), assembly_id)
        except IntegrityError:
            # Another rank added it meanwhile (PostgreSQL): its slot wins, and this
            # transaction's reservation was rolled back with it. Join it.
            return self.join(run_id, report, uri_of)

    @retry_on_disconnect
    def advance(self, run_id: int, report: ReportCall) -> None:
        """A rank without a part at ``report``: moves its progress on (one transaction)."""
        with self.db.write() as conn:
            _advance(conn, run_id, report)

    @retry_on_disconnect
    def arrive(self, assembly_id: int, part: PartRecord) -> bool:
        """Records the part that ``part.rank`` joined with (stored or failed) while the
        assembly is ASSEMBLING; again changes nothing. Returns False when the assembly
        ended or is being sealed: a late part is never added to a sealed checkpoint."""
        values = dataclasses.asdict(part)
        del values["rank"]
        values["status"] = part.status.value
        table = CheckpointPart
        with self.db.write() as conn:
            if _status(conn, assembly_id, lock=True) is not AssemblyStatus.ASSEMBLING:
                return False
            conn.execute(
                update(table)
                .where(
                    table.assembly_id == assembly_id,
                    table.rank == part.rank,
                    table.status == PartStatus.PENDING.value,
                )
                .values(registered_at=utcnow(), **values)
            )
            return True

    @retry_on_disconnect
    def standing(self, run_id: int, assembly_id: int, report: ReportCall) -> Standing:
        """Where ``report``'s assembly stands (one read): its status, its parts, and the
        ranks of the worker group still behind the call."""
        with self.db.read() as session:
            status = session.execute(
                select(CheckpointAssembly.status).where(CheckpointAssembly.id == assembly_id)
            ).scalar_one()
            reached = dict(
                session.execute(
                    select(ReportProgress.rank, ReportProgress.last_call).where(
                        ReportProgress.run_id == run_id,
                        ReportProgress.worker_group == report.worker_group,
                    )
                ).all()
            )
            behind = [
                rank for rank in range(report.world_size) if reached.get(rank, 0) < report.call
            ]
            return Standing(AssemblyStatus(status), _parts(session, assembly_id), behind)

    def begin_sealing(self, assembly_id: int) -> list[PartRecord] | None:
        """Takes the assembly from ASSEMBLING to SEALING and returns its stored parts; None
        when it is not ASSEMBLING (another rank seals it, or it ended)."""
        with self.db.write() as conn:
            taken = conn.execute(
                update(CheckpointAssembly)
                .where(
                    CheckpointAssembly.id == assembly_id,
                    CheckpointAssembly.status == AssemblyStatus.ASSEMBLING.value,
                )
                .values(status=AssemblyStatus.SEALING.value)
            ).rowcount
            if taken != 1:
                return None
            return [p for p in _parts(conn, assembly_id) if p.status is PartStatus.STORED]

    @retry_on_disconnect
    def seal(
        self,
        assembly_id: int,
        run_id: int,
        report_index: int,
        *,
        detail: str | None = None,
        group_prefix: str | None = None,
        **registered: Any,
    ) -> Registration:
        """Registers the checkpoint of a SEALING assembly (``registered``: the ledger's
        register_checkpoint arguments, uri to job) and ends the assembly COMPLETE with
        ``detail``, in one write transaction; the run's open assemblies of other worker
        groups than ``group_prefix`` end INCOMPLETE in it (see give_up_other_groups).

        Raises AssemblyGivenUp, registering nothing, when the assembly is no longer
        SEALING (it was given up); the same seal repeated (its first commit's answer
        lost) returns the first registration.
        """
        row = ledger.registration_row(run_id, report_index, **registered)
        try:
            with self.db.write() as conn:
                sealed = _complete(conn, assembly_id, detail)
                if sealed:
                    checkpoint_id, job_id = ledger.register_in(conn, row, registered.get("job"))
                    if group_prefix is not None:
                        _give_up(conn, *_other_groups(run_id, group_prefix, _lease_cutoff()))
                else:
                    status, why, run = _state(conn, assembly_id)
        except IntegrityError as exc:  # another checkpoint holds the index: nothing changed
            return ledger.registered_before(self, run_id, report_index, row["uri"], exc)
        if sealed:
            return Registration(run_id, checkpoint_id, job_id, created=True)
        if status == AssemblyStatus.COMPLETE.value:  # this seal's first try committed
            return ledger.registered_before(self, run_id, report_index, row["uri"])
        raise AssemblyGivenUp(run, report_index, why)

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
    def give_up_other_groups(
        self, run_id: int, group_prefix: str, *, idle_s: float = ASSEMBLY_LEASE_S
    ) -> int:
        """Ends as INCOMPLETE the run's open assemblies of other worker groups: once a
        report of this group is sealed, an earlier group's missing parts never come
        (its workers were replaced). One being sealed (SEALING) is left to its sealer
        until it has been idle for ``idle_s``. Returns how many ended."""
        with self.db.write() as conn:
            return _give_up(conn, *_other_groups(run_id, group_prefix, _lease_cutoff(idle_s)))

    @retry_on_disconnect
    def give_up_ended_runs(
        self, run_ids: list[int] | None = None, *, idle_s: float = ASSEMBLY_LEASE_S
    ) -> int:
        """Ends as INCOMPLETE the open assemblies of this namespace's runs that ended
        (FINISHED or FAILED; only ``run_ids`` when given) once they have been idle for
        ``idle_s``: a rank may still store its part, and its seal come, for a while after
        the run was ended. Returns how many ended."""
        ended = select(Run.id).where(
            Run.status != RunStatus.RUNNING.value, Run.namespace == self.catalog.namespace
        )
        if run_ids is not None:
            ended = ended.where(Run.id.in_(run_ids))
        with self.db.write() as conn:
            return _give_up(
                conn,
                "a rank's part never came: the run ended first",
                CheckpointAssembly.run_id.in_(ended),
                _idle_since(_lease_cutoff(idle_s)),
            )

    @retry_on_disconnect
    def open_group_keys(self) -> dict[int, str]:
        """Assembly id -> group key (ReportCall.group_key) of this namespace's open
        assemblies: the scheduler asks Ray whether their worker groups still live."""
        table = CheckpointAssembly
        query = (
            select(table.id, table.group_key)
            .join(Run, Run.id == table.run_id)
            .where(table.status.in_(_OPEN), Run.namespace == self.catalog.namespace)
        )
        with self.db.read() as session:
            return {row.id: row.group_key for row in session.execute(query).all()}

    @retry_on_disconnect
    def give_up_ended_groups(self, assembly_ids: list[int]) -> int:
        """Ends as INCOMPLETE these open assemblies, whose worker group ended (Ray removed
        its placement group, and with it every rank that could still store a part or
        seal). Returns how many ended."""
        if not assembly_ids:
            return 0
        with self.db.write() as conn:
            return _give_up(
                conn,
                "a rank's part never came: its worker group ended first (stopped, "
                "preempted or failed)",
                CheckpointAssembly.id.in_(assembly_ids),
            )

    @retry_on_disconnect
    def incomplete_to_delete(self, run_ids: list[int] | None = None) -> list[tuple]:
        """(assembly id, folder URI, run name, namespace, storage root) of this
        namespace's INCOMPLETE assemblies whose files are still there, less those whose
        folder a checkpoint record uses (its URI is the folder, lies in it or holds it)."""
        table = CheckpointAssembly
        query = (
            select(table.id, table.uri, Run.name, Run.namespace, Run.storage_root)
            .join(Run, Run.id == table.run_id)
            .where(
                table.status == AssemblyStatus.INCOMPLETE.value,
                table.deleted_at.is_(None),
                Run.namespace == self.catalog.namespace,
            )
        )
        if run_ids is not None:
            query = query.where(table.run_id.in_(run_ids))
        with self.db.read() as session:
            found = [tuple(row) for row in session.execute(query).all()]
            used = used_folders(session, [row[1] for row in found])
        return [row for row in found if row[1].rstrip("/") not in used]

    @retry_on_disconnect
    def mark_deleted(self, assembly_id: int) -> None:
        with self.db.write() as conn:
            conn.execute(
                update(CheckpointAssembly)
                .where(CheckpointAssembly.id == assembly_id)
                .values(deleted_at=utcnow())
            )


def _lease_cutoff(idle_s: float = ASSEMBLY_LEASE_S) -> dt.datetime:
    return utcnow() - dt.timedelta(seconds=idle_s)


def _idle_since(cutoff: dt.datetime) -> Any:
    """The assemblies made before ``cutoff`` with no part stored since."""
    table, parts = CheckpointAssembly, CheckpointPart
    recent = select(parts.assembly_id).where(
        parts.assembly_id == table.id, parts.registered_at >= cutoff
    )
    return and_(table.created_at < cutoff, ~recent.exists())


def _other_groups(run_id: int, group_prefix: str, cutoff: dt.datetime) -> tuple:
    """give_up_other_groups' detail and conditions: the run's open assemblies of other
    worker groups, those being sealed only once idle since ``cutoff``."""
    table = CheckpointAssembly
    return (
        "a rank's part never came: its worker group was replaced",
        table.run_id == run_id,
        ~table.group_key.startswith(group_prefix, autoescape=True),
        or_(table.status == AssemblyStatus.ASSEMBLING.value, _idle_since(cutoff)),
    )


def _give_up(conn: Connection, detail: str, *where: Any) -> int:
    """Ends as INCOMPLETE, with ``detail``, the open assemblies ``where`` selects."""
    return conn.execute(
        update(CheckpointAssembly)
        .where(*where, CheckpointAssembly.status.in_(_OPEN))
        .values(status=AssemblyStatus.INCOMPLETE.value, detail=detail, ended_at=utcnow())
    ).rowcount


def _state(conn: Connection, assembly_id: int) -> tuple[str, str | None, str]:
    """(status, detail, run name) of an assembly."""
    table = CheckpointAssembly
    return tuple(
        conn.execute(
            select(table.status, table.detail, Run.name)
            .join(Run, Run.id == table.run_id)
            .where(table.id == assembly_id)
        ).one()
    )


def _complete(conn: Connection, assembly_id: int, detail: str | None) -> bool:
    """SEALING -> COMPLETE, in the seal's transaction (on PostgreSQL the row stays locked
    to its end, so that a give-up waits and then finds it COMPLETE); False when it was
    not SEALING."""
    table = CheckpointAssembly
    return (
        conn.execute(
            update(table)
            .where(table.id == assembly_id, table.status == AssemblyStatus.SEALING.value)
            .values(status=AssemblyStatus.COMPLETE.value, detail=detail, ended_at=utcnow())
        ).rowcount
        == 1
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


def _advance(conn: Connection, run_id: int, report: ReportCall) -> None:
    """Moves the rank's progress in its worker group on to ``report.call``."""
    table = ReportProgress
    mine = (
        table.run_id == run_id,
        table.worker_group == report.worker_group,
        table.rank == report.rank,
    )
    moved = conn.execute(
        update(table)
        .where(*mine, table.last_call < report.call)
        .values(last_call=report.call, updated_at=utcnow())
    ).rowcount
    if moved == 0 and conn.execute(select(table.last_call).where(*mine)).first() is None:
        conn.execute(
            insert(table).values(
                run_id=run_id,
                worker_group=report.worker_group,
                rank=report.rank,
                last_call=report.call,
                updated_at=utcnow(),
            )
        )


def _pending(conn: Connection, assembly_id: int, rank: int) -> None:
    """The rank joined the assembly with a part it is storing (joining again changes
    nothing)."""
    mine = (CheckpointPart.assembly_id == assembly_id, CheckpointPart.rank == rank)
    if conn.execute(select(CheckpointPart.status).where(*mine)).first() is None:
        conn.execute(
            insert(CheckpointPart).values(
                assembly_id=assembly_id,
                rank=rank,
                status=PartStatus.PENDING.value,
                files=None,
                size_bytes=0,
                reported_metrics={},
                registered_at=utcnow(),
            )
        )


def _status(conn: Connection, assembly_id: int, *, lock: bool = False) -> AssemblyStatus | None:
    """The assembly's status; ``lock`` holds its row until the transaction ends
    (PostgreSQL; SQLite's write transaction holds the whole database)."""
    query = select(CheckpointAssembly.status).where(CheckpointAssembly.id == assembly_id)
    status = conn.execute(query.with_for_update() if lock else query).scalar_one_or_none()
    return None if status is None else AssemblyStatus(status)


def _parts(conn: Connection | Session, assembly_id: int) -> list[PartRecord]:
    table = CheckpointPart
    rows = conn.execute(
        select(
            table.rank,
            table.location,
            table.files,
            table.size_bytes,
            table.reported_metrics,
            table.status,
            table.detail,
        )
        .where(table.assembly_id == assembly_id)
        .order_by(table.rank)
    ).all()
    return [PartRecord(*row[:5], PartStatus(row.status), row.detail) for row in rows]


def _ranks(session, assembly_ids: list[int]) -> dict[int, list[int]]:
    if not assembly_ids:
        return {}
    found: dict[int, list[int]] = {}
    rows = session.execute(
        select(CheckpointPart.assembly_id, CheckpointPart.rank)
        .where(
            CheckpointPart.assembly_id.in_(assembly_ids),
            CheckpointPart.status == PartStatus.STORED.value,
        )
        .order_by(CheckpointPart.rank)
    ).all()
    for assembly_id, rank in rows:
        found.setdefault(assembly_id, []).append(rank)
    return found
