"""Registry: the facade over the catalog and the queue, the only entry to the database.

It opens one transaction where the catalog and the queue change together (a registration
is a checkpoint and its job; an outcome is the job's finish and the metrics' merge), asks
the retry policy what a failure leads to, and turns records into Ray checkpoints.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy.exc import IntegrityError

from validation_service.config import Settings, get_settings
from validation_service.errors import InvalidInput, UnknownMetric
from validation_service.jobs import JobStatus, ValidationStatus
from validation_service.metrics import normalize_metrics
from validation_service.registry import stats, transitions
from validation_service.registry.catalog import Catalog, Mode, checkpoint_row
from validation_service.registry.database import Database, retry_on_disconnect
from validation_service.registry.models import utcnow
from validation_service.registry.queue import Queue
from validation_service.registry.records import (
    CheckpointRecord,
    ClaimedJob,
    JobOutcome,
    JobRecord,
    Registration,
    RunRecord,
    RunSummary,
)
from validation_service.registry.registration import insert_checkpoint_and_job
from validation_service.request import ValidationRequest
from validation_service.retry import AttemptBudget, RetryPolicy

logger = logging.getLogger(__name__)

RETRYABLE_STATUSES = (JobStatus.FAILED, JobStatus.TIMED_OUT, JobStatus.CANCELLED)


class Registry:
    """Durable checkpoint registry and validation queue over SQLite or PostgreSQL.

    ``Registry()`` opens the configured default (``CKVAL_DATABASE_URL``, else the
    embedded SQLite under ``CKVAL_HOME``). An embedded SQLite file is created and
    migrated on first use; a server database is migrated with ``ckval db upgrade``.
    """

    def __init__(
        self,
        database_url: str | None = None,
        *,
        namespace: str | None = None,
        settings: Settings | None = None,
        upgrade: bool | None = None,
        check_schema: bool = True,
    ):
        self.settings = settings or get_settings()
        self.url = database_url or self.settings.resolved_database_url()
        self.namespace = namespace or self.settings.namespace
        self.db = Database(self.url)
        self.engine = self.db.engine
        self.catalog = Catalog(self.db, self.namespace)
        self.queue = Queue(self.db)
        # Decides what a failure leads to when the caller (the scheduler) brings no policy.
        self.retry_policy = RetryPolicy.from_settings(self.settings)
        if check_schema:
            self.db.check_schema(self.db.is_sqlite() if upgrade is None else upgrade)

    # ----------------------------------------------------------------- schema
    def upgrade(self, revision: str = "head") -> None:
        self.db.upgrade(revision)

    def downgrade(self, revision: str) -> None:
        self.db.downgrade(revision)

    def schema_revision(self) -> str | None:
        return self.db.schema_revision()

    @property
    def display_url(self) -> str:
        """The database URL with its password hidden."""
        return self.db.display_url

    def close(self) -> None:
        self.db.close()

    def __repr__(self) -> str:
        return f"Registry({self.display_url!r}, namespace={self.namespace!r})"

    # ------------------------------------------------------------------- runs
    @retry_on_disconnect
    def ensure_run(
        self, name: str, *, storage_root: str, tags: dict[str, Any] | None = None
    ) -> int:
        """Returns the id of the named run in this namespace, creating it if needed."""
        return self.catalog.ensure_run(name, storage_root=storage_root, tags=tags)

    @retry_on_disconnect
    def find_run_id(self, name: str) -> int | None:
        """The id of the named run in this namespace, or None; writes nothing."""
        return self.catalog.find_run_id(name)

    @retry_on_disconnect
    def runs(self) -> list[RunRecord]:
        with self.db.read() as session:
            return self.catalog.runs(session)

    @retry_on_disconnect
    def run_summaries(self) -> list[RunSummary]:
        """Every run with its checkpoint count and job counts, in three queries."""
        with self.db.read() as session:
            runs = self.catalog.runs(session)
            checkpoints = self.catalog.checkpoint_counts(session)
            jobs = self.queue.job_counts_by_run(session, self.namespace)
        return [RunSummary(run, checkpoints.get(run.id, 0), jobs.get(run.id, {})) for run in runs]

    # ------------------------------------------------------------ checkpoints
    @retry_on_disconnect
    def next_report_index(self, run_id: int) -> int:
        return self.catalog.next_report_index(run_id)

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

        Idempotent: the same run + report index returns the rows made the first time.
        """
        metrics = normalize_metrics(reported_metrics, what="reported metrics")
        if job is not None and job.max_attempts < 1:
            raise InvalidInput(f"max_attempts must be at least 1, got {job.max_attempts}")
        now = utcnow()
        status = ValidationStatus.PENDING if job else ValidationStatus.NONE
        row = checkpoint_row(
            run_id, report_index, step, epoch, uri, size_bytes, manifest_sha256, metrics
        )
        row.update(created_at=now, validation_status=status.value)
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
        except IntegrityError:
            # The same run + report index was registered before (or concurrently).
            with self.db.read() as session:
                checkpoint_id = self.catalog.find_checkpoint_id(session, run_id, report_index)
                if checkpoint_id is None:
                    raise
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

    @retry_on_disconnect
    def checkpoints(self, run: str, *, include_deleted: bool = False) -> list[CheckpointRecord]:
        return self.catalog.checkpoints(run, include_deleted=include_deleted)

    @retry_on_disconnect
    def latest_checkpoint(self, run: str):
        """The newest checkpoint of the run as a ray.train.Checkpoint (resume after a crash)."""
        record = self.catalog.latest(run)
        return None if record is None else self._ray_checkpoint(record)

    def best_checkpoints(
        self, run: str | None, metric: str, mode: Mode = "max", k: int = 1
    ) -> list[tuple[Any, dict[str, Any]]]:
        """Top-k checkpoints by a metric: [(ray.train.Checkpoint, metrics), ...].

        Uses the merged metrics (a validated value overrides a reported one of the same
        name). NaN and infinite values are never ranked. Ties go to the earlier report.
        """
        return [
            (self._ray_checkpoint(record), record.metrics)
            for record in self.best_checkpoint_records(run, metric, mode, k)
        ]

    @retry_on_disconnect
    def best_checkpoint_records(
        self, run: str | None, metric: str, mode: Mode = "max", k: int = 1
    ) -> list[CheckpointRecord]:
        with self.db.read() as session:
            records = self.catalog.best(session, run, metric, mode, k)
            if records:
                return records
            run_id = self.catalog.require_run_id(session, run) if run is not None else None
            known = self.catalog.known_metrics(session, run_id)
            # Recorded only as NaN/inf or non-numeric values, or perhaps still to come with
            # a pending validation: no error, no checkpoints.
            if metric in known or self.queue.active_count(session, run_id):
                return []
            raise UnknownMetric(metric, run, sorted(known))

    def delete_checkpoint(self, checkpoint_id: int) -> None:
        """Marks a checkpoint deleted: it keeps its rows but is never ranked again."""
        self.catalog.delete_checkpoint(checkpoint_id)

    def _ray_checkpoint(self, record: CheckpointRecord):
        from validation_service.storage import ray_checkpoint

        return ray_checkpoint(record.uri, self.settings.storage_options)

    # ------------------------------------------------- dashboard and /metrics
    @retry_on_disconnect
    def run_page(
        self,
        *,
        page: int = 1,
        per_page: int = 50,
        metric: str | None = None,
        mode: Mode | None = None,
    ) -> stats.RunPage:
        """One page of the namespace's runs, newest activity first, with their counts and
        best value of ``metric`` (None: the first one they recorded), in grouped queries."""
        with self.db.read() as session:
            return stats.run_page(
                session, self.namespace, page=page, per_page=per_page, metric=metric, mode=mode
            )

    @retry_on_disconnect
    def run_record(self, run: str) -> RunRecord:
        """The named run of this namespace; RunNotFound otherwise."""
        with self.db.read() as session:
            record = stats.run_record(session, self.namespace, run)
            if record is None:
                self.catalog.require_run_id(session, run)  # raises RunNotFound with hints
            assert record is not None
            return record

    @retry_on_disconnect
    def metric_series(self, runs: Sequence[str], metric: str) -> dict[str, list[stats.MetricPoint]]:
        """Run -> the effective values of ``metric`` by report index, for several runs.

        Raises RunNotFound for an unknown run, and UnknownMetric when none of the runs has
        recorded the metric and none has a validation still to come.
        """
        with self.db.read() as session:
            run_ids = {self.catalog.require_run_id(session, run): run for run in runs}
            series = stats.metric_series(session, run_ids, metric)
            if any(series.values()) or stats.active_jobs(session, list(run_ids)):
                return series
            known = stats.run_metric_names(session, list(run_ids))
            if metric in known:
                return series
            raise UnknownMetric(metric, runs[0] if len(runs) == 1 else None, known)

    @retry_on_disconnect
    def active_job_count(self, runs: Sequence[str]) -> int:
        """QUEUED and RUNNING jobs of the named runs."""
        with self.db.read() as session:
            run_ids = [self.catalog.require_run_id(session, run) for run in runs]
            return stats.active_jobs(session, run_ids)

    @retry_on_disconnect
    def metrics_snapshot(
        self, *, grace_s: float, changed_since: dt.datetime
    ) -> stats.MetricsSnapshot:
        """The queue's figures for /metrics (every namespace: the queue is shared), and the
        jobs changed since ``changed_since``."""
        with self.db.read() as session:
            return stats.metrics_snapshot(
                session, now=utcnow(), grace_s=grace_s, changed_since=changed_since
            )

    @retry_on_disconnect
    def job_time_totals(
        self,
        *,
        duration_bounds: Sequence[float],
        latency_bounds: Sequence[float],
        until: dt.datetime,
    ) -> tuple[stats.Buckets, stats.Buckets]:
        """Validation duration and dispatch latency of the jobs up to ``until``, bucketed
        by pool in the database (see stats.job_time_totals)."""
        with self.db.read() as session:
            return stats.job_time_totals(session, duration_bounds, latency_bounds, until)

    @retry_on_disconnect
    def run_jobs(self, run: str) -> list[JobRecord]:
        """The run's jobs and attempts for display (like validations(), without reading
        the stored validate_fn payloads)."""
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
            return stats.run_jobs(session, run_id, run)

    # ------------------------------------------------------------------- jobs
    @retry_on_disconnect
    def validations(self, run: str) -> list[JobRecord]:
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
            return self.queue.validations(session, run_id, run)

    @retry_on_disconnect
    def get_job(self, job_id: int) -> JobRecord:
        return self.queue.get_job(job_id)

    @retry_on_disconnect
    def job_counts(self, run: str | None = None) -> dict[str, int]:
        with self.db.read() as session:
            run_id = None if run is None else self.catalog.require_run_id(session, run)
            return self.queue.job_counts(session, run_id)

    def wait(self, run: str, timeout_s: float = 300.0, poll_s: float = 0.05) -> None:
        """Returns when no job of the run is QUEUED or RUNNING; raises TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
        while True:
            with self.db.read() as session:
                active = self.queue.active_count(session, run_id)
            if not active:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{active} validation(s) of run {run!r} still QUEUED or RUNNING after "
                    f"{timeout_s:g}s. Is the service running? (`ckval status`)"
                )
            time.sleep(poll_s)

    @retry_on_disconnect
    def due_pools(self, now: dt.datetime | None = None) -> list[str]:
        """Pools that have at least one QUEUED job whose not_before has passed."""
        return self.queue.due_pools(now)

    @retry_on_disconnect
    def claim_due_jobs(
        self,
        owner: str,
        pool_limits: dict[str, int],
        *,
        lease_s: float,
        default_limit: int = 4,
        max_jobs: int = 64,
    ) -> list[ClaimedJob]:
        """Claims due QUEUED jobs, at most each pool's limit minus its RUNNING jobs.

        Each claimed job moves to RUNNING with a new fencing token and a lease of
        ``lease_s`` seconds; an attempt row is opened for it.
        """
        return self.queue.claim_due(
            owner, pool_limits, lease_s=lease_s, default_limit=default_limit, max_jobs=max_jobs
        )

    @retry_on_disconnect
    def heartbeat(
        self, owner: str, leases: Iterable[tuple[int, int]], *, lease_s: float
    ) -> set[int]:
        """Extends the leases this owner still holds; returns the ids of those jobs.

        A job missing from the result was cancelled or taken over: its attempt must stop.
        """
        return self.queue.heartbeat(owner, leases, lease_s=lease_s)

    @retry_on_disconnect
    def finish_job(
        self,
        job_id: int,
        lease_token: int,
        outcome: JobOutcome,
        *,
        policy: RetryPolicy | None = None,
    ) -> bool:
        """Records one attempt's outcome; only the current lease token may do so.

        Success merges the validated metrics into the checkpoint. A failure goes where
        the retry policy says (``policy``, else this registry's): QUEUED again after a
        backoff, or FAILED / TIMED_OUT. Returns False, changing nothing, when the token
        is stale: a newer attempt owns the job.
        """
        metrics, outcome = _checked_metrics(outcome)
        now = utcnow()
        with self.db.write() as conn:
            job = transitions.running_job(conn, job_id, lease_token)
            if job is None:
                logger.warning(
                    "discarding the result of job %s with stale lease token %s",
                    job_id,
                    lease_token,
                )
                return False
            if metrics is not None:
                merged = self.catalog.merge_validated(conn, job, metrics)
                transitions.finish(
                    conn,
                    job,
                    outcome,
                    JobStatus.SUCCEEDED,
                    now,
                    result_metrics=metrics,
                    checkpoint_columns=merged,
                )
                return True
            decision = (policy or self.retry_policy).after_failure(
                budget=AttemptBudget(job.attempts, job.attempts_before_retry, job.max_attempts),
                retryable=outcome.retryable,
                timed_out=outcome.timed_out,
                retry_on_timeout=job.retry_on_timeout,
                now=now,
            )
            transitions.finish(
                conn, job, outcome, decision.status, now, not_before=decision.not_before
            )
            return True

    @retry_on_disconnect
    def requeue_expired(
        self, now: dt.datetime | None = None, *, policy: RetryPolicy | None = None
    ) -> list[int]:
        """RUNNING jobs whose lease ran out go back to QUEUED (or FAILED when out of attempts)."""
        now = now or utcnow()
        with self.db.write() as conn:
            jobs = self.queue.expired(conn, now)
            return self._lost_leases(conn, jobs, policy, now, "expired at {expires}")

    @retry_on_disconnect
    def release_leases(
        self, owner_prefix: str, *, keep_owner: str, policy: RetryPolicy | None = None
    ) -> list[int]:
        """Requeues RUNNING jobs leased by earlier incarnations of a restarted service.

        Owners are named ``<service name>/<incarnation>``: a restarted service knows
        its predecessor is dead, so its jobs need not wait for their leases to run out.
        """
        now = utcnow()
        with self.db.write() as conn:
            jobs = self.queue.leased_by_others(conn, owner_prefix, keep_owner)
            return self._lost_leases(conn, jobs, policy, now, "released by its restarted service")

    def _lost_leases(self, conn, jobs, policy: RetryPolicy | None, now, what: str) -> list[int]:
        requeued = []
        for job in jobs:
            message = (
                f"lease held by {job.lease_owner} "
                f"{what.format(expires=job.lease_expires_at)}; "
                "the service or node running it was lost"
            )
            decision = (policy or self.retry_policy).after_lost_lease(
                budget=AttemptBudget(job.attempts, job.attempts_before_retry, job.max_attempts),
                now=min(now, utcnow()),  # a scan "as of" a later time still requeues for now
            )
            status, not_before = decision.status, decision.not_before
            if transitions.expire(conn, job, status, message, now, not_before=not_before):
                if decision.requeue:
                    requeued.append(job.id)
        return requeued

    def cancel_jobs(
        self, job_ids: Sequence[int] | None = None, *, run: str | None = None, reason: str = ""
    ) -> list[int]:
        """Cancels QUEUED and RUNNING jobs; a RUNNING one loses its lease at once."""
        if job_ids is None and run is None:
            raise InvalidInput("cancel needs job ids or a run name")
        run_id = self._run_id_or_none(run)
        now = utcnow()
        with self.db.write() as conn:
            jobs = self.queue.select_jobs(conn, transitions.FROM_STATES["cancel"], job_ids, run_id)
            message = reason or "cancelled by the user"
            return transitions.cancel(conn, jobs, error_type="Cancelled", message=message, now=now)

    def cancel(
        self, job_ids: Sequence[int] | None = None, *, run: str | None = None, reason: str = ""
    ) -> list[int]:
        """Cancels jobs by id and/or run (see cancel_jobs); the service stops running ones."""
        return self.cancel_jobs(job_ids, run=run, reason=reason)

    def retry_jobs(
        self,
        job_ids: Sequence[int] | None = None,
        *,
        run: str | None = None,
        statuses: Iterable[JobStatus] = RETRYABLE_STATUSES,
    ) -> list[int]:
        """Requeues FAILED, TIMED_OUT and CANCELLED jobs (or only ``statuses`` of those)
        with a fresh attempt budget."""
        if job_ids is None and run is None:
            raise InvalidInput("retry needs job ids or a run name")
        statuses = [JobStatus(s) for s in statuses]
        if not set(statuses) <= transitions.FROM_STATES["retry"]:
            raise InvalidInput(f"only {[s.value for s in RETRYABLE_STATUSES]} jobs are retried")
        run_id = self._run_id_or_none(run)
        now = utcnow()
        with self.db.write() as conn:
            jobs = self.queue.select_jobs(conn, statuses, job_ids, run_id)
            return transitions.retry(conn, jobs, now)

    def _run_id_or_none(self, run: str | None) -> int | None:
        if run is None:
            return None
        with self.db.read() as session:
            return self.catalog.require_run_id(session, run)


def _checked_metrics(outcome: JobOutcome) -> tuple[dict[str, Any] | None, JobOutcome]:
    """A success's metrics, normalized; metrics that cannot be stored fail the attempt."""
    if not outcome.succeeded:
        return None, outcome
    try:
        return normalize_metrics(outcome.metrics, what="validate_fn's return value"), outcome
    except InvalidInput as exc:
        failed = dataclasses.replace(
            outcome,
            succeeded=False,
            metrics=None,
            error_type="InvalidInput",
            error_message=str(exc),
            error_traceback=None,
            retryable=False,
            timed_out=False,
        )
        return None, failed
