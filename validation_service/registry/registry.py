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
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy.exc import IntegrityError

from validation_service import validation
from validation_service.config import Settings, get_settings
from validation_service.errors import (
    InvalidInput,
    JobNotFound,
    RegistryRejected,
    ReportIndexTaken,
    RetryLimitReached,
    UnknownMetric,
    ValidationsFailed,
    ValidationsFailedWarning,
    failed_validations_message,
)
from validation_service.jobs import ACTIVE_JOB_STATUSES, JobStatus, RunStatus, ValidationStatus
from validation_service.metrics import lower_is_better, normalize_metrics
from validation_service.names import check_name
from validation_service.progress import ProgressRenderer
from validation_service.registry import aliases as alias_store
from validation_service.registry import retention, search, stats, transitions
from validation_service.registry.catalog import Catalog, Mode, check_run_name, checkpoint_row
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
# What wait() reports as failed validations (a CANCELLED job was stopped on purpose).
FAILED_STATUSES = (JobStatus.FAILED, JobStatus.TIMED_OUT)


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
    def find_run_id(self, name: str) -> int | None:
        """The id of the named run's latest attempt in this namespace, or None; writes nothing."""
        return self.catalog.find_run_id(name)

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
    def run_attempts(self, name: str) -> list[RunRecord]:
        """Every attempt of the named run, the first first; RunNotFound if there is none."""
        with self.db.read() as session:
            self.catalog.require_run_id(session, name)
            return [run for run in self.catalog.runs(session) if run.name == name]

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

    @retry_on_disconnect
    def runs(self, status: RunStatus | str | None = None) -> list[RunRecord]:
        """Every attempt of every run of the namespace (only those in ``status``)."""
        with self.db.read() as session:
            return _with_status(self.catalog.runs(session), status)

    @retry_on_disconnect
    def run_summaries(self, status: RunStatus | str | None = None) -> list[RunSummary]:
        """Every run attempt (only those in ``status``) with its checkpoint count and job
        counts, in three queries."""
        with self.db.read() as session:
            runs = _with_status(self.catalog.runs(session), status)
            checkpoints = self.catalog.checkpoint_counts(session)
            jobs = self.queue.job_counts_by_run(session, self.namespace)
        return [RunSummary(run, checkpoints.get(run.id, 0), jobs.get(run.id, {})) for run in runs]

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
        except IntegrityError as exc:
            # The same run + report index was registered before (or concurrently).
            with self.db.read() as session:
                existing = self.catalog.find_checkpoint(session, run_id, report_index)
                if existing is None:
                    # Some other constraint (a run that is gone, say): not a repeat.
                    raise RegistryRejected(self.display_url, exc) from exc
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

    @retry_on_disconnect
    def checkpoints(
        self,
        run: str,
        *,
        include_deleted: bool = False,
        tags: dict[str, str] | None = None,
        attempt: int | None = None,
    ) -> list[CheckpointRecord]:
        """The run's checkpoints in report order, with their aliases and tags.

        ``tags``: only those with every key = value; ``attempt``: of that attempt of
        the run (default: its latest).
        """
        records = self.catalog.checkpoints(
            run, include_deleted=include_deleted, tags=tags, attempt=attempt
        )
        with self.db.read() as session:
            return alias_store.with_aliases_and_tags(session, records)

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
    ) -> list[tuple[Any, dict[str, Any]]]:
        """Top-k checkpoints by a metric: [(ray.train.Checkpoint, metrics), ...].

        Uses the merged metrics (a validated value overrides a reported one of the same
        name). NaN and infinite values are never ranked, deleted checkpoints neither. Ties
        go to the earlier report. ``run``: its latest attempt (or ``attempt``); None: every
        run of the namespace. ``tags``: only checkpoints with every key = value. ``mode``
        defaults to "max"; left out for a metric named like a loss or an error, it warns
        that the highest values come first.
        """
        validation.check_k(k)
        records = self._best(run, metric, mode or "max", k, tags, attempt)
        if mode is None and records and lower_is_better(metric):
            warnings.warn(
                f"best_checkpoints ranked {metric!r} with mode='max' (the default), but its "
                "name says lower is better: pass mode='min' for the lowest values "
                "(mode='max' keeps the highest and silences this warning).",
                UserWarning,
                stacklevel=2,
            )
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
    ) -> list[CheckpointRecord]:
        """As best_checkpoints, as records with their aliases and tags."""
        validation.check_k(k)
        records = self._best(run, metric, mode, k, tags, attempt)
        with self.db.read() as session:
            return alias_store.with_aliases_and_tags(session, records)

    @retry_on_disconnect
    def _best(self, run, metric, mode, k, tags, attempt) -> list[CheckpointRecord]:
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
        return self._refresh_tracked_aliases(run_id).get(alias)

    @retry_on_disconnect
    def refresh_tracked_aliases(self, run: str) -> dict[str, int]:
        """Moves the run's tracked aliases onto its current best checkpoints; returns
        alias -> report index of those that point somewhere."""
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
        return self._refresh_tracked_aliases(run_id)

    def _refresh_tracked_aliases(self, run_id: int) -> dict[str, int]:
        pointed: dict[str, int] = {}
        with self.db.write() as conn:
            for alias, metric, mode in alias_store.tracking_rules(conn, run_id):
                best = self.catalog.best(conn, run_id, metric, mode, 1)
                if best:
                    alias_store.set_alias(conn, run_id, alias, best[0].id)
                    pointed[alias] = best[0].report_index
        return pointed

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
        """
        rule = retention.RetentionRule(
            metric, mode, keep_best, keep_best_per_run, keep_latest, run=run
        )
        return self._apply_retention(self.catalog, rule, dry_run=bool(dry_run), strict=True)

    @retry_on_disconnect
    def _apply_retention(
        self,
        catalog: Catalog,
        rule: retention.RetentionRule,
        *,
        dry_run: bool,
        strict: bool,
        exclude_runs: Sequence[str] = (),
    ) -> list[CheckpointRecord]:
        with self.db.read() as session:
            run_id = None if rule.run is None else catalog.require_run_id(session, rule.run)
            found = retention.candidates(session, catalog.namespace, rule.run, exclude_runs)
            found = retention.with_values(session, found, rule.metric)
            if not any(c.value is not None for c in found):
                known = catalog.known_metrics(session, run_id)
                if rule.metric not in known:
                    if not strict:
                        return []
                    raise UnknownMetric(rule.metric, rule.run, sorted(known))
            aliased = retention.aliased_ids(session, [c.record.id for c in found])
        going = retention.to_delete(found, rule, aliased)
        if dry_run or not going:
            return [c.record for c in going]
        now = utcnow()
        with self.db.write() as conn:
            marked = retention.mark_deleted(conn, [c.record.id for c in going], now)
        deleted = [c for c in going if c.record.id in marked]
        self._delete_files(deleted)
        return [dataclasses.replace(c.record, deleted_at=now) for c in deleted]

    def _delete_files(self, deleted: Sequence[retention.Candidate]) -> None:
        """Removes deleted checkpoints' files; a failure is logged, the rows stay marked."""
        from validation_service.storage import CheckpointStorage

        storages: dict[str, CheckpointStorage] = {}
        for candidate in deleted:
            uri = candidate.record.uri
            try:
                root = candidate.storage_root
                if root not in storages:
                    storages[root] = CheckpointStorage(root, self.settings.storage_options)
                storages[root].delete(uri)
            except Exception as exc:  # noqa: BLE001 - the row is marked; say what is left
                logger.warning(
                    "checkpoint %d of run %r is marked deleted but its files at %s could "
                    "not be removed (%s: %s); remove them by hand",
                    candidate.record.report_index,
                    candidate.record.run,
                    uri,
                    type(exc).__name__,
                    exc,
                )

    @retry_on_disconnect
    def set_retention(
        self,
        run: str | None = None,
        *,
        metric: str,
        mode: Mode = "max",
        keep_best: int = 0,
        keep_best_per_run: int = 1,
        keep_latest: int = 1,
    ) -> retention.RetentionRule:
        """Stores a retention policy for the run name (None: for the namespace) that the
        service applies as validations finish; the arguments are apply_retention's.

        A run's own policy replaces the namespace's for that run.
        """
        rule = retention.RetentionRule(
            metric, mode, keep_best, keep_best_per_run, keep_latest, run=run
        )
        if run is not None:
            check_run_name(run)
        with self.db.write() as conn:
            retention.save_policy(conn, self.namespace, rule)
        return rule

    @retry_on_disconnect
    def clear_retention(self, run: str | None = None) -> bool:
        """Removes the stored policy of the run name (None: the namespace's)."""
        with self.db.write() as conn:
            return retention.remove_policy(conn, self.namespace, run)

    @retry_on_disconnect
    def retention_policies(self) -> dict[str | None, retention.RetentionRule]:
        """Run name (None: the namespace's own policy) -> its stored retention policy."""
        with self.db.read() as session:
            return retention.policies(session, self.namespace)

    def after_validation(self, run_id: int) -> None:
        """What follows merged metrics: the run's tracked aliases move to its best
        checkpoints, then its stored retention policy (else its namespace's) applies.

        Never raises: the validation's outcome is recorded already; a failure is logged.
        """
        try:
            # One read finds out whether anything is to do (usually nothing): no write
            # transaction per finished validation without rules or policies.
            with self.db.read() as session:
                rules = alias_store.tracking_rules(session, run_id)
                scope = retention.run_of(session, run_id)
                stored = retention.policies(session, scope[0]) if scope else {}
            if rules:
                self._refresh_tracked_aliases(run_id)
            if not scope or not stored:
                return
            namespace, name = scope
            catalog = self.catalog if namespace == self.namespace else Catalog(self.db, namespace)
            if name in stored:
                self._apply_retention(catalog, stored[name], dry_run=False, strict=False)
            elif None in stored:
                own = [run for run in stored if run is not None]
                self._apply_retention(
                    catalog, stored[None], dry_run=False, strict=False, exclude_runs=own
                )
        except Exception:  # noqa: BLE001 - aliases and retention catch up on the next one
            logger.exception("tracked aliases or retention after a validation of run id %s", run_id)

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
        wanted = None if statuses is None else [_job_status(s).value for s in statuses]
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
        deadline = time.monotonic() + timeout_s
        renderer = ProgressRenderer() if progress is True else progress or None
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
        try:
            while True:
                with self.db.read() as session:
                    counts = self.queue.job_counts(session, run_id)
                if renderer is not None:
                    renderer.update(run, counts)
                active = sum(counts.get(s.value, 0) for s in ACTIVE_JOB_STATUSES)
                if not active:
                    break
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{active} validation(s) of run {run!r} still QUEUED or RUNNING after "
                        f"{timeout_s:g}s. Is the service running? (`ckval status`)"
                    )
                time.sleep(poll_s)
        finally:
            if renderer is not None:
                renderer.close()
        if any(counts.get(s.value, 0) for s in FAILED_STATUSES):
            failed = failed_jobs(self.validations(run))
            if raise_on_failure:
                raise ValidationsFailed(run, failed, sum(counts.values()))
            warnings.warn(
                ValidationsFailedWarning(
                    failed_validations_message(run, failed, sum(counts.values()))
                ),
                stacklevel=2,
            )

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
        try:
            return self._finish_job(job_id, lease_token, outcome, metrics, policy)
        except IntegrityError as exc:  # no unique key is written here: a rule of the database
            raise RegistryRejected(self.display_url, exc) from exc

    def _finish_job(self, job_id, lease_token, outcome, metrics, policy) -> bool:
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
            else:
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
        if metrics is not None:
            # Merged metrics may move tracked aliases and let retention delete.
            self.after_validation(job.run_id)
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
        job_ids = _existing_ids(job_ids)
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
        job_ids = _existing_ids(job_ids)
        run_id = self._run_id_or_none(run)
        now = utcnow()
        with self.db.write() as conn:
            jobs = self.queue.select_jobs(conn, statuses, job_ids, run_id)
            if max_retries is not None:
                spent = [j.id for j in jobs if j.attempts >= j.max_attempts * (1 + max_retries)]
                if spent and (job_ids is not None or len(spent) == len(jobs)):
                    raise RetryLimitReached(spent, max_retries)
                jobs = [job for job in jobs if job.id not in spent]
            return transitions.retry(conn, jobs, now, max_retries=max_retries)

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


def _existing_ids(job_ids: Sequence[int] | None) -> list[int] | None:
    """Job ids that can exist: ids out of the column's range name no job, as unknown ids."""
    if job_ids is None:
        return None
    existing = []
    for job_id in job_ids:
        try:
            existing.append(validation.check_job_id(job_id))
        except JobNotFound:
            continue
    return existing


def _job_status(status: JobStatus | str) -> JobStatus:
    try:
        return JobStatus(str(getattr(status, "value", status)).upper())
    except ValueError:
        names = ", ".join(s.value for s in JobStatus)
        raise InvalidInput(f"unknown job status {status!r}: use one of {names}") from None


def _with_status(runs: list[RunRecord], status: RunStatus | str | None) -> list[RunRecord]:
    if status is None:
        return runs
    try:
        wanted = RunStatus(status).value
    except ValueError:
        known = ", ".join(s.value for s in RunStatus)
        raise InvalidInput(f"run status must be one of {known}, got {status!r}") from None
    return [run for run in runs if run.status == wanted]


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


def failed_jobs(jobs: Iterable[JobRecord]) -> dict[int, str]:
    """Job id -> "STATUS: error" for the jobs that ended FAILED or TIMED_OUT."""
    failed = {}
    for job in jobs:
        if job.status in {s.value for s in FAILED_STATUSES}:
            error = f"{job.error_type or 'error'}: {job.error_message or 'no message'}"
            first_line = error.strip().splitlines()[0]
            reason = f"report {job.report_index}, {job.status}, {first_line}"
            failed[job.id] = reason if len(reason) <= 160 else reason[:157] + "..."
    return failed
