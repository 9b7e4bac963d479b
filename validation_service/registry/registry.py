"""Registry: the users' query API (runs, checkpoints, best, latest, aliases, tags,
search, wait, retention, stop policies) and the operators' job commands.

Each call opens the one transaction it takes, here, and runs the statements of the
catalog, the queue, aliases.py and the others in it. The parts other audiences use are
built by composition.py: the reporter's ``ledger`` and ``assemblies``, the scheduler's
``job_queue``, the dashboard's ``dashboard``; a Registry holds them too, for tools and
tests.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

from validation_service import validation
from validation_service.config import Settings, get_settings
from validation_service.errors import (
    InvalidInput,
    UnknownMetric,
)
from validation_service.jobs import DEFAULT_VALIDATOR, RunStatus
from validation_service.metrics import lower_is_better
from validation_service.registry import aliases as alias_store
from validation_service.registry import (
    assemblies,
    composition,
    costs,
    evaluations,
    outside_folders,
    queue,
    retention,
    search,
    stopping,
    watches,
)
from validation_service.registry.assemblies import AssemblyRecord
from validation_service.registry.catalog import Mode, Ranking, check_run_name
from validation_service.registry.database import Database, retry_on_disconnect
from validation_service.registry.housekeeping import move_tracked_aliases
from validation_service.registry.records import (
    CheckpointRecord,
    RunRecord,
    RunSummary,
    StopDecision,
    run_summaries,
)
from validation_service.registry.registry_jobs import RegistryJobs
from validation_service.stopping import StopPolicy

logger = logging.getLogger(__name__)


class Registry(RegistryJobs):
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
        settings = settings or get_settings()
        namespace = composition.namespace_of(namespace, settings)
        db = composition.open_database(
            settings, database_url, upgrade=upgrade, check_schema=check_schema
        )
        self._take(db, settings, namespace)

    @classmethod
    def on_database(
        cls, db: Database, settings: Settings, *, namespace: str | None = None
    ) -> Registry:
        """A Registry over a Database opened already (composition.open_database)."""
        registry = cls.__new__(cls)
        registry._take(db, settings, composition.namespace_of(namespace, settings))
        return registry

    def _take(self, db: Database, settings: Settings, namespace: str) -> None:
        self.settings = settings
        self.namespace = namespace
        self.db = db
        self.url = db.url
        self.engine = db.engine
        parts = composition.registry_parts(db, namespace, settings)
        self.catalog = parts.catalog
        self.ledger = parts.ledger
        self.stopping = parts.stopping
        self.housekeeping = parts.housekeeping
        self.job_queue = parts.job_queue
        self.assemblies = parts.assemblies
        self.dashboard = parts.dashboard
        self.replicas = parts.replicas
        self.watch_listings = parts.watch_listings

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
        with self.db.read() as session:
            return self.catalog.run_id(session, name)

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
        counts, latest stop decision and what its validations held (accelerator-seconds),
        in five queries."""
        with self.db.read() as session:
            runs = _with_status(self.catalog.runs(session), status)
            checkpoints = self.catalog.checkpoint_counts(session)
            jobs = queue.job_counts_by_run(session, self.namespace)
            stops = stopping.latest_decisions(session, self.namespace)
            spent = costs.cost_by_run(session, self.namespace)
        return run_summaries(runs, checkpoints, jobs, stops, spent)

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

        ``tags``: only those with every key = value, set on the checkpoint or on its
        run (run tags such as ``tune_experiment``); ``attempt``: of that attempt of the
        run (default: its latest).
        """
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run, attempt)
            records = self.catalog.checkpoints(
                session, run_id, run, include_deleted=include_deleted, tags=tags
            )
            return evaluations.labelled(session, records)

    @retry_on_disconnect
    def latest_checkpoint(self, run: str, *, attempt: int | None = None, before: int | None = None):
        """The newest checkpoint of the run's latest attempt (or of ``attempt``) as a
        ray.train.Checkpoint (resume after a crash); deleted checkpoints are skipped, and
        with ``before`` those reported at that report index or later."""
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run, attempt)
            record = self.catalog.latest(session, run_id, run, before)
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
        run of the namespace. ``tags``: only checkpoints with every key = value, on the
        checkpoint or on its run (a Ray Tune search: ``{"tune_experiment": name}``). ``mode``
        defaults to "max"; left out for a metric named like a loss or an error, it warns
        that the highest values come first. ``validator``: rank by that named evaluation's
        values (see revalidate); the metrics returned are then that evaluation's.
        """
        validation.check_k(k)
        ranking = Ranking(metric, mode or "max", k, tags, validator)
        records = self._best_records(run, attempt, ranking)
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
        ranking = Ranking(metric, mode, k, tags, validator)
        with self.db.read() as session:
            records = self._best(session, run, attempt, ranking)
            return alias_store.with_aliases_and_tags(session, records)

    @retry_on_disconnect
    def _best_records(self, run, attempt, ranking: Ranking) -> list[CheckpointRecord]:
        """best_checkpoints' records, in one read (its warning is raised outside the
        disconnect retry, so that it points at the caller)."""
        with self.db.read() as session:
            return self._best(session, run, attempt, ranking)

    def _best(self, session, run, attempt, ranking: Ranking) -> list[CheckpointRecord]:
        if ranking.validator != DEFAULT_VALIDATOR:
            return evaluations.best_records(session, self.catalog, run, attempt, ranking)
        run_id = None if run is None else self.catalog.require_run_id(session, run, attempt)
        records = self.catalog.best(session, run_id, ranking)
        if records:
            return records
        metric = ranking.metric
        known = self.catalog.known_metrics(session, run_id)
        # Recorded only as NaN/inf or non-numeric values, or perhaps still to come with a
        # pending validation: no error, no checkpoints.
        if metric in known or queue.active_count(session, run_id):
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
        with self.db.write() as conn:
            run_id = self.catalog.require_run_id(conn, run)
            checkpoint_id = alias_store.live_checkpoint_id(conn, run_id, run, report_index)
            alias_store.set_alias(conn, run_id, alias, checkpoint_id)

    def get_alias(self, run: str, alias: str) -> tuple[Any, dict[str, Any]]:
        """The checkpoint the run's alias points at: (ray.train.Checkpoint, metrics)."""
        record = self.get_alias_record(run, alias)
        return self._ray_checkpoint(record), record.metrics

    @retry_on_disconnect
    def get_alias_record(self, run: str, alias: str) -> CheckpointRecord:
        """The checkpoint the run's alias points at (deleted or not), with its aliases and
        tags; AliasNotFound naming the run's aliases otherwise."""
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
            record = self.catalog.aliased(session, run_id, run, alias)
            if record is None:
                raise alias_store.alias_not_found(session, run_id, run, alias)
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
        with self.db.write() as conn:
            run_id = self.catalog.require_run_id(conn, run)
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
        with self.db.write() as conn:
            run_id = self.catalog.require_run_id(conn, run)
            alias_store.track_alias(conn, run_id, alias, metric, mode)
            return move_tracked_aliases(conn, self.catalog, run_id).get(alias)

    @retry_on_disconnect
    def tag(self, run: str, report_index: int, key: str, value: str | None) -> None:
        """Sets a string tag on one checkpoint of the run (``value`` None removes it)."""
        alias_store.check_tag(key, value)
        with self.db.write() as conn:
            run_id = self.catalog.require_run_id(conn, run)
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
        with self.db.read() as session:
            run_ids = [r.id for r in self.catalog.runs(session) if r.name == run]
            if not run_ids:
                self.catalog.require_run_id(session, run)  # RunNotFound, naming the runs
            return assemblies.not_complete(session, run_ids)

    def retention_plan(self, run: str | None = None, **rule: Any) -> retention.RetentionPlan:
        """What apply_retention(run, **rule) would do now, deleting nothing (the same
        keyword arguments but dry_run): what it deletes, and what it keeps as outside
        the storage roots of this registry's settings."""
        planned = retention.RetentionRule(**rule, run=run)
        going, kept = self.housekeeping.plan_retention(self.catalog, planned, strict=True)
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
        stopping.check_policy(run, policy)
        with self.db.write() as conn:
            stopping.store_policy(conn, self.namespace, run, policy)
            run_id = None if policy is None else self.catalog.run_id(conn, run)
            if run_id is not None:  # the results the run has already
                stopping.judge(conn, run_id)
        return policy

    @retry_on_disconnect
    def stop_policy(self, run: str) -> StopPolicy | None:
        """The run name's stored policy, or None."""
        check_run_name(run)
        with self.db.read() as session:
            return stopping.stored_policy(session, self.namespace, run)

    @retry_on_disconnect
    def stop_decision(self, run: str) -> StopDecision | None:
        """Why the run's latest attempt should stop (``overridden_at`` set once resumed),
        or None while no rule decided or before its first report."""
        with self.db.read() as session:
            run_id = self.catalog.run_id(session, run)
            return None if run_id is None else stopping.latest_decision(session, run_id)

    @retry_on_disconnect
    def resume_despite_stop(self, run: str) -> StopDecision:
        """Overrides the run's stop decision, recording when; the rules judge again, from
        the checkpoints reported after now. InvalidInput when the run is not stopped."""
        with self.db.write() as conn:
            decision = stopping.override(conn, run, self.catalog.require_run_id(conn, run))
        logger.info("run %r goes on despite its stop decision (%s)", run, decision.reason)
        return decision

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
        return outside_folders.register(self, run, uri, metrics, step)

    # -------------------------------------------------------- watched folders
    def watch(
        self,
        uri: str,
        run: str,
        validate_fn: Any,
        *,
        validator: str = DEFAULT_VALIDATOR,
        validate_config: dict | None = None,
        validation_resources: dict | None = None,
        ready: str = "auto",
        pattern: str | None = None,
        copy: bool = False,
    ) -> int:
        """Has the running service follow a folder (a local path or any fsspec URI) that a
        trainer saves step folders into; returns the watch's id.

        Each new step folder (its step: the last integer of its name) is registered into
        ``run`` once it is complete, in place (never copied, never deleted by gc, as
        register()), with ``validate_fn`` as its validation under ``validator``; its
        step is the metric "step". ``ready``: "auto" (a DCP ``.metadata`` or a Hugging
        Face ``trainer_state.json`` in it, else nothing changed for CKVAL_WATCH_SETTLE_S),
        "marker:NAME" or "stable:SECONDS". ``pattern``: a glob the step folders' names
        match. ``copy=True`` copies each into ckval's storage first, so that the
        trainer's own rotation cannot delete it before it is validated.
        """
        options = locals()
        del options["self"], options["uri"], options["run"], options["validate_fn"]
        return watches.watch(self, uri, run, validate_fn, **options)

    @retry_on_disconnect
    def unwatch(self, watch_id: int) -> None:
        """Ends a watch: its folder is listed no more; what it registered stays."""
        validation.check_int(watch_id, "watch id", 1, validation.INT32_MAX)
        with self.db.write() as conn:
            if watches.remove_watch(conn, self.namespace, watch_id):
                return
        raise InvalidInput(
            f"no live watch {watch_id} in namespace {self.namespace!r}; `ckval watches` lists them"
        )

    @retry_on_disconnect
    def watches(self, run: str | None = None) -> list[watches.WatchRecord]:
        """The live watches (of ``run``), each with its step folders registered and those
        still waiting to be complete (and since when)."""
        with self.db.read() as session:
            return watches.list_watches(session, self.namespace, run)

    def _ray_checkpoint(self, record: CheckpointRecord):
        from validation_service.storage import ray_checkpoint

        return ray_checkpoint(record.uri, self.settings.storage_options)


def _with_status(runs: list[RunRecord], status: RunStatus | str | None) -> list[RunRecord]:
    if status is None:
        return runs
    try:
        wanted = RunStatus(status).value
    except ValueError:
        known = ", ".join(s.value for s in RunStatus)
        raise InvalidInput(f"run status must be one of {known}, got {status!r}") from None
    return [run for run in runs if run.status == wanted]
