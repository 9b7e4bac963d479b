"""The dashboard's and /metrics' reads: pages of runs, one run as its page shows it,
metric series, the queue's figures and the replicas. The dashboard and /metrics get a
``DashboardReader`` and nothing else of the registry (``Registry.dashboard`` is the same);
each read is one transaction, the SQL mostly stats.py's.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence

from validation_service.errors import UnknownMetric
from validation_service.registry import costs, evaluations, stats, stopping
from validation_service.registry.catalog import Mode, NamespaceRoom
from validation_service.registry.database import retry_on_disconnect
from validation_service.registry.models import utcnow
from validation_service.registry.records import (
    CheckpointRecord,
    JobRecord,
    RunRecord,
    StopDecision,
)
from validation_service.registry.replicas import ReplicaRecord, replica_records
from validation_service.stopping import StopPolicy


@dataclasses.dataclass(frozen=True)
class RunView:
    """What a run's page shows of the run's latest attempt, read in one transaction: its
    record, checkpoints (with aliases, tags and every validator's metrics), jobs, stop
    policy and latest stop decision."""

    record: RunRecord
    checkpoints: list[CheckpointRecord]
    jobs: list[JobRecord]
    stop_policy: StopPolicy | None
    stop_decision: StopDecision | None


class DashboardReader(NamespaceRoom):
    """Grouped reads of one namespace's runs (the queue's figures: of every namespace)."""

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
                session,
                self.catalog.namespace,
                page=page,
                per_page=per_page,
                metric=metric,
                mode=mode,
            )

    @retry_on_disconnect
    def run_view(self, run: str) -> RunView:
        """The named run's latest attempt as its page shows it; RunNotFound otherwise."""
        with self.db.read() as session:
            record = stats.run_record(session, self.catalog.namespace, run)
            if record is None:
                self.catalog.require_run_id(session, run)  # raises RunNotFound with hints
            assert record is not None
            checkpoints = self.catalog.checkpoints(session, record.id, run, include_deleted=False)
            return RunView(
                record=record,
                checkpoints=evaluations.labelled(session, checkpoints),
                jobs=stats.run_jobs(session, record.id, run),
                stop_policy=stopping.stored_policy(session, self.catalog.namespace, run),
                stop_decision=stopping.latest_decision(session, record.id),
            )

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
    def replicas(self, service_name: str) -> list[ReplicaRecord]:
        """The service's replicas, with the leases each holds now."""
        with self.db.read() as session:
            return replica_records(session, service_name)

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
    def accelerator_totals(self, *, until: dt.datetime) -> list[tuple[str, str, str | None, float]]:
        """(pool, validator, accelerator type, accelerator-seconds) of every attempt that
        ended at or before ``until``, summed in the database (see costs.accelerator_totals)."""
        with self.db.read() as session:
            return costs.accelerator_totals(session, until)
