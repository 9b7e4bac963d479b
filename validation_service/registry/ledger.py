"""The reporter's writes: runs and their attempts, report indices, and checkpoint
registrations (a checkpoint and its validation job, registration.py's statement).

``Ledger`` is what a reporting process opens (composition.open_report_writer); the
users' ``Registry.ledger`` is the same. Each method takes one transaction; the SQL is the
catalog's and registration.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from validation_service import validation
from validation_service.errors import InvalidInput, RegistryRejected, ReportIndexTaken
from validation_service.jobs import RunStatus
from validation_service.metrics import normalize_metrics
from validation_service.registry import queue, raw_sql, registration, transitions
from validation_service.registry.catalog import (
    NamespaceRoom,
    check_run_name,
    checkpoint_row,
)
from validation_service.registry.database import retry_on_disconnect
from validation_service.registry.models import RegistryIdentity, utcnow
from validation_service.registry.records import Registration
from validation_service.request import ValidationRequest

logger = logging.getLogger(__name__)


class Ledger(NamespaceRoom):
    """What a reporting process writes: its run, the indices of its reports, their
    checkpoints and validation jobs."""

    @retry_on_disconnect
    def registry_identity(self) -> str:
        """This registry's id (made by its migration): the same for every process that
        reports into this database, wherever it runs."""
        with self.db.read() as session:
            return session.execute(select(RegistryIdentity.id)).scalar_one()

    # ------------------------------------------------------------------- runs
    @retry_on_disconnect
    def ensure_run(
        self,
        name: str,
        *,
        storage_root: str,
        tags: dict[str, Any] | None = None,
        append: bool = False,
    ) -> int:
        """The id of the named run's current attempt in this namespace, created if needed.

        The latest attempt while it is RUNNING (a Ray Train run restarted after a worker
        failure goes on in it). A run that ended (FINISHED or FAILED) gets a new attempt,
        with a warning, unless ``append``: then its last attempt is reopened and reports
        go on in it. One write transaction (another when a concurrent reporter created
        the attempt first).
        """
        check_run_name(name)
        for _ in range(3):
            try:
                with self.db.write() as conn:
                    latest = self.catalog.latest_attempt(conn, name)
                    if latest is not None and latest.status == RunStatus.RUNNING.value:
                        return latest.id
                    if latest is not None and append:
                        self.catalog.reopen(conn, latest.id)
                        return latest.id
                    attempt = 1 if latest is None else latest.attempt + 1
                    run_id = self.catalog.insert_run(
                        conn, name, storage_root=storage_root, tags=tags, attempt=attempt
                    )
            except IntegrityError:
                continue  # another reporter created it first
            if latest is not None:
                logger.warning(
                    "run %r ended (%s) at %s; starting attempt %d; pass append=True / "
                    "--append (CKVAL_APPEND=1 inside Ray Train) to keep adding to attempt %d",
                    name,
                    latest.status,
                    latest.ended_at.isoformat() if latest.ended_at else "an unknown time",
                    attempt,
                    latest.attempt,
                )
            return run_id
        raise RuntimeError(f"could not create or find run {name!r}")

    @retry_on_disconnect
    def reporting_attempt(self, name: str, *, append: bool = False) -> tuple[int | None, int]:
        """Where the run's next report goes, read once and writing nothing: (the id of
        its latest attempt while RUNNING, else None; the attempt number: the latest's
        while RUNNING, also once ended with ``append``, else the next; 1 for a new run)."""
        with self.db.read() as session:
            latest = self.catalog.latest_attempt(session, name)
        if latest is None:
            return None, 1
        running = latest.status == RunStatus.RUNNING.value
        attempt = latest.attempt if running or append else latest.attempt + 1
        return (latest.id if running else None), attempt

    @retry_on_disconnect
    def run_tags(self, name: str, namespace: str | None = None) -> dict[str, Any]:
        """The tags of the named run (of this namespace, or of ``namespace``); {} if none."""
        with self.db.read() as session:
            return self.catalog.run_tags(session, name, namespace)

    @retry_on_disconnect
    def tag_run(self, run_id: int, tags: dict[str, Any]) -> None:
        """Sets these tags of the run, keeping its others."""
        with self.db.write() as conn:
            self.catalog.merge_run_tags(conn, run_id, tags)

    @retry_on_disconnect
    def finish_run(
        self, run: str, status: RunStatus | str = RunStatus.FINISHED, *, attempt: int | None = None
    ) -> bool:
        """Ends the run's latest attempt (or ``attempt``) as FINISHED or FAILED.

        Returns False, changing nothing, when it had ended already. RunNotFound when the
        run has no such attempt. The run's name used again starts a new attempt (see
        ensure_run).
        """
        try:
            status = RunStatus(status)
        except ValueError:
            status = None
        if status not in (RunStatus.FINISHED, RunStatus.FAILED):
            raise InvalidInput(
                f"a run ends as {RunStatus.FINISHED.value} or {RunStatus.FAILED.value}, "
                f"not {status!r}"
            )
        with self.db.write() as conn:
            run_id = self.catalog.require_run_id(conn, run, attempt)
            return self.catalog.end_run(conn, run_id, status)

    # ------------------------------------------------------------ checkpoints
    @retry_on_disconnect
    def next_report_index(self, run_id: int) -> int:
        """The report index the run's next reservation gets; reserves nothing."""
        with self.db.read() as session:
            return self.catalog.next_report_index(session, run_id)

    @retry_on_disconnect
    def reserve_report_index(self, run_id: int) -> int:
        """Reserves a report index of the run for one report; never the same one twice.

        Every reporting process, however many report to the run, takes its indices
        here, before it copies the checkpoint into the folder named after the index.
        An index whose report is never registered (its copy failed, its process died)
        stays unused: indices only ever increase. One statement.
        """
        with self.db.one_statement() as conn:
            return self.catalog.reserve_report_index(conn, run_id)

    @retry_on_disconnect
    def register_checkpoint(
        self,
        run_id: int,
        report_index: int,
        *,
        uri: str,
        size_bytes: int,
        manifest_sha256: str | None,
        reported_metrics: dict[str, Any],
        step: int | None = None,
        epoch: int | None = None,
        job: ValidationRequest | None = None,
    ) -> Registration:
        """Registers a checkpoint and enqueues its validation in one transaction (on
        PostgreSQL one statement, registration.py's).

        Idempotent: the same report (run, report index and URI) registered again returns
        the rows made the first time. Another checkpoint at an index already taken
        raises ReportIndexTaken, registering nothing. ``report_index`` comes from
        reserve_report_index(); an index chosen by the caller moves the run's counter
        past it.
        """
        row = registration_row(
            run_id,
            report_index,
            uri=uri,
            size_bytes=size_bytes,
            manifest_sha256=manifest_sha256,
            reported_metrics=reported_metrics,
            step=step,
            epoch=epoch,
            job=job,
        )
        try:
            # The common case is a new report: insert straight away and let the unique
            # constraints catch a repeated one.
            if job is None or job.coalesce != "latest":
                with self.db.one_statement() as conn:
                    checkpoint_id, job_id = registration.register(conn, row, job)
            else:
                with self.db.write() as conn:
                    checkpoint_id, job_id = register_in(conn, row, job)
        except IntegrityError as exc:
            return registered_before(self, run_id, report_index, uri, exc)
        return Registration(run_id, checkpoint_id, job_id, created=True)

    def import_checkpoints(self, run_id: int, checkpoints: Sequence[dict[str, Any]]) -> int:
        """Registers many already-stored checkpoints at once, without validation jobs.

        Each item has ``report_index``, ``uri`` and ``metrics``, and optionally
        ``size_bytes``, ``manifest_sha256``, ``step`` and ``epoch``. For bringing existing
        checkpoints into the registry; returns how many were added.
        """
        now = utcnow()
        rows = []
        for item in checkpoints:
            row = checkpoint_row(
                run_id,
                item["report_index"],
                item.get("step"),
                item.get("epoch"),
                item["uri"],
                item.get("size_bytes", 0),
                item.get("manifest_sha256"),
                normalize_metrics(item.get("metrics", {}), what="imported metrics"),
            )
            row.update(created_at=now, validation_status=transitions.registered_status(None))
            rows.append(row)
        if rows:
            with self.db.write() as conn:
                registration.import_rows(conn, run_id, rows)
        return len(rows)

    def analyze(self) -> None:
        """Refreshes the planner's statistics (after a bulk import; autovacuum does it later)."""
        with self.db.autocommit() as conn:
            conn.exec_driver_sql(raw_sql.ANALYZE)


def registration_row(run_id: int, report_index: int, **registered: Any) -> dict[str, Any]:
    """The checkpoints row of a report, its metrics, step and epoch checked, as
    registration.register writes it; ``registered``: Ledger.register_checkpoint's
    keyword arguments (``uri`` to ``job``)."""
    metrics = normalize_metrics(registered["reported_metrics"], what="reported metrics")
    step, epoch = registered.get("step"), registered.get("epoch")
    validation.check_step(step)
    validation.check_epoch(epoch)
    row = checkpoint_row(
        run_id,
        report_index,
        step,
        epoch,
        registered["uri"],
        registered["size_bytes"],
        registered["manifest_sha256"],
        metrics,
    )
    job = registered.get("job")
    row.update(created_at=utcnow(), validation_status=transitions.registered_status(job))
    return row


def register_in(
    conn: Connection, row: dict[str, Any], job: ValidationRequest | None
) -> tuple[int, int | None]:
    """registration.register in the caller's write transaction, and with
    ``coalesce="latest"`` the cancel of the run's older QUEUED jobs; returns (checkpoint
    id, job id or None)."""
    checkpoint_id, job_id = registration.register(conn, row, job)
    if job is not None and job.coalesce == "latest":
        run_id, report_index = row["run_id"], row["report_index"]
        transitions.cancel(
            conn,
            queue.queued_before(conn, run_id, report_index),
            error_type="Coalesced",
            message=f"skipped: report {report_index} of the run superseded it (coalesce='latest')",
            now=row["created_at"],
        )
    return checkpoint_id, job_id


def registered_before(
    room: NamespaceRoom,
    run_id: int,
    report_index: int,
    uri: str,
    exc: IntegrityError | None = None,
) -> Registration:
    """The registration of a report made before (or concurrently) at the same run and
    report index, when it is this report (the same URI); ReportIndexTaken when another
    checkpoint holds the index; RegistryRejected when ``exc`` (the insert's error) was
    no repeat at all."""
    with room.db.read() as session:
        existing = room.catalog.find_checkpoint(session, run_id, report_index)
        if existing is None:
            # Some other constraint (a run that is gone, say): not a repeat.
            cause = exc or LookupError(f"no checkpoint at report index {report_index}")
            raise RegistryRejected(room.db.display_url, cause) from exc
        checkpoint_id, existing_uri, run_name = existing
        if existing_uri != uri:
            raise ReportIndexTaken(run_name, report_index, uri, existing_uri) from None
        job_id = queue.find_job_id(session, run_id, report_index)
    return Registration(run_id, checkpoint_id, job_id, created=False)
