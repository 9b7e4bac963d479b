"""Registry: the users' query API (runs, checkpoints, best, latest, aliases, tags,
search, wait, retention, stop policies) and the operators' job commands, over one
database layer.

The other audiences have their own objects on the same database: the reporter's writes
(``ledger``, ledger.py), the scheduler's queue operations (``job_queue``, jobs.py),
aliases and retention after a validation (``housekeeping``, housekeeping.py) and the
dashboard's reads (``dashboard``, dashboard_reads.py).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from validation_service import validation
from validation_service.config import Settings, get_settings
from validation_service.errors import (
    InvalidInput,
    UnknownMetric,
)
from validation_service.jobs import DEFAULT_VALIDATOR, JobStatus, RunStatus
from validation_service.metrics import lower_is_better
from validation_service.names import check_name
from validation_service.progress import ProgressRenderer
from validation_service.registry import aliases as alias_store
from validation_service.registry import evaluations, retention, search, transitions, waiting
from validation_service.registry.assemblies import Assemblies, AssemblyRecord
from validation_service.registry.catalog import Catalog, Mode, check_run_name
from validation_service.registry.dashboard_reads import DashboardReader
from validation_service.registry.database import Database, retry_on_disconnect
from validation_service.registry.housekeeping import Housekeeping
from validation_service.registry.jobs import JobQueue
from validation_service.registry.ledger import Ledger
from validation_service.registry.queue import Queue
from validation_service.registry.records import (
    CheckpointRecord,
    JobRecord,
    RunRecord,
    RunSummary,
    StopDecision,
)
from validation_service.registry.replicas import ReplicaBook
from validation_service.registry.stopping import StopRules
from validation_service.retry import RetryPolicy
from validation_service.stopping import StopPolicy

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
        self.namespace = check_name("namespace", namespace or self.settings.namespace)
        self.db = Database(self.url, source=_url_source(database_url, self.settings))
        self.engine = self.db.engine
        self.catalog = Catalog(self.db, self.namespace)
        self.queue = Queue(self.db)
        self.ledger = Ledger(self.db, self.catalog, self.queue)
        self.stopping = StopRules(self.db, self.catalog)
        self.housekeeping = Housekeeping(self.db, self.catalog, self.settings, self.stopping)
        self.job_queue = JobQueue(
            self.db,
            self.catalog,
            self.queue,
            self.housekeeping,
            RetryPolicy.from_settings(self.settings),
        )
        self.assemblies = Assemblies(self.db, self.catalog)
        self.dashboard = DashboardReader(self.db, self.catalog)
        self.replicas = ReplicaBook(self.db)
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
    def find_run_id(self, name: str) -> int | None:
        """The id of the named run's latest attempt in this namespace, or None; writes nothing."""
        return self.catalog.find_run_id(name)

    @retry_on_disconnect
    def run_attempts(self, name: str) -> list[RunRecord]:
        """Every attempt of the named run, the first first; RunNotFound if there is none."""
        with self.db.read() as session:
            self.catalog.require_run_id(session, name)
            return [run for run in self.catalog.runs(session) if run.name == name]

    @retry_on_disconnect
    def runs(self, status: RunStatus | str | None = None) -> list[RunRecord]:
        """Every attempt of every run of the namespace (only those in ``status``)."""
        with self.db.read() as session:
            return _with_status(self.catalog.runs(session), status)

    @retry_on_disconnect
    def run_summaries(self, status: RunStatus | str | None = None) -> list[RunSummary]:
        """Every run attempt (only those in ``status``) with its checkpoint count, job
        counts and latest stop decision, in four queries."""
        with self.db.read() as session:
            runs = _with_status(self.catalog.runs(session), status)
            checkpoints = self.catalog.checkpoint_counts(session)
            jobs = self.queue.job_counts_by_run(session, self.namespace)
            stops = self.stopping.latest_decisions(session)
        return [
            RunSummary(run, checkpoints.get(run.id, 0), jobs.get(run.id, {}), stops.get(run.id))
            for run in runs
        ]

    # ------------------------------------------------------------ checkpoints
    @retry_on_disconnect
    def checkpoints(
        self,
        run: str,
        *,
        include_deleted: bool = False,
        tags: dict[str, str] | None = None,
        attempt: int | None = None,
    ) -> list[CheckpointRecord]:
        """The run's checkpoints in report order, with their aliases, tags and the metrics
        of every validator (``evaluations``: name -> metrics, "default" being report()'s).

        ``tags``: only those with every key = value; ``attempt``: of that attempt of
        the run (default: its latest).
        """
        records = self.catalog.checkpoints(
            run, include_deleted=include_deleted, tags=tags, attempt=attempt
        )
        with self.db.read() as session:
            records = alias_store.with_aliases_and_tags(session, records)
            return evaluations.by_validator(session, records)

    @retry_on_disconnect
    def latest_checkpoint(self, run: str, *, attempt: int | None = None):
        """The newest checkpoint of the run's latest attempt (or of ``attempt``) as a
        ray.train.Checkpoint (resume after a crash); deleted checkpoints are skipped."""
        record = self.catalog.latest(run, attempt)
        return None if record is None else self._ray_checkpoint(record)

    def best_checkpoints(
        self,
        run: str | None,
        metric: str,
        mode: Mode | None = None,
        k: int = 1,
        *,
        tags: dict[str, str] | None = None,
        attempt: int | None = None,
        validator: str = DEFAULT_VALIDATOR,
    ) -> list[tuple[Any, dict[str, Any]]]:
        """Top-k checkpoints by a metric: [(ray.train.Checkpoint, metrics), ...].

        Uses the merged metrics (a validated value overrides a reported one of the same
        name). NaN and infinite values are never ranked, deleted checkpoints neither. Ties
        go to the earlier report. ``run``: its latest attempt (or ``attempt``); None: every
        run of the namespace. ``tags``: only checkpoints with every key = value. ``mode``
        defaults to "max"; left out for a metric named like a loss or an error, it warns
        that the highest values come first. ``validator``: rank by that named evaluation's
        values (see revalidate); the metrics returned are then that evaluation's.
        """
        validation.check_k(k)
        records = self._best(run, metric, mode or "max", k, tags, attempt, validator)
        if mode is None and records and lower_is_better(metric):
            warnings.warn(
                f"best_checkpoints ranked {metric!r} with mode='max' (the default), but its "
                "name says lower is better: pass mode='min' for the lowest values "
                "(mode='max' keeps the highest and silences this warning).",
                UserWarning,
                stacklevel=2,
            )
        if validator != DEFAULT_VALIDATOR:
            return [(self._ray_checkpoint(r), r.evaluations[validator]) for r in records]
        return [(self._ray_checkpoint(record), record.metrics) for record in records]

    @retry_on_disconnect
    def best_checkpoint_records(
        self,
        run: str | None,
        metric: str,
        mode: Mode = "max",
        k: int = 1,
        *,
        tags: dict[str, str] | None = None,
        attempt: int | None = None,
        validator: str = DEFAULT_VALIDATOR,
    ) -> list[CheckpointRecord]:
        """As best_checkpoints, as records with their aliases and tags."""
        validation.check_k(k)
        records = self._best(run, metric, mode, k, tags, attempt, validator)
        with self.db.read() as session:
            return alias_store.with_aliases_and_tags(session, records)

    @retry_on_disconnect
    def _best(self, run, metric, mode, k, tags, attempt, validator) -> list[CheckpointRecord]:
        if validator != DEFAULT_VALIDATOR:
            return evaluations.best_records(self, run, metric, mode, k, tags, attempt, validator)
        with self.db.read() as session:
            run_id = None if run is None else self.catalog.require_run_id(session, run, attempt)
            records = self.catalog.best(session, run_id, metric, mode, k, tags)
            if records:
                return records
            known = self.catalog.known_metrics(session, run_id)
            # Recorded only as NaN/inf or non-numeric values, or perhaps still to come with
            # a pending validation: no error, no checkpoints.
            if metric in known or self.queue.active_count(session, run_id):
                return []
            raise UnknownMetric(metric, run, sorted(known))

    # ---------------------------------------------------------- aliases, tags
    @retry_on_disconnect
    def set_alias(self, run: str, alias: str, report_index: int) -> None:
        """Points the run's ``alias`` at one of its checkpoints, moving it if it was set.

        One statement (an upsert on the unique (run, alias)): concurrent moves end with
        one alias on one of the checkpoints asked for. A deleted checkpoint is refused.
        """
        alias_store.check_alias(alias)
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
        with self.db.write() as conn:
            checkpoint_id = alias_store.live_checkpoint_id(conn, run_id, run, report_index)
            alias_store.set_alias(conn, run_id, alias, checkpoint_id)

    def get_alias(self, run: str, alias: str) -> tuple[Any, dict[str, Any]]:
        """The checkpoint the run's alias points at: (ray.train.Checkpoint, metrics)."""
        record = self.get_alias_record(run, alias)
        return self._ray_checkpoint(record), record.metrics

    @retry_on_disconnect
    def get_alias_record(self, run: str, alias: str) -> CheckpointRecord:
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
            checkpoint_id = alias_store.aliased_checkpoint_id(session, run_id, run, alias)
        record = next(
            r for r in self.catalog.checkpoints(run, include_deleted=True) if r.id == checkpoint_id
        )
        with self.db.read() as session:
            return alias_store.with_aliases_and_tags(session, [record])[0]

    @retry_on_disconnect
    def aliases(self, run: str) -> dict[str, int]:
        """Alias -> report index, for every alias of the run (its latest attempt)."""
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
            return alias_store.run_aliases(session, run_id)

    @retry_on_disconnect
    def remove_alias(self, run: str, alias: str) -> bool:
        """Removes the alias (and its tracking rule); False if the run had no such alias."""
        alias_store.check_alias(alias)
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
        with self.db.write() as conn:
            return alias_store.remove_alias(conn, run_id, alias)

    @retry_on_disconnect
    def track_alias(self, run: str, alias: str, metric: str, mode: Mode = "max") -> int | None:
        """Keeps ``alias`` on the run's best checkpoint by ``metric``: stored as a rule that
        the service re-applies as validations finish, and applied now. Returns the report
        index the alias points at, or None while no checkpoint has the metric."""
        alias_store.check_alias(alias)
        if mode not in ("max", "min"):
            raise InvalidInput(f"mode must be 'max' or 'min', got {mode!r}")
        if not isinstance(metric, str) or not metric:
            raise InvalidInput(f"metric must be a metric name, got {metric!r}")
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
        with self.db.write() as conn:
            alias_store.track_alias(conn, run_id, alias, metric, mode)
        return self.housekeeping.refresh_tracked_aliases(run_id).get(alias)

    @retry_on_disconnect
    def tag(self, run: str, report_index: int, key: str, value: str | None) -> None:
        """Sets a string tag on one checkpoint of the run (``value`` None removes it)."""
        alias_store.check_tag(key, value)
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
        with self.db.write() as conn:
            checkpoint_id = alias_store.live_checkpoint_id(conn, run_id, run, report_index)
            alias_store.set_tag(conn, checkpoint_id, key, value)

    # -------------------------------------------------------------- retention
    def apply_retention(
        self,
        run: str | None = None,
        *,
        metric: str,
        mode: Mode = "max",
        keep_best: int = 0,
        keep_best_per_run: int = 1,
        keep_latest: int = 1,
        dry_run: bool = False,
    ) -> list[CheckpointRecord]:
        """Deletes the checkpoints that no rule keeps; returns them (or, with ``dry_run``,
        those that would go, deleting nothing).

        Kept: the ``keep_best`` best by ``metric`` across the run's attempts (``run``
        None: across the namespace's runs), the ``keep_best_per_run`` best and the
        ``keep_latest`` newest of each run attempt, and always a checkpoint whose
        validation is QUEUED or RUNNING, one with an alias and the one latest_checkpoint()
        returns. Deleted checkpoints lose their files; their rows stay, marked deleted,
        with their metrics. An unknown metric raises UnknownMetric, deleting nothing.
        Checkpoints outside CKVAL_STORAGE and CKVAL_DELETABLE_ROOTS are kept whole.
        """
        rule = retention.RetentionRule(
            metric, mode, keep_best, keep_best_per_run, keep_latest, run=run
        )
        going = self.housekeeping.apply_retention(
            self.catalog, rule, dry_run=bool(dry_run), strict=True
        )
        if not dry_run:  # the parts of checkpoints that never became one go too
            run_ids = None if run is None else [r.id for r in self.run_attempts(run)]
            self.housekeeping.remove_incomplete(self.assemblies, run_ids)
        return going

    @retry_on_disconnect
    def incomplete_checkpoints(self, run: str) -> list[AssemblyRecord]:
        """The run's reports whose checkpoint, written by several ranks, is not complete:
        still being stored, or INCOMPLETE (a rank died before its part was stored).
        None of them is listed, ranked or validated; retention removes their files."""
        return self.assemblies.not_complete([r.id for r in self.run_attempts(run)])

    def retention_plan(
        self,
        run: str | None = None,
        *,
        metric: str,
        mode: Mode = "max",
        keep_best: int = 0,
        keep_best_per_run: int = 1,
        keep_latest: int = 1,
    ) -> retention.RetentionPlan:
        """What apply_retention would do now, deleting nothing: what it deletes, and what
        it keeps as outside the storage roots of this registry's settings."""
        rule = retention.RetentionRule(
            metric, mode, keep_best, keep_best_per_run, keep_latest, run=run
        )
        going, kept = self.housekeeping.plan_retention(self.catalog, rule, strict=True)
        return retention.RetentionPlan([c.record for c in going], [c.record for c in kept])

    @retry_on_disconnect
    def set_retention(self, run: str | None = None, **rule: Any) -> retention.RetentionRule:
        """Stores a retention policy for the run name (None: for the namespace) that the
        service applies as validations finish. ``rule``: apply_retention's keywords
        (``metric``, ``mode``, ``keep_best``, ``keep_best_per_run``, ``keep_latest``).

        A run's own policy replaces the namespace's for that run.
        """
        stored = retention.RetentionRule(run=run, **rule)
        if run is not None:
            check_run_name(run)
        with self.db.write() as conn:
            retention.save_policy(conn, self.namespace, stored)
        return stored

    # --------------------------------------------------------- early stopping
    def set_stop_policy(self, run: str, policy: StopPolicy | None) -> StopPolicy | None:
        """Stores the run's StopPolicy, judged after each validated result is merged (None
        removes it). Stored by run name: it may be set before the run's first report and
        applies to every attempt of the name; results it has already are judged now."""
        return self.stopping.set_policy(run, policy)

    def stop_policy(self, run: str) -> StopPolicy | None:
        return self.stopping.policy(run)  # the run name's stored policy, or None

    def stop_decision(self, run: str) -> StopDecision | None:
        """Why the run's latest attempt should stop (``overridden_at`` set once resumed),
        or None while no rule decided or before its first report."""
        return self.stopping.decision(run)

    def resume_despite_stop(self, run: str) -> StopDecision:
        """Overrides the run's stop decision, recording when; the rules judge again, from
        the checkpoints reported after now. InvalidInput when the run is not stopped."""
        return self.stopping.resume(run)

    # ----------------------------------------------------------------- search
    @retry_on_disconnect
    def search(
        self, filter: str = "", order_by: Sequence[str] | None = None, k: int = 100
    ) -> list[CheckpointRecord]:
        """Checkpoints of every run of the namespace that match an MLflow-style filter,
        e.g. ``"metrics.accuracy > 0.9 and tags.split = 'val'"``, in ``order_by`` order
        (e.g. ``["metrics.accuracy DESC"]``; default: report order), at most ``k``.

        The grammar is in validation_service/registry/search.py; a filter that does not
        parse raises InvalidSearch naming the position and what was expected.
        """
        with self.db.read() as session:
            records = search.search(session, self.namespace, filter, order_by, k)
            return alias_store.with_aliases_and_tags(session, records)

    # ------------------------------------------------ evaluations over history
    def revalidate(
        self,
        run_or_runs: str | Sequence[str] | Sequence[CheckpointRecord],
        validate_fn: Any,
        *,
        validator: str,
        validate_config: dict | None = None,
        reports: Sequence[int] | None = None,
        validation_resources: dict | None = None,
        priority: int = 0,
        force: bool = False,
    ) -> list[int]:
        """Queues ``validate_fn`` under the name ``validator`` for every stored checkpoint
        of a run, of a list of runs, or of a search() result (only the report indices in
        ``reports``, when given); returns the new job ids.

        Its metrics are kept apart from the checkpoint's own (``checkpoints()`` groups
        them by validator; ``best_checkpoints(..., validator=...)`` ranks by them). A
        checkpoint with a QUEUED, RUNNING or SUCCEEDED job of ``validator`` gets none
        unless ``force``; deleted checkpoints are skipped and named in a log warning.
        The jobs run after the live runs' validations of their pool, ``priority``
        ordering them among themselves. ``validate_fn``: a callable, a
        "package.module:function" reference, or a CommandValidator.
        """
        request = evaluations.evaluation_request(
            validate_fn, validate_config, validation_resources, validator, priority
        )
        done = evaluations.revalidate(self, run_or_runs, request, reports=reports, force=force)
        if done.deleted:
            logger.warning("revalidate %r skipped deleted checkpoints %s", validator, done.deleted)
        return done.job_ids

    def register(
        self, run: str, uri: str, *, metrics: dict | None = None, step: int | None = None
    ) -> int:
        """Adds an existing checkpoint folder (a local path or any fsspec URI) to ``run``
        without copying it, so that revalidate() can evaluate it like any other; returns
        its report index. The run is made (FINISHED) if it does not exist. Retention and
        ``ckval gc`` never delete such a folder."""
        return evaluations.register(self, run, uri, metrics, step)

    def _ray_checkpoint(self, record: CheckpointRecord):
        from validation_service.storage import ray_checkpoint

        return ray_checkpoint(record.uri, self.settings.storage_options)

    # ------------------------------------------------------------------- jobs
    @retry_on_disconnect
    def validations(self, run: str) -> list[JobRecord]:
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
            return self.queue.validations(session, run_id, run)

    @retry_on_disconnect
    def list_jobs(
        self,
        run: str | None = None,
        *,
        statuses: Iterable[JobStatus | str] | None = None,
        pool: str | None = None,
        limit: int | None = None,
    ) -> list[JobRecord]:
        """Validation jobs of the whole queue (of this namespace), or of one run.

        ``statuses`` and ``pool`` filter; ``limit`` keeps the newest jobs. In id order.
        """
        wanted = None if statuses is None else [validation.job_status(s).value for s in statuses]
        if limit is not None and limit < 1:
            raise InvalidInput(f"limit must be at least 1, got {limit}")
        with self.db.read() as session:
            run_id = None if run is None else self.catalog.require_run_id(session, run)
            return self.queue.list_jobs(
                session, self.namespace, run_id=run_id, statuses=wanted, pool=pool, limit=limit
            )

    @retry_on_disconnect
    def get_job(self, job_id: int, *, namespace: str | None = None) -> JobRecord:
        """The job with this id; with ``namespace``, a job of another namespace is
        JobNotFound too (the HTTP API passes its own)."""
        return self.queue.get_job(validation.check_job_id(job_id), namespace)

    @retry_on_disconnect
    def job_counts(self, run: str | None = None) -> dict[str, int]:
        with self.db.read() as session:
            run_id = None if run is None else self.catalog.require_run_id(session, run)
            return self.queue.job_counts(session, run_id)

    def wait(
        self,
        run: str,
        timeout_s: float = 300.0,
        poll_s: float = 0.05,
        *,
        progress: bool | ProgressRenderer = False,
        raise_on_failure: bool = False,
    ) -> None:
        """Returns when no job of the run is QUEUED or RUNNING; raises TimeoutError otherwise.

        ``progress=True`` shows a live line of the run's counts on standard error (or pass
        a ProgressRenderer). Validations that ended FAILED or TIMED_OUT are named in a
        ValidationsFailedWarning, or raised as ValidationsFailed with ``raise_on_failure``.
        """
        waiting.wait_for_run(self, run, timeout_s, poll_s, progress, raise_on_failure)

    def cancel_jobs(
        self, job_ids: Sequence[int] | None = None, *, run: str | None = None, reason: str = ""
    ) -> list[int]:
        """Cancels QUEUED and RUNNING jobs; a RUNNING one loses its lease at once."""
        if job_ids is None and run is None:
            raise InvalidInput("cancel needs job ids or a run name")
        run_id = self._run_id_or_none(run)
        return self.job_queue.cancel(validation.existing_job_ids(job_ids), run_id, reason)

    def retry_jobs(
        self,
        job_ids: Sequence[int] | None = None,
        *,
        run: str | None = None,
        statuses: Iterable[JobStatus] = RETRYABLE_STATUSES,
        max_retries: int | None = None,
    ) -> list[int]:
        """Requeues FAILED, TIMED_OUT and CANCELLED jobs (or only ``statuses`` of those)
        with a fresh attempt budget.

        With ``max_retries``, a job makes at most max_attempts x (1 + max_retries) attempts
        in all: one that made them is not retried, and the last budget is cut to what is
        left. A named job id that made them raises RetryLimitReached and nothing is
        retried; a run's such jobs are left as they are (RetryLimitReached when that is
        all of them).
        """
        if job_ids is None and run is None:
            raise InvalidInput("retry needs job ids or a run name")
        statuses = [JobStatus(s) for s in statuses]
        if not set(statuses) <= transitions.FROM_STATES["retry"]:
            raise InvalidInput(f"only {[s.value for s in RETRYABLE_STATUSES]} jobs are retried")
        run_id = self._run_id_or_none(run)
        return self.job_queue.retry(
            validation.existing_job_ids(job_ids), run_id, statuses, max_retries
        )

    def _run_id_or_none(self, run: str | None) -> int | None:
        if run is None:
            return None
        with self.db.read() as session:
            return self.catalog.require_run_id(session, run)


def _url_source(database_url: str | None, settings: Settings) -> str:
    """Where a registry's URL came from, for the errors that say what to fix."""
    if database_url:
        return "the database_url argument"
    return "CKVAL_DATABASE_URL" if settings.database_url else "CKVAL_HOME"


def _with_status(runs: list[RunRecord], status: RunStatus | str | None) -> list[RunRecord]:
    if status is None:
        return runs
    try:
        wanted = RunStatus(status).value
    except ValueError:
        known = ", ".join(s.value for s in RunStatus)
        raise InvalidInput(f"run status must be one of {known}, got {status!r}") from None
    return [run for run in runs if run.status == wanted]
