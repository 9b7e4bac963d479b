"""Registry: the only code that touches the database (runs, checkpoints, metrics, jobs)."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar

from sqlalchemy import and_, bindparam, delete, func, insert, or_, select, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, selectinload, sessionmaker

from validation_service.config import Settings, get_settings
from validation_service.errors import (
    InvalidInput,
    JobNotFound,
    RunNotFound,
    UnknownMetric,
)
from validation_service.jobs import (
    ACTIVE_JOB_STATUSES,
    JOB_TO_VALIDATION_STATUS,
    JobStatus,
    MetricSource,
    RunStatus,
    ValidationStatus,
)
from validation_service.metrics import normalize_metrics, rankable
from validation_service.registry import _migrate
from validation_service.registry._engine import (
    WRITE_OPTION,
    create_registry_engine,
    is_sqlite,
    write_lock,
)
from validation_service.registry.models import (
    Checkpoint,
    MetricValue,
    Run,
    ValidationAttempt,
    ValidationJob,
    utcnow,
)
from validation_service.registry.records import (
    AttemptRecord,
    CheckpointRecord,
    ClaimedJob,
    JobOutcome,
    JobRecord,
    JobSpec,
    Registration,
    RunRecord,
)

logger = logging.getLogger(__name__)

Mode = Literal["max", "min"]
_F = TypeVar("_F", bound=Callable[..., Any])


def retry_on_disconnect(method: _F) -> _F:
    """Retries an idempotent Registry operation when the database connection drops.

    A restarted or failed-over server, or a terminated backend, ends the connection
    mid-transaction; the pool reconnects (pre-ping) and the operation runs again.
    Only for operations that are safe to repeat: reads, and writes guarded by a
    unique key or a fencing token.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        delay = 0.02
        for attempt in range(1, _DISCONNECT_RETRIES + 1):
            try:
                return method(self, *args, **kwargs)
            except DBAPIError as exc:
                if not _is_disconnect(exc) or attempt == _DISCONNECT_RETRIES:
                    raise
                logger.warning(
                    "database connection lost in %s (%s); retrying",
                    method.__name__,
                    type(exc.orig).__name__,
                )
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    return wrapper  # type: ignore[return-value]


# About 0.3 s of retries: enough for a reconnect; longer outages are the caller's to
# handle (report() delivers in the background, the scheduler retries its next tick).
_DISCONNECT_RETRIES = 5


def _is_disconnect(exc: DBAPIError) -> bool:
    if exc.connection_invalidated:
        return True
    # A backend terminated by the server, or a server restarting, is a disconnect too.
    return isinstance(exc, OperationalError) and not is_locked_error(exc)


def is_locked_error(exc: Exception) -> bool:
    return "database is locked" in str(exc)


_ACTIVE = [s.value for s in ACTIVE_JOB_STATUSES]


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
        self.engine = create_registry_engine(self.url)
        self._write_engine = self.engine.execution_options(**{WRITE_OPTION: True})
        self._write_lock = write_lock(self.url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(self._write_engine, expire_on_commit=False)
        if upgrade is None:
            upgrade = is_sqlite(self.url)
        if check_schema:
            self._check_schema(upgrade)

    # ----------------------------------------------------------------- schema
    def _check_schema(self, upgrade: bool) -> None:
        head = _migrate.head_revision(self.url)
        current = _migrate.current_revision(self.engine)
        if current == head:
            return
        if upgrade:
            self.upgrade()
            return
        raise RuntimeError(
            f"The registry database {self.engine.url.render_as_string(hide_password=True)} is "
            f"at schema revision {current or 'none (empty)'}, this ckval needs {head}. "
            "Run `ckval db upgrade` (with CKVAL_DATABASE_URL set) to migrate it."
        )

    def upgrade(self, revision: str = "head") -> None:
        _migrate.upgrade(self.engine, self.url, revision)

    def downgrade(self, revision: str) -> None:
        _migrate.downgrade(self.engine, self.url, revision)

    def schema_revision(self) -> str | None:
        return _migrate.current_revision(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def __repr__(self) -> str:
        url = self.engine.url.render_as_string(hide_password=True)
        return f"Registry({url!r}, namespace={self.namespace!r})"

    def _session(self) -> Session:
        """A session for reads."""
        return self._sessions()

    @contextlib.contextmanager
    def _write(self) -> Iterator[Session]:
        """A session in one write transaction, committed on exit."""
        with self._write_lock, self._write_sessions() as session, session.begin():
            yield session

    @contextlib.contextmanager
    def _write_connection(self) -> Iterator[Connection]:
        with self._write_lock, self._write_engine.begin() as connection:
            yield connection

    # ------------------------------------------------------------------- runs
    @retry_on_disconnect
    def ensure_run(
        self,
        name: str,
        *,
        storage_root: str,
        tags: dict[str, Any] | None = None,
    ) -> int:
        """Returns the id of the named run in this namespace, creating it if needed."""
        for _ in range(3):
            run_id = self.find_run_id(name)
            if run_id is not None:
                return run_id
            try:
                with self._write() as session:
                    run = Run(
                        name=name,
                        namespace=self.namespace,
                        storage_root=storage_root,
                        tags=tags or {},
                    )
                    session.add(run)
                    session.flush()
                    return run.id
            except IntegrityError:
                continue  # another reporter created it first
        raise RuntimeError(f"could not create or find run {name!r}")

    @retry_on_disconnect
    def find_run_id(self, name: str) -> int | None:
        """The id of the named run in this namespace, or None; writes nothing."""
        _check_run_name(name)
        with self._session() as session:
            return session.scalar(self._run_id_query(name))

    @retry_on_disconnect
    def runs(self) -> list[RunRecord]:
        with self._session() as session:
            rows = session.scalars(
                select(Run).where(Run.namespace == self.namespace).order_by(Run.id)
            ).all()
            return [_run_record(r) for r in rows]

    @retry_on_disconnect
    def get_run(self, name: str) -> RunRecord:
        with self._session() as session:
            run = session.scalar(
                select(Run).where(Run.namespace == self.namespace, Run.name == name)
            )
            if run is None:
                raise self._run_not_found(session, name)
            return _run_record(run)

    def set_run_status(self, name: str, status: RunStatus) -> None:
        with self._write() as session:
            run_id = self._require_run_id(session, name)
            session.execute(update(Run).where(Run.id == run_id).values(status=status.value))

    def _run_id_query(self, name: str):
        return select(Run.id).where(Run.namespace == self.namespace, Run.name == name)

    def _require_run_id(self, session: Session, name: str) -> int:
        run_id = session.scalar(self._run_id_query(name))
        if run_id is None:
            raise self._run_not_found(session, name)
        return run_id

    def _run_not_found(self, session: Session, name: str) -> RunNotFound:
        known = session.scalars(
            select(Run.name).where(Run.namespace == self.namespace).limit(50)
        ).all()
        return RunNotFound(name, self.namespace, list(known))

    # ------------------------------------------------------------ checkpoints
    @retry_on_disconnect
    def next_report_index(self, run_id: int) -> int:
        with self._session() as session:
            current = session.scalar(
                select(func.max(Checkpoint.report_index)).where(Checkpoint.run_id == run_id)
            )
            return 0 if current is None else current + 1

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
        job: JobSpec | None = None,
    ) -> Registration:
        """Registers a checkpoint and enqueues its validation in one transaction.

        Idempotent: the same run + report index returns the rows made the first time.
        """
        metrics = normalize_metrics(reported_metrics, what="reported metrics")
        if job is not None and job.max_attempts < 1:
            raise InvalidInput(f"max_attempts must be at least 1, got {job.max_attempts}")
        now = utcnow()
        status = ValidationStatus.PENDING if job else ValidationStatus.NONE
        try:
            # The common case is a new report: insert straight away and let the unique
            # constraints catch a repeated one.
            row = _checkpoint_row(
                run_id, report_index, step, epoch, uri, size_bytes, manifest_sha256, metrics
            )
            row.update(created_at=now, validation_status=status.value)
            with self._write_connection() as conn:
                if conn.dialect.name == "postgresql":
                    checkpoint_id, job_id = _register_in_one_statement(conn, row, job)
                else:
                    checkpoint_id = conn.execute(_INSERT_CHECKPOINT, row).scalar_one()
                    values = _metric_rows(checkpoint_id, run_id, metrics, MetricSource.REPORTED)
                    if values:
                        conn.execute(_INSERT_METRIC_VALUE, values)
                    job_id = None
                    if job is not None:
                        job_id = conn.execute(
                            _INSERT_JOB, _job_row(job, checkpoint_id, run_id, report_index, now)
                        ).scalar_one()
                if job is not None and job.coalesce == "latest":
                    self._coalesce_older(conn, run_id, report_index, now)
                return Registration(run_id, checkpoint_id, job_id, created=True)
        except IntegrityError:
            # The same run + report index was registered before (or concurrently).
            with self._session() as session:
                existing = self._find_registration(session, run_id, report_index)
            if existing is None:
                raise
            return existing

    def _coalesce_older(
        self, conn: Connection, run_id: int, report_index: int, now: dt.datetime
    ) -> None:
        """Cancels the run's QUEUED jobs of older reports: only the newest is worth it."""
        older = (
            select(ValidationJob.id)
            .join(Checkpoint, Checkpoint.id == ValidationJob.checkpoint_id)
            .where(
                ValidationJob.run_id == run_id,
                ValidationJob.status == JobStatus.QUEUED.value,
                Checkpoint.report_index < report_index,
            )
        )
        ids = conn.execute(older).scalars().all()
        if not ids:
            return
        conn.execute(
            update(ValidationJob)
            .where(ValidationJob.id.in_(ids))
            .values(
                status=JobStatus.CANCELLED.value,
                error_type="Coalesced",
                error_message=f"skipped: report {report_index} of the run superseded it "
                "(coalesce='latest')",
                finished_at=now,
                updated_at=now,
            )
        )
        conn.execute(
            update(Checkpoint)
            .where(
                Checkpoint.id.in_(
                    select(ValidationJob.checkpoint_id).where(ValidationJob.id.in_(ids))
                )
            )
            .values(validation_status=ValidationStatus.CANCELLED.value)
        )

    def import_checkpoints(self, run_id: int, checkpoints: Sequence[dict[str, Any]]) -> int:
        """Registers many already-stored checkpoints at once, without validation jobs.

        Each item has ``report_index``, ``uri`` and ``metrics``, and optionally
        ``size_bytes``, ``manifest_sha256``, ``step`` and ``epoch``. For bringing existing
        checkpoints into the registry; returns how many were added.
        """
        now = utcnow()
        rows = []
        for item in checkpoints:
            row = _checkpoint_row(
                run_id,
                item["report_index"],
                item.get("step"),
                item.get("epoch"),
                item["uri"],
                item.get("size_bytes", 0),
                item.get("manifest_sha256"),
                normalize_metrics(item.get("metrics", {}), what="imported metrics"),
            )
            row.update(created_at=now, validation_status=ValidationStatus.NONE.value)
            rows.append(row)
        if not rows:
            return 0
        with self._write_connection() as conn:
            ids = conn.execute(_INSERT_CHECKPOINTS_IN_ORDER, rows).scalars().all()
            values = [
                value
                for checkpoint_id, row in zip(ids, rows, strict=True)
                for value in _metric_rows(
                    checkpoint_id, run_id, row["metrics"], MetricSource.REPORTED
                )
            ]
            if values and conn.dialect.name == "postgresql":
                _copy_metric_values(conn, values)
            elif values:
                conn.execute(_INSERT_METRIC_VALUE, values)
        return len(rows)

    def analyze(self) -> None:
        """Refreshes the planner's statistics (after a bulk import; autovacuum does it later)."""
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE")

    def _find_registration(
        self, session: Session, run_id: int, report_index: int
    ) -> Registration | None:
        checkpoint_id = session.scalar(
            select(Checkpoint.id).where(
                Checkpoint.run_id == run_id, Checkpoint.report_index == report_index
            )
        )
        if checkpoint_id is None:
            return None
        job_id = session.scalar(
            select(ValidationJob.id).where(
                ValidationJob.idempotency_key == _idempotency_key(run_id, report_index)
            )
        )
        return Registration(run_id, checkpoint_id, job_id, created=False)

    @retry_on_disconnect
    def checkpoints(self, run: str, *, include_deleted: bool = False) -> list[CheckpointRecord]:
        with self._session() as session:
            run_id = self._require_run_id(session, run)
            query = select(Checkpoint).where(Checkpoint.run_id == run_id)
            if not include_deleted:
                query = query.where(Checkpoint.deleted_at.is_(None))
            rows = session.scalars(query.order_by(Checkpoint.report_index)).all()
            return [_checkpoint_record(c, run) for c in rows]

    def get_checkpoint(self, checkpoint_id: int) -> CheckpointRecord:
        with self._session() as session:
            row = session.get(Checkpoint, checkpoint_id, options=[selectinload(Checkpoint.run)])
            if row is None:
                raise LookupError(f"No checkpoint with id {checkpoint_id}.")
            return _checkpoint_record(row, row.run.name)

    @retry_on_disconnect
    def latest_checkpoint(self, run: str):
        """The newest checkpoint of the run as a ray.train.Checkpoint (resume after a crash)."""
        with self._session() as session:
            run_id = self._require_run_id(session, run)
            row = session.scalar(
                select(Checkpoint)
                .where(Checkpoint.run_id == run_id, Checkpoint.deleted_at.is_(None))
                .order_by(Checkpoint.report_index.desc())
                .limit(1)
            )
            if row is None:
                return None
            record = _checkpoint_record(row, run)
            return record.to_ray_checkpoint(self.settings.storage_options)

    def best_checkpoints(
        self, run: str | None, metric: str, mode: Mode = "max", k: int = 1
    ) -> list[tuple[Any, dict[str, Any]]]:
        """Top-k checkpoints by a metric: [(ray.train.Checkpoint, metrics), ...].

        Uses the merged metrics (a validated value overrides a reported one of the same
        name). NaN and infinite values are never ranked. Ties go to the earlier report.
        """
        options = self.settings.storage_options
        return [
            (record.to_ray_checkpoint(options), record.metrics)
            for record in self.best_checkpoint_records(run, metric, mode, k)
        ]

    @retry_on_disconnect
    def best_checkpoint_records(
        self, run: str | None, metric: str, mode: Mode = "max", k: int = 1
    ) -> list[CheckpointRecord]:
        if mode not in ("max", "min"):
            raise InvalidInput(f"mode must be 'max' or 'min', got {mode!r}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidInput(f"k must be a positive int, got {k!r}")
        order = MetricValue.value.desc() if mode == "max" else MetricValue.value.asc()
        conditions = [
            MetricValue.name == metric,
            # "= true", not "IS true": only an equality lets the index give the order.
            MetricValue.effective == True,  # noqa: E712
            Run.namespace == self.namespace,
        ]
        if run is not None:
            conditions.append(Run.name == run)
        # One statement: the metric index gives the order, the joins add the rows.
        query = (
            select(Checkpoint, Run.name)
            .join(MetricValue, MetricValue.checkpoint_id == Checkpoint.id)
            .join(Run, Run.id == MetricValue.run_id)
            .where(*conditions)
            .order_by(order, MetricValue.checkpoint_id.asc())
            .limit(k)
        )
        with self._session() as session:
            rows = session.execute(query).all()
            if rows:
                return [_checkpoint_record(checkpoint, name) for checkpoint, name in rows]
            run_id = self._require_run_id(session, run) if run is not None else None
            self._raise_if_unknown_metric(session, run, run_id, metric)
            return []

    def _raise_if_unknown_metric(
        self, session: Session, run: str | None, run_id: int | None, metric: str
    ) -> None:
        query = select(Checkpoint.reported_metrics, Checkpoint.validated_metrics)
        if run_id is not None:
            query = query.where(Checkpoint.run_id == run_id)
        else:
            query = query.join(Run).where(Run.namespace == self.namespace)
        known: set[str] = set()
        for reported, validated in session.execute(query.limit(10_000)):
            known.update(reported or {})
            known.update(validated or {})
        if metric in known:
            return  # recorded, but only as NaN/inf or non-numeric values
        pending = session.scalar(
            select(func.count(ValidationJob.id)).where(
                ValidationJob.status.in_(_ACTIVE),
                *([ValidationJob.run_id == run_id] if run_id is not None else []),
            )
        )
        if pending:
            return  # the metric may still arrive with a pending validation
        raise UnknownMetric(metric, run, sorted(known))

    def delete_checkpoint(self, checkpoint_id: int) -> None:
        """Marks a checkpoint deleted: it keeps its rows but is never ranked again."""
        with self._write() as session:
            session.execute(
                update(Checkpoint).where(Checkpoint.id == checkpoint_id).values(deleted_at=utcnow())
            )
            session.execute(
                update(MetricValue)
                .where(MetricValue.checkpoint_id == checkpoint_id)
                .values(effective=False)
            )

    # ------------------------------------------------------------------- jobs
    @retry_on_disconnect
    def validations(self, run: str) -> list[JobRecord]:
        with self._session() as session:
            run_id = self._require_run_id(session, run)
            rows = session.execute(
                select(ValidationJob, Checkpoint.report_index)
                .join(Checkpoint, Checkpoint.id == ValidationJob.checkpoint_id)
                .options(selectinload(ValidationJob.attempt_rows))
                .where(ValidationJob.run_id == run_id)
                .order_by(ValidationJob.id)
            ).all()
            return [_job_record(job, run, index) for job, index in rows]

    @retry_on_disconnect
    def get_job(self, job_id: int) -> JobRecord:
        with self._session() as session:
            row = session.execute(
                select(ValidationJob, Checkpoint.report_index, Run.name)
                .join(Checkpoint, Checkpoint.id == ValidationJob.checkpoint_id)
                .join(Run, Run.id == ValidationJob.run_id)
                .options(selectinload(ValidationJob.attempt_rows))
                .where(ValidationJob.id == job_id)
            ).first()
            if row is None:
                raise JobNotFound(job_id)
            job, index, run = row
            return _job_record(job, run, index)

    @retry_on_disconnect
    def job_counts(self, run: str | None = None) -> dict[str, int]:
        with self._session() as session:
            query = select(ValidationJob.status, func.count(ValidationJob.id)).group_by(
                ValidationJob.status
            )
            if run is not None:
                query = query.where(ValidationJob.run_id == self._require_run_id(session, run))
            return {status: count for status, count in session.execute(query)}

    def wait(self, run: str, timeout_s: float = 300.0, poll_s: float = 0.05) -> None:
        """Returns when no job of the run is QUEUED or RUNNING; raises TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        with self._session() as session:
            run_id = self._require_run_id(session, run)
        active_query = select(func.count(ValidationJob.id)).where(
            ValidationJob.run_id == run_id, ValidationJob.status.in_(_ACTIVE)
        )
        while True:
            with self._session() as session:
                active = session.scalar(active_query)
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
        """Pools that have at least one QUEUED job whose not_before has passed.

        Called on every scheduler tick, so it must not read the whole queue: a loose
        index scan visits one index entry per pool (a recursive MIN(pool) > previous),
        then looks for a due job within each of those pools.
        """
        with self._session() as session:
            return _due_pools(session, now or utcnow())

    def next_due_at(self) -> dt.datetime | None:
        with self._session() as session:
            return session.scalar(
                select(func.min(ValidationJob.not_before)).where(
                    ValidationJob.status == JobStatus.QUEUED.value
                )
            )

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
        now = utcnow()
        expires = now + dt.timedelta(seconds=lease_s)
        claimed: list[ClaimedJob] = []
        with self._write_connection() as conn:
            # Core statements built once: the service claims on every tick with room.
            running = dict(conn.execute(_RUNNING_PER_POOL).all())
            for pool in _due_pools(conn, now):
                free = pool_limits.get(pool, default_limit) - running.get(pool, 0)
                free = min(free, max_jobs - len(claimed))
                if free <= 0:
                    continue
                ids = _lock_due_job_ids(conn, pool, now, free)
                if not ids:
                    continue
                conn.execute(
                    _CLAIM_JOBS,
                    {"b_ids": ids, "b_owner": owner, "b_expires": expires, "b_now": now},
                )
                conn.execute(_SET_CLAIMED_CHECKPOINTS_RUNNING, {"b_ids": ids})
                rows = conn.execute(_CLAIMED_JOBS, {"b_ids": ids}).all()
                conn.execute(
                    _INSERT_ATTEMPT,
                    [
                        {
                            "job_id": row.job_id,
                            "attempt": row.attempts,
                            "lease_token": row.lease_token,
                            "lease_owner": owner,
                            "status": JobStatus.RUNNING.value,
                            "claimed_at": now,
                        }
                        for row in rows
                    ],
                )
                claimed.extend(_claimed_job(row, expires) for row in rows)
        return claimed

    @retry_on_disconnect
    def heartbeat(
        self, owner: str, leases: Iterable[tuple[int, int]], *, lease_s: float
    ) -> set[int]:
        """Extends the leases this owner still holds; returns the ids of those jobs.

        A job missing from the result was cancelled or taken over: its attempt must stop.
        """
        leases = list(leases)
        if not leases:
            return set()
        expires = utcnow() + dt.timedelta(seconds=lease_s)
        held = and_(
            ValidationJob.status == JobStatus.RUNNING.value,
            ValidationJob.lease_owner == owner,
            or_(
                *(
                    and_(ValidationJob.id == job_id, ValidationJob.lease_token == token)
                    for job_id, token in leases
                )
            ),
        )
        with self._write() as session:
            session.execute(update(ValidationJob).where(held).values(lease_expires_at=expires))
            return set(session.scalars(select(ValidationJob.id).where(held)))

    def record_attempt_start(
        self,
        job_id: int,
        lease_token: int,
        *,
        node_id: str | None,
        worker_pid: int | None,
        started_at: dt.datetime,
    ) -> None:
        with self._write() as session:
            session.execute(
                update(ValidationAttempt)
                .where(
                    ValidationAttempt.job_id == job_id,
                    ValidationAttempt.lease_token == lease_token,
                )
                .values(node_id=node_id, worker_pid=worker_pid, started_at=started_at)
            )

    @retry_on_disconnect
    def finish_job(self, job_id: int, lease_token: int, outcome: JobOutcome) -> bool:
        """Records one attempt's outcome; only the current lease token may do so.

        Success merges the validated metrics into the checkpoint. A failure is
        requeued with backoff while attempts remain and the error is retryable, else
        the job ends FAILED (or TIMED_OUT). Returns False, changing nothing, when the
        token is stale: a newer attempt owns the job.
        """
        metrics: dict[str, Any] | None = None
        if outcome.succeeded:
            try:
                metrics = normalize_metrics(outcome.metrics, what="validate_fn's return value")
            except InvalidInput as exc:
                outcome = JobOutcome(
                    succeeded=False,
                    error_type="InvalidInput",
                    error_message=str(exc),
                    retryable=False,
                    node_id=outcome.node_id,
                    worker_pid=outcome.worker_pid,
                    started_at=outcome.started_at,
                    finished_at=outcome.finished_at,
                )
        now = utcnow()
        with self._write_connection() as conn:
            # Core statements built once: the service finishes every validation, and the
            # ORM's unit of work cost several ms of CPU per job here.
            job = conn.execute(
                _RUNNING_JOB_TO_FINISH, {"b_job_id": job_id, "b_lease_token": lease_token}
            ).one_or_none()
            if job is None:
                logger.warning(
                    "discarding the result of job %s with stale lease token %s",
                    job_id,
                    lease_token,
                )
                return False
            checkpoint_values: dict[str, Any] = {"b_checkpoint_id": job.checkpoint_id}
            if outcome.succeeded:
                status = JobStatus.SUCCEEDED
                checkpoint_values.update(self._merge_validated(conn, job, metrics or {}))
                values = {
                    "result_metrics": metrics,
                    "error_type": None,
                    "error_message": None,
                    "error_traceback": None,
                }
            else:
                status = self._failure_status(job, outcome)
                values = {
                    "error_type": outcome.error_type,
                    "error_message": outcome.error_message,
                    "error_traceback": outcome.error_traceback,
                }
                if status is JobStatus.QUEUED:
                    values["not_before"] = now + dt.timedelta(seconds=self._backoff_s(job.attempts))
            values.update(
                b_job_id=job_id,
                status=status.value,
                updated_at=now,
                lease_owner=None,
                lease_expires_at=None,
                finished_at=now if status.is_terminal else None,
            )
            conn.execute(_UPDATE_JOB, values)
            checkpoint_values["validation_status"] = JOB_TO_VALIDATION_STATUS[status].value
            conn.execute(_UPDATE_CHECKPOINT, checkpoint_values)
            attempt_status = status if status.is_terminal else JobStatus.FAILED
            conn.execute(
                _FINISH_ATTEMPT,
                {
                    "b_job_id": job_id,
                    "b_lease_token": lease_token,
                    "status": attempt_status.value,
                    "node_id": outcome.node_id,
                    "worker_pid": outcome.worker_pid,
                    "started_at": outcome.started_at,
                    "finished_at": outcome.finished_at or now,
                    "error_message": None if outcome.succeeded else outcome.error_message,
                },
            )
            return True

    def _failure_status(self, job: ValidationJob, outcome: JobOutcome) -> JobStatus:
        retryable = job.retry_on_timeout if outcome.timed_out else outcome.retryable
        if retryable and _attempts_left(job):
            return JobStatus.QUEUED
        return JobStatus.TIMED_OUT if outcome.timed_out else JobStatus.FAILED

    def _backoff_s(self, attempts: int) -> float:
        # Exponential backoff with full jitter in its upper half.
        base = self.settings.retry_backoff_s * 2 ** max(attempts - 1, 0)
        return min(base, self.settings.retry_backoff_max_s) * random.uniform(0.5, 1.0)

    def _merge_validated(self, conn: Connection, job, validated: dict[str, Any]) -> dict:
        """Ranks a job's validated metrics (``job``: a _RUNNING_JOB_TO_FINISH row); returns
        the checkpoint's new metric columns for the caller to set."""
        # Re-validation replaces the earlier validated values instead of adding to them.
        conn.execute(_DELETE_VALIDATED_VALUES, {"b_checkpoint_id": job.checkpoint_id})
        # A validated value hides the reported one of the same name; a checkpoint deleted
        # while it was validated stays out of every ranking.
        ranked = job.deleted_at is None
        if not ranked:
            effective = False
        elif validated:
            effective = MetricValue.name.not_in(list(validated))
        else:
            effective = True
        conn.execute(
            update(MetricValue.__table__)
            .where(MetricValue.__table__.c.checkpoint_id == job.checkpoint_id)
            .values(effective=effective)
        )
        values = _metric_rows(
            job.checkpoint_id, job.run_id, validated, MetricSource.VALIDATED, effective=ranked
        )
        if values:
            conn.execute(_INSERT_METRIC_VALUE, values)
        return {"validated_metrics": validated, "metrics": {**job.reported_metrics, **validated}}

    @retry_on_disconnect
    def requeue_expired(self, now: dt.datetime | None = None) -> list[int]:
        """RUNNING jobs whose lease ran out go back to QUEUED (or FAILED when out of attempts)."""
        now = now or utcnow()
        requeued: list[int] = []
        with self._write() as session:
            jobs = session.scalars(
                select(ValidationJob)
                .options(selectinload(ValidationJob.checkpoint))
                .where(
                    ValidationJob.status == JobStatus.RUNNING.value,
                    ValidationJob.lease_expires_at < now,
                )
            ).all()
            for job in jobs:
                message = (
                    f"lease held by {job.lease_owner} expired at {job.lease_expires_at}; "
                    "the service or node running it was lost"
                )
                session.execute(
                    update(ValidationAttempt)
                    .where(
                        ValidationAttempt.job_id == job.id,
                        ValidationAttempt.lease_token == job.lease_token,
                    )
                    .values(status=JobStatus.FAILED.value, finished_at=now, error_message=message)
                )
                if _attempts_left(job):
                    status = JobStatus.QUEUED
                    job.not_before = min(now, utcnow())  # due at once
                    requeued.append(job.id)
                else:
                    status = JobStatus.FAILED
                    job.finished_at = now
                    job.error_type = "LeaseExpired"
                    job.error_message = message
                job.status = status.value
                job.lease_owner = None
                job.lease_expires_at = None
                job.updated_at = now
                job.checkpoint.validation_status = JOB_TO_VALIDATION_STATUS[status].value
        return requeued

    def _select_jobs(
        self,
        session: Session,
        statuses: Sequence[str],
        job_ids: Sequence[int] | None,
        run: str | None,
    ) -> Sequence[ValidationJob]:
        """Jobs in these statuses, by id and/or run, with their checkpoints, in id order."""
        query = (
            select(ValidationJob)
            .options(selectinload(ValidationJob.checkpoint))
            .where(ValidationJob.status.in_(list(statuses)))
        )
        if job_ids is not None:
            query = query.where(ValidationJob.id.in_(list(job_ids)))
        if run is not None:
            query = query.where(ValidationJob.run_id == self._require_run_id(session, run))
        return session.scalars(query.order_by(ValidationJob.id)).all()

    @retry_on_disconnect
    def release_leases(self, owner_prefix: str, *, keep_owner: str) -> list[int]:
        """Requeues RUNNING jobs leased by earlier incarnations of a restarted service.

        Owners are named ``<service name>/<incarnation>``: a restarted service knows
        its predecessor is dead, so its jobs need not wait for their leases to run out.
        """
        with self._session() as session:
            stale = session.scalars(
                select(ValidationJob.id).where(
                    ValidationJob.status == JobStatus.RUNNING.value,
                    ValidationJob.lease_owner.startswith(owner_prefix, autoescape=True),
                    ValidationJob.lease_owner != keep_owner,
                )
            ).all()
        if not stale:
            return []
        with self._write() as session:
            session.execute(
                update(ValidationJob)
                .where(ValidationJob.id.in_(stale), ValidationJob.status == JobStatus.RUNNING.value)
                .values(lease_expires_at=utcnow() - dt.timedelta(seconds=1))
            )
        return self.requeue_expired()

    def cancel_jobs(
        self, job_ids: Sequence[int] | None = None, *, run: str | None = None, reason: str = ""
    ) -> list[int]:
        """Cancels QUEUED and RUNNING jobs; a RUNNING one loses its lease at once."""
        if job_ids is None and run is None:
            raise InvalidInput("cancel needs job ids or a run name")
        now = utcnow()
        with self._write() as session:
            cancelled = []
            for job in self._select_jobs(session, _ACTIVE, job_ids, run):
                if job.status == JobStatus.RUNNING.value:
                    session.execute(
                        update(ValidationAttempt)
                        .where(
                            ValidationAttempt.job_id == job.id,
                            ValidationAttempt.lease_token == job.lease_token,
                        )
                        .values(
                            status=JobStatus.CANCELLED.value,
                            finished_at=now,
                            error_message=reason or "cancelled by the user",
                        )
                    )
                job.status = JobStatus.CANCELLED.value
                job.error_type = "Cancelled"
                job.error_message = reason or "cancelled by the user"
                job.error_traceback = None
                job.lease_owner = None
                job.lease_expires_at = None
                job.finished_at = now
                job.updated_at = now
                job.checkpoint.validation_status = ValidationStatus.CANCELLED.value
                cancelled.append(job.id)
            return cancelled

    def cancel(
        self, job_ids: Sequence[int] | None = None, *, run: str | None = None, reason: str = ""
    ) -> list[int]:
        """Cancels jobs by id and/or run (see cancel_jobs); the service stops running ones."""
        return self.cancel_jobs(job_ids, run=run, reason=reason)

    def retry_jobs(
        self, job_ids: Sequence[int] | None = None, *, run: str | None = None
    ) -> list[int]:
        """Requeues FAILED, TIMED_OUT and CANCELLED jobs with a fresh attempt budget."""
        if job_ids is None and run is None:
            raise InvalidInput("retry needs job ids or a run name")
        now = utcnow()
        retryable = [JobStatus.FAILED.value, JobStatus.TIMED_OUT.value, JobStatus.CANCELLED.value]
        with self._write() as session:
            requeued = []
            for job in self._select_jobs(session, retryable, job_ids, run):
                job.status = JobStatus.QUEUED.value
                job.attempts_before_retry = job.attempts
                job.error_type = job.error_message = job.error_traceback = None
                job.not_before = now
                job.finished_at = None
                job.updated_at = now
                job.checkpoint.validation_status = ValidationStatus.PENDING.value
                requeued.append(job.id)
            return requeued

    def job_lease(self, job_id: int) -> tuple[str, int | None]:
        """(status, lease token) of a job, for executors to notice a cancellation."""
        with self._session() as session:
            row = session.execute(
                select(ValidationJob.status, ValidationJob.lease_token).where(
                    ValidationJob.id == job_id
                )
            ).first()
            if row is None:
                raise JobNotFound(job_id)
            return row[0], row[1]


# register_checkpoint runs once per report: statements built once, values bound per call
# (SQLAlchemy then reuses the compiled form instead of rebuilding it from .values()).
_INSERT_CHECKPOINT = insert(Checkpoint.__table__).returning(Checkpoint.__table__.c.id)
_INSERT_METRIC_VALUE = insert(MetricValue.__table__)
_INSERT_JOB = insert(ValidationJob.__table__).returning(ValidationJob.__table__.c.id)
_INSERT_CHECKPOINTS_IN_ORDER = insert(Checkpoint.__table__).returning(
    Checkpoint.__table__.c.id, sort_by_parameter_order=True
)
_DUE_POOLS = text(
    """
    WITH RECURSIVE queued(pool) AS (
        SELECT (
            SELECT pool FROM validation_jobs WHERE status = :queued ORDER BY pool LIMIT 1
        )
        UNION ALL
        SELECT (
            SELECT pool FROM validation_jobs
            WHERE status = :queued AND pool > queued.pool ORDER BY pool LIMIT 1
        )
        FROM queued WHERE queued.pool IS NOT NULL
    )
    SELECT pool, (
        SELECT 1 FROM validation_jobs AS job
        WHERE job.status = :queued AND job.pool = queued.pool AND job.not_before <= :now
        LIMIT 1
    ) AS due
    FROM queued WHERE pool IS NOT NULL
    """
).bindparams(bindparam("now", type_=ValidationJob.__table__.c.not_before.type))
_jobs, _checkpoints, _attempts = (
    ValidationJob.__table__,
    Checkpoint.__table__,
    ValidationAttempt.__table__,
)
# finish_job's statements (parameters prefixed "b_" bind the WHERE clauses; the others
# are the columns set).
_RUNNING_JOB_TO_FINISH = (
    select(
        _jobs.c.checkpoint_id,
        _jobs.c.run_id,
        _jobs.c.attempts,
        _jobs.c.attempts_before_retry,
        _jobs.c.max_attempts,
        _jobs.c.retry_on_timeout,
        _checkpoints.c.reported_metrics,
        _checkpoints.c.deleted_at,
    )
    .join(_checkpoints, _checkpoints.c.id == _jobs.c.checkpoint_id)
    .where(
        _jobs.c.id == bindparam("b_job_id"),
        _jobs.c.lease_token == bindparam("b_lease_token"),
        _jobs.c.status == JobStatus.RUNNING.value,
    )
)
_UPDATE_JOB = update(_jobs).where(_jobs.c.id == bindparam("b_job_id"))
_UPDATE_CHECKPOINT = update(_checkpoints).where(_checkpoints.c.id == bindparam("b_checkpoint_id"))
_DELETE_VALIDATED_VALUES = delete(MetricValue.__table__).where(
    MetricValue.__table__.c.checkpoint_id == bindparam("b_checkpoint_id"),
    MetricValue.__table__.c.source == MetricSource.VALIDATED.value,
)
_FINISH_ATTEMPT = update(_attempts).where(
    _attempts.c.job_id == bindparam("b_job_id"),
    _attempts.c.lease_token == bindparam("b_lease_token"),
)
# claim_due_jobs' statements ("b_ids": the claimed job ids).
_RUNNING_PER_POOL = (
    select(_jobs.c.pool, func.count(_jobs.c.id))
    .where(_jobs.c.status == JobStatus.RUNNING.value)
    .group_by(_jobs.c.pool)
)
_CLAIMED_IDS = _jobs.c.id.in_(bindparam("b_ids", expanding=True))
_CLAIM_JOBS = (
    update(_jobs)
    .where(_CLAIMED_IDS)
    .values(
        status=JobStatus.RUNNING.value,
        attempts=_jobs.c.attempts + 1,
        lease_token=_jobs.c.lease_token + 1,
        lease_owner=bindparam("b_owner"),
        lease_expires_at=bindparam("b_expires", type_=_jobs.c.lease_expires_at.type),
        updated_at=bindparam("b_now", type_=_jobs.c.updated_at.type),
        started_at=func.coalesce(
            _jobs.c.started_at, bindparam("b_now", type_=_jobs.c.started_at.type)
        ),
    )
)
_SET_CLAIMED_CHECKPOINTS_RUNNING = (
    update(_checkpoints)
    .where(_checkpoints.c.id.in_(select(_jobs.c.checkpoint_id).where(_CLAIMED_IDS)))
    .values(validation_status=ValidationStatus.RUNNING.value)
)
_CLAIMED_JOBS = (
    select(
        _jobs.c.id.label("job_id"),
        _jobs.c.lease_token,
        _jobs.c.attempts,
        _jobs.c.max_attempts,
        _jobs.c.validate_fn_ref,
        _jobs.c.validate_fn_pickle,
        _jobs.c.validate_config,
        _jobs.c.executor_kind,
        _jobs.c.resources,
        _jobs.c.pool,
        _jobs.c.timeout_s,
        _checkpoints.c.id.label("checkpoint_id"),
        _checkpoints.c.report_index,
        _checkpoints.c.uri,
        _checkpoints.c.manifest_sha256,
        _checkpoints.c.reported_metrics,
        Run.__table__.c.name.label("run"),
        Run.__table__.c.namespace,
        Run.__table__.c.storage_root,
    )
    .join(_checkpoints, _checkpoints.c.id == _jobs.c.checkpoint_id)
    .join(Run.__table__, Run.__table__.c.id == _checkpoints.c.run_id)
    .where(_CLAIMED_IDS)
    .order_by(_jobs.c.priority.desc(), _jobs.c.id.asc())
)
_INSERT_ATTEMPT = insert(_attempts)
_METRIC_VALUE_COLUMNS = ("checkpoint_id", "run_id", "name", "source", "value", "effective")


def _copy_metric_values(conn: Connection, values: list[dict[str, Any]]) -> None:
    """PostgreSQL's COPY for a bulk import's metric values (several times faster)."""
    columns = ", ".join(_METRIC_VALUE_COLUMNS)
    cursor = conn.connection.dbapi_connection.cursor()
    try:
        with cursor.copy(f"COPY metric_values ({columns}) FROM STDIN") as copy:
            for value in values:
                copy.write_row([value[name] for name in _METRIC_VALUE_COLUMNS])
    finally:
        cursor.close()


def _checkpoint_row(
    run_id, report_index, step, epoch, uri, size_bytes, manifest_sha256, metrics
) -> dict[str, Any]:
    """A checkpoints row; the caller sets created_at and validation_status."""
    return {
        "run_id": run_id,
        "report_index": report_index,
        "step": step,
        "epoch": epoch,
        "uri": uri,
        "size_bytes": size_bytes,
        "manifest_sha256": manifest_sha256,
        "created_at": None,
        "reported_metrics": metrics,
        "metrics": metrics,
        "validation_status": None,
        "deleted_at": None,
    }


@functools.cache
def _one_statement_registration(with_job: bool):
    """PostgreSQL: a checkpoint, its metric values and its job in one statement (one
    round trip instead of three), chained by data-modifying CTEs.

    Parameters: the checkpoint's columns prefixed ``c_``, the job's prefixed ``j_``, and
    ``m_names``/``m_values`` (arrays) for the metric values. Returns (checkpoint id, job
    id or None, metric values inserted).
    """
    from sqlalchemy import Float, Integer, String, literal, true
    from sqlalchemy.dialects.postgresql import ARRAY

    checkpoints, values, jobs = (
        Checkpoint.__table__,
        MetricValue.__table__,
        ValidationJob.__table__,
    )
    new_checkpoint = (
        insert(checkpoints)
        .values({name: bindparam(f"c_{name}") for name in _checkpoint_columns()})
        .returning(checkpoints.c.id, checkpoints.c.run_id)
        .cte("new_checkpoint")
    )
    metric = (
        func.unnest(
            bindparam("m_names", type_=ARRAY(String)), bindparam("m_values", type_=ARRAY(Float))
        )
        .table_valued("name", "value")
        .render_derived()
    )
    new_values = (
        insert(values)
        .from_select(
            ["checkpoint_id", "run_id", "name", "source", "value", "effective"],
            select(
                new_checkpoint.c.id,
                new_checkpoint.c.run_id,
                metric.c.name,
                literal(MetricSource.REPORTED.value, String),
                metric.c.value,
                literal(True),
            ).select_from(new_checkpoint.join(metric, true())),
        )
        .returning(values.c.checkpoint_id)
        .cte("new_values")
    )
    job_id = literal(None, Integer)
    if with_job:
        job_columns = _job_columns()
        new_job = (
            insert(jobs)
            .from_select(
                ["checkpoint_id", *job_columns],
                select(
                    new_checkpoint.c.id,
                    *(bindparam(f"j_{name}", type_=jobs.c[name].type) for name in job_columns),
                ),
            )
            .returning(jobs.c.id)
            .cte("new_job")
        )
        job_id = select(new_job.c.id).scalar_subquery()
    return select(
        new_checkpoint.c.id,
        job_id,
        select(func.count()).select_from(new_values).scalar_subquery(),
    )


@functools.cache
def _checkpoint_columns() -> tuple[str, ...]:
    return tuple(_checkpoint_row(0, 0, None, None, "", 0, None, {}))


@functools.cache
def _job_columns() -> tuple[str, ...]:
    """The job row's columns but checkpoint_id, which the statement takes from its CTE."""
    row = _job_row(JobSpec("", "", ""), 0, 0, 0, utcnow())
    return tuple(name for name in row if name != "checkpoint_id")


def _register_in_one_statement(
    conn: Connection, row: dict[str, Any], job: JobSpec | None
) -> tuple[int, int | None]:
    ranked = rankable(row["metrics"])
    params = {f"c_{name}": value for name, value in row.items()}
    params["m_names"], params["m_values"] = list(ranked), list(ranked.values())
    if job is not None:
        job_row = _job_row(job, 0, row["run_id"], row["report_index"], row["created_at"])
        params.update({f"j_{name}": job_row[name] for name in _job_columns()})
    checkpoint_id, job_id, _ = conn.execute(
        _one_statement_registration(job is not None), params
    ).one()
    return checkpoint_id, job_id


def _job_row(
    job: JobSpec, checkpoint_id: int, run_id: int, report_index: int, now: dt.datetime
) -> dict[str, Any]:
    return {
        "checkpoint_id": checkpoint_id,
        "run_id": run_id,
        "idempotency_key": _idempotency_key(run_id, report_index),
        "validate_fn_ref": job.validate_fn_ref,
        "validate_fn_pickle": job.validate_fn_pickle,
        "validate_fn_name": job.validate_fn_name[:512],
        "validate_config": job.validate_config,
        "executor_kind": job.executor_kind,
        "resources": job.resources,
        "pool": job.pool,
        "priority": job.priority,
        "status": JobStatus.QUEUED.value,
        "attempts": 0,
        "max_attempts": job.max_attempts,
        "attempts_before_retry": 0,
        "lease_token": 0,
        "timeout_s": job.timeout_s,
        "retry_on_timeout": job.retry_on_timeout,
        "not_before": now,
        "created_at": now,
        "updated_at": now,
    }


def _metric_rows(
    checkpoint_id: int,
    run_id: int,
    metrics: dict[str, Any],
    source: MetricSource,
    *,
    effective: bool = True,
) -> list[dict[str, Any]]:
    return [
        {
            "checkpoint_id": checkpoint_id,
            "run_id": run_id,
            "name": name,
            "source": source.value,
            "value": value,
            "effective": effective,
        }
        for name, value in rankable(metrics).items()
    ]


def _attempts_left(job: ValidationJob) -> bool:
    return job.attempts - job.attempts_before_retry < job.max_attempts


def _idempotency_key(run_id: int, report_index: int) -> str:
    return f"run:{run_id}/report:{report_index}"


def _check_run_name(name: str) -> None:
    if not isinstance(name, str) or not name.strip():
        raise InvalidInput(f"run name must be a non-empty str, got {name!r}")
    if len(name) > 255 or any(c in name for c in "\x00/\\") or name in (".", ".."):
        raise InvalidInput(
            f"run name {name!r} is not allowed: use at most 255 characters, "
            "no '/', '\\' or NUL, and not '.' or '..'"
        )


def _run_record(run: Run) -> RunRecord:
    return RunRecord(
        run.id, run.name, run.namespace, run.storage_root, run.created_at, run.status, run.tags
    )


def _checkpoint_record(c: Checkpoint, run: str) -> CheckpointRecord:
    return CheckpointRecord(
        id=c.id,
        run=run,
        report_index=c.report_index,
        step=c.step,
        epoch=c.epoch,
        uri=c.uri,
        size_bytes=c.size_bytes,
        manifest_sha256=c.manifest_sha256,
        created_at=c.created_at,
        reported_metrics=c.reported_metrics,
        validated_metrics=c.validated_metrics,
        metrics=c.metrics,
        validation_status=c.validation_status,
        deleted_at=c.deleted_at,
    )


def _job_record(job: ValidationJob, run: str, report_index: int) -> JobRecord:
    return JobRecord(
        id=job.id,
        run=run,
        checkpoint_id=job.checkpoint_id,
        report_index=report_index,
        status=job.status,
        attempts=job.attempts,
        max_attempts=job.max_attempts,
        priority=job.priority,
        pool=job.pool,
        resources=job.resources,
        executor_kind=job.executor_kind,
        validate_fn_name=job.validate_fn_name,
        not_before=job.not_before,
        lease_owner=job.lease_owner,
        lease_token=job.lease_token,
        lease_expires_at=job.lease_expires_at,
        timeout_s=job.timeout_s,
        error_type=job.error_type,
        error_message=job.error_message,
        error_traceback=job.error_traceback,
        result_metrics=job.result_metrics,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        attempt_history=tuple(
            AttemptRecord(
                a.attempt,
                a.lease_token,
                a.lease_owner,
                a.status,
                a.claimed_at,
                a.started_at,
                a.finished_at,
                a.node_id,
                a.worker_pid,
                a.error_message,
            )
            for a in job.attempt_rows
        ),
    )


def _due_pools(conn: Connection | Session, now: dt.datetime) -> list[str]:
    params = {"queued": JobStatus.QUEUED.value, "now": now}
    return [pool for pool, due in conn.execute(_DUE_POOLS, params) if due]


def _lock_due_job_ids(conn: Connection, pool: str, now: dt.datetime, limit: int) -> list[int]:
    # FOR UPDATE SKIP LOCKED lets several schedulers claim from one PostgreSQL queue
    # without blocking on each other's rows. SQLite ignores it: there the whole
    # transaction holds the write lock (BEGIN IMMEDIATE, see _engine.py).
    query = (
        select(_jobs.c.id)
        .where(
            _jobs.c.status == JobStatus.QUEUED.value,
            _jobs.c.pool == pool,
            _jobs.c.not_before <= now,
        )
        .order_by(_jobs.c.priority.desc(), _jobs.c.id.asc())
        .limit(limit)
    )
    if conn.dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    return list(conn.execute(query).scalars())


def _claimed_job(row, expires: dt.datetime) -> ClaimedJob:
    """A _CLAIMED_JOBS row, as the executor gets it."""
    return ClaimedJob(
        job_id=row.job_id,
        lease_token=row.lease_token,
        attempt=row.attempts,
        max_attempts=row.max_attempts,
        run=row.run,
        namespace=row.namespace,
        checkpoint_id=row.checkpoint_id,
        report_index=row.report_index,
        uri=row.uri,
        storage_root=row.storage_root,
        manifest_sha256=row.manifest_sha256,
        reported_metrics=row.reported_metrics,
        validate_fn_ref=row.validate_fn_ref,
        validate_fn_pickle=row.validate_fn_pickle,
        validate_config=row.validate_config,
        executor_kind=row.executor_kind,
        resources=row.resources,
        pool=row.pool,
        timeout_s=row.timeout_s,
        lease_expires_at=expires,
    )
