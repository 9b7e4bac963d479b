"""The reporter's writes: runs and their attempts, report indices, and checkpoint
registrations (a checkpoint and its validation job in one transaction).

A thin layer over the catalog, the queue and their transitions; ``Registry.ledger``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.exc import IntegrityError

from validation_service import validation
from validation_service.errors import InvalidInput, RegistryRejected, ReportIndexTaken
from validation_service.jobs import RunStatus
from validation_service.metrics import normalize_metrics
from validation_service.registry import transitions
from validation_service.registry.catalog import Catalog, checkpoint_row
from validation_service.registry.database import Database, retry_on_disconnect
from validation_service.registry.models import utcnow
from validation_service.registry.queue import Queue
from validation_service.registry.records import Registration
from validation_service.registry.registration import insert_checkpoint_and_job
from validation_service.request import ValidationRequest


class Ledger:
    """What a reporting process writes: its run, the indices of its reports, their
    checkpoints and validation jobs."""

    def __init__(self, db: Database, catalog: Catalog, queue: Queue):
        self.db = db
        self.catalog = catalog
        self.queue = queue

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

        A run that ended (FINISHED or FAILED) gets a new attempt, with a warning, unless
        ``append``: then its last attempt is reopened and reports go on in it.
        """
        return self.catalog.ensure_run(name, storage_root=storage_root, tags=tags, append=append)

    @retry_on_disconnect
    def run_tags(self, name: str, namespace: str | None = None) -> dict[str, Any]:
        """The tags of the named run (of this namespace, or of ``namespace``); {} if none."""
        return self.catalog.run_tags(name, namespace)

    @retry_on_disconnect
    def tag_run(self, run_id: int, tags: dict[str, Any]) -> None:
        """Sets these tags of the run, keeping its others."""
        self.catalog.merge_run_tags(run_id, tags)

    @retry_on_disconnect
    def current_run_id(self, name: str, *, append: bool = False) -> int | None:
        """The attempt the run's next report goes to, if it exists: its latest attempt while
        RUNNING (also once ended, with ``append``); None when a new attempt is due."""
        return self.catalog.current_run_id(name, append=append)

    @retry_on_disconnect
    def next_attempt(self, name: str, *, append: bool = False) -> int:
        """The attempt the run's next report goes to (1 for a new run); writes nothing."""
        return self.catalog.next_attempt(name, append=append)

    @retry_on_disconnect
    def finish_run(
        self, run: str, status: RunStatus | str = RunStatus.FINISHED, *, attempt: int | None = None
    ) -> bool:
        """Ends the run's latest attempt (or ``attempt``) as FINISHED or FAILED.

        Returns False, changing nothing, when it had ended already. The run's name used
        again starts a new attempt (see ensure_run).
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
        return self.catalog.finish_run(run, status, attempt)

    # ------------------------------------------------------------ checkpoints
    @retry_on_disconnect
    def next_report_index(self, run_id: int) -> int:
        """The report index the run's next reservation gets; reserves nothing."""
        return self.catalog.next_report_index(run_id)

    @retry_on_disconnect
    def reserve_report_index(self, run_id: int) -> int:
        """Reserves a report index of the run for one report; never the same one twice.

        Every reporting process, however many report to the run, takes its indices
        here, before it copies the checkpoint into the folder named after the index.
        An index whose report is never registered (its copy failed, its process died)
        stays unused: indices only ever increase.
        """
        return self.catalog.reserve_report_index(run_id)

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
        """Registers a checkpoint and enqueues its validation in one transaction.

        Idempotent: the same report (run, report index and URI) registered again returns
        the rows made the first time. Another checkpoint at an index already taken
        raises ReportIndexTaken, registering nothing. ``report_index`` comes from
        reserve_report_index(); an index chosen by the caller moves the run's counter
        past it.
        """
        metrics = normalize_metrics(reported_metrics, what="reported metrics")
        validation.check_step(step)
        validation.check_epoch(epoch)
        now = utcnow()
        row = checkpoint_row(
            run_id, report_index, step, epoch, uri, size_bytes, manifest_sha256, metrics
        )
        row.update(created_at=now, validation_status=transitions.registered_status(job))
        try:
            # The common case is a new report: insert straight away and let the unique
            # constraints catch a repeated one.
            with self.db.write() as conn:
                checkpoint_id, job_id = insert_checkpoint_and_job(conn, self.catalog, row, job, now)
                if job is not None and job.coalesce == "latest":
                    transitions.cancel(
                        conn,
                        self.queue.queued_before(conn, run_id, report_index),
                        error_type="Coalesced",
                        message=f"skipped: report {report_index} of the run superseded it "
                        "(coalesce='latest')",
                        now=now,
                    )
                return Registration(run_id, checkpoint_id, job_id, created=True)
        except IntegrityError as exc:
            return self._registered_before(run_id, report_index, uri, exc)

    def _registered_before(
        self, run_id: int, report_index: int, uri: str, exc: IntegrityError
    ) -> Registration:
        """The same run + report index was registered before (or concurrently)."""
        with self.db.read() as session:
            existing = self.catalog.find_checkpoint(session, run_id, report_index)
            if existing is None:
                # Some other constraint (a run that is gone, say): not a repeat.
                raise RegistryRejected(self.db.display_url, exc) from exc
            checkpoint_id, existing_uri, run_name = existing
            if existing_uri != uri:
                raise ReportIndexTaken(run_name, report_index, uri, existing_uri) from None
            job_id = self.queue.find_job_id(session, run_id, report_index)
        return Registration(run_id, checkpoint_id, job_id, created=False)

    def import_checkpoints(self, run_id: int, checkpoints: Sequence[dict[str, Any]]) -> int:
        """Registers many already-stored checkpoints at once, without validation jobs.

        Each item has ``report_index``, ``uri`` and ``metrics``, and optionally
        ``size_bytes``, ``manifest_sha256``, ``step`` and ``epoch``. For bringing existing
        checkpoints into the registry; returns how many were added.
        """
        return self.catalog.import_checkpoints(run_id, checkpoints)

    def analyze(self) -> None:
        """Refreshes the planner's statistics (after a bulk import; autovacuum does it later)."""
        with self.db.autocommit() as conn:
            conn.exec_driver_sql("ANALYZE")
