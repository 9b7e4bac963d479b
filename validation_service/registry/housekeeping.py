"""Housekeeping after merged metrics: the run's stop policy judged (registry/stopping.py),
tracked aliases moved onto the best checkpoints, retention applied (rows marked deleted,
then their files removed from storage).

``Registry.housekeeping``; the job queue calls ``after_validation`` after a success.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections.abc import Sequence

from sqlalchemy import bindparam, exists, select
from sqlalchemy.engine import Connection, Row

from validation_service.config import Settings
from validation_service.errors import UnknownMetric
from validation_service.registry import aliases as alias_store
from validation_service.registry import retention
from validation_service.registry.catalog import Catalog, Ranking
from validation_service.registry.database import Database, retry_on_disconnect
from validation_service.registry.models import (
    RetentionPolicy,
    Run,
    StopPolicyRow,
    TrackedAlias,
    utcnow,
)
from validation_service.registry.records import CheckpointRecord
from validation_service.registry.stopping import StopRules, judge
from validation_service.secrets import mask_url

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Marked:
    """Checkpoints marked deleted by retention (``at``), whose files are removed once the
    marks are committed; ``shared``: the ids of those whose folder another record uses."""

    deleted: list[retention.Candidate]
    shared: set[int]
    at: dt.datetime


class Housekeeping:
    """Stop decisions, tracked aliases and retention, for the catalog of any namespace of
    the database."""

    def __init__(self, db: Database, catalog: Catalog, settings: Settings, stopping: StopRules):
        self.db = db
        self.catalog = catalog
        self.settings = settings
        self.stopping = stopping

    def refresh_tracked_aliases(self, run_id: int) -> dict[str, int]:
        """Moves the run's tracked aliases onto its current best checkpoints; returns
        alias -> report index of those that point somewhere."""
        with self.db.write() as conn:
            return move_tracked_aliases(conn, self.catalog, run_id)

    @retry_on_disconnect
    def plan_retention(
        self,
        catalog: Catalog,
        rule: retention.RetentionRule,
        *,
        strict: bool,
        exclude_runs: Sequence[str] = (),
    ) -> tuple[list[retention.Candidate], list[retention.Candidate]]:
        """(deletable, kept outside the configured storage): the checkpoints of
        ``catalog``'s namespace that no part of ``rule`` keeps (see
        Registry.apply_retention); ``strict``: an unknown metric raises UnknownMetric,
        else nothing goes."""
        with self.db.read() as session:
            return self._plan(session, catalog, rule, strict, exclude_runs)

    def _plan(self, conn, catalog, rule, strict, exclude_runs):
        """plan_retention's answer, in the caller's transaction."""
        run_id = None if rule.run is None else catalog.require_run_id(conn, rule.run)
        found = retention.candidates(conn, catalog.namespace, rule.run, exclude_runs)
        found = retention.with_values(conn, found, rule.metric)
        ranked = rule.keep_best or rule.keep_best_per_run  # else the metric plays no part
        if ranked and not any(c.value is not None for c in found):
            known = catalog.known_metrics(conn, run_id)
            if rule.metric not in known:
                if not strict:
                    return [], []
                raise UnknownMetric(rule.metric, rule.run, sorted(known))
        aliased = retention.aliased_ids(conn, [c.record.id for c in found])
        going = retention.to_delete(found, rule, aliased)
        roots = self.settings.deletion_roots()
        return retention.split_by_storage(going, roots, self.settings.storage_options)

    def apply_retention(
        self,
        catalog: Catalog,
        rule: retention.RetentionRule,
        *,
        dry_run: bool,
        strict: bool,
        exclude_runs: Sequence[str] = (),
    ) -> list[CheckpointRecord]:
        """Deletes what plan_retention finds deletable (rows marked deleted in one
        transaction, then files removed); returns those checkpoints, or with ``dry_run``
        those that would go."""
        if dry_run:
            going, _kept = self.plan_retention(
                catalog, rule, strict=strict, exclude_runs=exclude_runs
            )
            return [c.record for c in going]
        with self.db.write() as conn:
            marked = self._mark(conn, catalog, rule, strict, exclude_runs)
        return self._remove_files(catalog, marked)

    def _mark(self, conn, catalog, rule, strict, exclude_runs) -> _Marked:
        """The rows apply_retention deletes, marked in the caller's write transaction."""
        going, _kept = self._plan(conn, catalog, rule, strict, exclude_runs)
        now = utcnow()
        marked = retention.mark_deleted(conn, [c.record.id for c in going], now) if going else ()
        deleted = [c for c in going if c.record.id in marked]
        shared = retention.shared_folders(conn, deleted) if deleted else set()
        return _Marked(deleted, shared, now)

    def _remove_files(self, catalog: Catalog, marked: _Marked) -> list[CheckpointRecord]:
        """Removes the files of the rows marked deleted, once their marks are committed."""
        if marked.deleted:
            retention.delete_files(
                marked.deleted, marked.shared, catalog.namespace, self.settings.storage_options
            )
        return [dataclasses.replace(c.record, deleted_at=marked.at) for c in marked.deleted]

    def remove_incomplete(self, assemblies, run_ids: list[int] | None) -> int:
        """Ends the assemblies of ended runs whose parts never all came, and removes the
        files of every INCOMPLETE assembly: inside its own run's folder, and only under
        the storage roots of these settings (CKVAL_STORAGE, CKVAL_DELETABLE_ROOTS), as
        retention does. Returns how many folders went."""
        from validation_service.storage import CheckpointStorage

        assemblies.give_up_ended_runs(run_ids)
        options = self.settings.storage_options
        roots = [CheckpointStorage(root, options) for root in self.settings.deletion_roots()]
        removed = 0
        for assembly_id, uri, run, namespace, root in assemblies.incomplete_to_delete(run_ids):
            try:
                storage = CheckpointStorage(root, options)
                if not any(r.in_root(root) and r.in_root(uri) for r in roots):
                    logger.warning(
                        "the parts of an incomplete checkpoint of run %r at %s: %s",
                        *(run, mask_url(uri), retention.KEPT_OUTSIDE),
                    )
                    continue
                storage.delete(uri, namespace=namespace, run=run)
                removed += 1
            except Exception as exc:  # noqa: BLE001 - say what is left, go on with the rest
                logger.warning(
                    "the parts of an incomplete checkpoint of run %r at %s could not be "
                    "removed (%s: %s); remove them by hand",
                    *(run, mask_url(uri), type(exc).__name__, exc),
                )
                continue
            assemblies.mark_deleted(assembly_id)
        return removed

    def after_validation(self, run_id: int, todo: Row | None) -> None:
        """What follows merged metrics, as ``todo`` (to_do_after, read with the outcome)
        says: the run's stop policy is judged (a decision is stored once), its tracked
        aliases move to its best checkpoints, and its stored retention policy (else its
        namespace's) marks checkpoints deleted, in one transaction; their files are
        removed once it commits.

        Never raises: the validation's outcome is recorded already; a failure is logged
        and the next validation of the run catches up.
        """
        if todo is None or not (todo.judged or todo.tracked or todo.retained):
            return  # as a rule: no policy, no tracked alias, no retention
        try:
            catalog = self.catalog
            if todo.namespace != catalog.namespace:
                catalog = Catalog(todo.namespace)
            with self.db.write() as conn:
                if todo.judged:
                    judge(conn, run_id)
                if todo.tracked:
                    move_tracked_aliases(conn, self.catalog, run_id)
                marked = self._retention_marks(conn, catalog, todo) if todo.retained else None
            if marked is not None:
                self._remove_files(catalog, marked)
        except Exception:  # noqa: BLE001 - the next validation of the run catches up
            logger.exception("housekeeping after a validation of run id %s", run_id)

    def _retention_marks(self, conn: Connection, catalog: Catalog, todo: Row) -> _Marked | None:
        """The run's stored retention policy applied (else its namespace's, which leaves
        out the runs with one of their own), in the caller's write transaction."""
        stored = retention.policies(conn, todo.namespace)
        if todo.name in stored:
            return self._mark(conn, catalog, stored[todo.name], False, ())
        if None in stored:
            own = [run for run in stored if run is not None]
            return self._mark(conn, catalog, stored[None], False, own)
        return None

    def judge_stop_policy(self, run_id: int) -> None:
        """Judges the run's stop policy (registry/stopping.py): after a merge, and after a
        validation ended without one (failed, timed out, cancelled), which decides nothing
        but no longer holds back the run's later results. Never raises."""
        try:
            self.stopping.evaluate(run_id)
        except Exception:  # noqa: BLE001 - the next validation of the run judges again
            logger.exception("stop policy after a validation of run id %s", run_id)


def move_tracked_aliases(conn: Connection, catalog: Catalog, run_id: int) -> dict[str, int]:
    """Points each tracked alias of the run at its best checkpoint by the alias's metric,
    in the caller's write transaction; returns alias -> report index of those that point
    somewhere."""
    pointed: dict[str, int] = {}
    for alias, metric, mode in alias_store.tracking_rules(conn, run_id):
        best = catalog.best(conn, run_id, Ranking(metric, mode))
        if best:
            alias_store.set_alias(conn, run_id, alias, best[0].id)
            pointed[alias] = best[0].report_index
    return pointed


# What follows a run attempt's merged metrics, in one round trip: its namespace and name,
# and whether its name has a stop policy, it has tracked aliases, its namespace has
# retention policies.
_runs = Run.__table__


def to_do_after(conn: Connection, run_id: int) -> Row | None:
    """What follows a validation of the run (its namespace and name; ``judged``: it has
    a stop policy; ``tracked``: tracked aliases; ``retained``: a retention policy), read
    in the outcome's transaction; None when the run is gone."""
    return conn.execute(_TO_DO_AFTER_VALIDATION, {"b_run_id": run_id}).first()


_TO_DO_AFTER_VALIDATION = select(
    _runs.c.namespace,
    _runs.c.name,
    exists()
    .where(StopPolicyRow.namespace == _runs.c.namespace, StopPolicyRow.run_name == _runs.c.name)
    .label("judged"),
    exists().where(TrackedAlias.run_id == _runs.c.id).label("tracked"),
    exists().where(RetentionPolicy.namespace == _runs.c.namespace).label("retained"),
).where(_runs.c.id == bindparam("b_run_id"))
