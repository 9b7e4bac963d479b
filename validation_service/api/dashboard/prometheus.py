"""Prometheus metrics at /metrics, computed from the registry at scrape time.

A custom collector reads one snapshot per scrape (registry/stats.py: a few grouped
statements, never a query per job), so the gauges say what the registry says whichever
API replica is scraped.

The two histograms, and the counter of accelerator-seconds, count every job (attempt) of
the registry. The first scrape buckets the jobs
that ended (or were first claimed) up to OVERLAP_S ago in SQL, a row per (pool, bucket)
back; every later scrape reads only the jobs changed since then (an updated_at index
range) and adds those it has not counted, keyed by (job, timestamp). Re-reading the last
OVERLAP_S seconds catches a transition that committed after a scrape although its
timestamp was taken before. A scrape thus costs the same at 100 jobs as at 1M, and the
buckets only grow, as rate() and histogram_quantile() expect. Accelerator-seconds are
counted the same way, per ended attempt (labels pool, validator, accelerator type; per run
they are in `ckval runs` and on the run page: a label per run would grow without bound).
"""

from __future__ import annotations

import bisect
import datetime as dt
import logging
import sys
import threading
from collections.abc import Iterator, Sequence

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from validation_service.config import Settings
from validation_service.errors import RegistryUnavailable
from validation_service.jobs import TERMINAL_JOB_STATUSES, JobStatus, RunStatus
from validation_service.registry.costs import AttemptCost
from validation_service.registry.dashboard_reads import DashboardReader
from validation_service.registry.models import utcnow
from validation_service.registry.replicas import ReplicaRecord
from validation_service.registry.stats import Buckets, JobTimes, MetricsSnapshot, QueueHealth

logger = logging.getLogger(__name__)

# Validation duration (first claim -> finish): from a quick CPU eval to a long GPU one.
DURATION_BUCKETS_S = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)
# Dispatch latency (enqueue -> first claim): the scheduler polls every second or so.
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
# How long GET /metrics waits for the service actor's status before it counts as down.
SERVICE_STATUS_TIMEOUT_S = 2.0
# How far back each scrape re-reads changed jobs (see the module docstring): far more than
# a transition takes to commit, and than the clocks of the service's hosts drift apart.
OVERLAP_S = 120.0
_TERMINAL = frozenset(status.value for status in TERMINAL_JOB_STATUSES)


class JobHistogram:
    """Cumulative per-pool buckets of one duration, fed once from SQL totals, then job by
    job; remembers the (job, timestamp) pairs it counted inside the overlap window."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts: dict[str, list[int]] = {}  # pool -> jobs per bucket, +Inf last
        self.sums: dict[str, float] = {}
        self._counted: dict[tuple[int, dt.datetime], dt.datetime] = {}

    def add_totals(self, totals: Buckets) -> None:
        for pool, buckets in totals.items():
            counts = self._pool(pool)
            for index, (jobs, seconds) in buckets.items():
                counts[index] += jobs
                self.sums[pool] += seconds

    def add(self, job: JobTimes, at: dt.datetime, seconds: float, cutoff: dt.datetime) -> None:
        """Counts one job whose event happened ``at``, unless the totals or an earlier
        scrape already did."""
        key = (job.id, at)
        if at <= cutoff or key in self._counted:
            return
        self._counted[key] = at
        self._pool(job.pool)[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sums[job.pool] += seconds

    def forget_before(self, cutoff: dt.datetime) -> None:
        self._counted = {key: at for key, at in self._counted.items() if at > cutoff}

    def family(self, name: str, documentation: str) -> Metric:
        family = HistogramMetricFamily(name, documentation, labels=["pool"])
        bounds = [*(f"{bound:g}" for bound in self.bounds), "+Inf"]
        for pool in sorted(self.counts):
            cumulative, running = [], 0
            for bound, jobs in zip(bounds, self.counts[pool], strict=True):
                running += jobs
                cumulative.append((bound, running))
            family.add_metric([pool], buckets=cumulative, sum_value=self.sums[pool])
        return family

    def _pool(self, pool: str) -> list[int]:
        if pool not in self.counts:
            self.counts[pool] = [0] * (len(self.bounds) + 1)
            self.sums[pool] = 0.0
        return self.counts[pool]


class AcceleratorSeconds:
    """Accelerator-seconds of ended attempts per (pool, validator, accelerator type), fed
    once from SQL totals, then attempt by attempt; remembers the attempts it counted
    inside the overlap window."""

    def __init__(self):
        self.totals: dict[tuple[str, str, str], float] = {}
        self._counted: dict[int, dt.datetime] = {}

    def add_totals(self, totals: Sequence[tuple[str, str, str | None, float]]) -> None:
        for pool, validator, kind, seconds in totals:
            key = (pool, validator, kind or "none")
            self.totals[key] = self.totals.get(key, 0.0) + seconds

    def add(self, attempt: AttemptCost, cutoff: dt.datetime) -> None:
        if attempt.finished_at <= cutoff or attempt.id in self._counted:
            return
        self._counted[attempt.id] = attempt.finished_at
        self.add_totals(
            [(attempt.pool, attempt.validator, attempt.accelerator_type, attempt.accelerator_s)]
        )

    def forget_before(self, cutoff: dt.datetime) -> None:
        self._counted = {key: at for key, at in self._counted.items() if at > cutoff}

    def family(self) -> Metric:
        family = CounterMetricFamily(
            "ckval_validation_accelerator_seconds",
            "Accelerator-seconds validations held (accelerators x running time of each ended "
            "attempt), by pool, validator and accelerator type.",
            labels=["pool", "validator", "accelerator_type"],
        )
        for labels, seconds in sorted(self.totals.items()):
            family.add_metric(list(labels), seconds)
        return family


class RegistryCollector(Collector):
    """The queue, the registrations and the service's health, read at every scrape."""

    def __init__(
        self, reader: DashboardReader, settings: Settings, *, overlap_s: float = OVERLAP_S
    ):
        self.reader = reader
        self.settings = settings
        self.overlap = dt.timedelta(seconds=overlap_s)
        self.durations = JobHistogram(DURATION_BUCKETS_S)
        self.latencies = JobHistogram(LATENCY_BUCKETS_S)
        self.accelerator_seconds = AcceleratorSeconds()
        self._cutoff: dt.datetime | None = None  # the histograms hold every event up to it
        self._lock = threading.Lock()  # scrapes run in FastAPI's thread pool

    def collect(self) -> Iterator[Metric]:
        try:
            with self._lock:
                snapshot = self._read()
                replicas = self.reader.replicas(self.settings.service_name)
                durations = self.durations.family(
                    "ckval_validation_duration_seconds",
                    "Validation time of jobs that ended, first claim to end (retries included).",
                )
                latencies = self.latencies.family(
                    "ckval_dispatch_latency_seconds",
                    "Time from enqueue to the first claim of started jobs.",
                )
                accelerator_seconds = self.accelerator_seconds.family()
        except RegistryUnavailable as exc:
            logger.warning("/metrics: the registry is unreachable: %s", exc)
            snapshot = None
        registry_up = GaugeMetricFamily(
            "ckval_registry_up", "1 when the registry database answered this scrape, else 0."
        )
        registry_up.add_metric([], 0 if snapshot is None else 1)
        yield registry_up
        if snapshot is None:
            return
        yield from _queue_metrics(snapshot)
        yield durations
        yield latencies
        yield accelerator_seconds
        yield from _wait_metrics(snapshot)
        yield from self._service_health(snapshot.health)
        yield from _replica_metrics(replicas, self.settings.lease_s)

    def _read(self) -> MetricsSnapshot:
        """This scrape's snapshot, with the jobs changed since the last one counted."""
        now = utcnow()
        if self._cutoff is None:
            cutoff = now - self.overlap
            totals = self.reader.job_time_totals(
                duration_bounds=DURATION_BUCKETS_S, latency_bounds=LATENCY_BUCKETS_S, until=cutoff
            )
            self.durations.add_totals(totals[0])
            self.latencies.add_totals(totals[1])
            self.accelerator_seconds.add_totals(self.reader.accelerator_totals(until=cutoff))
            self._cutoff = cutoff
        snapshot = self.reader.metrics_snapshot(
            grace_s=self.settings.lease_s, changed_since=self._cutoff
        )
        for job in snapshot.changed:
            if job.started_at is None:
                continue
            latency = (job.started_at - job.created_at).total_seconds()
            self.latencies.add(job, job.started_at, latency, self._cutoff)
            if job.finished_at is not None and job.status in _TERMINAL:
                duration = (job.finished_at - job.started_at).total_seconds()
                self.durations.add(job, job.finished_at, duration, self._cutoff)
        for attempt in snapshot.attempt_costs:
            self.accelerator_seconds.add(attempt, self._cutoff)
        self._cutoff = max(self._cutoff, now - self.overlap)
        self.durations.forget_before(self._cutoff)
        self.latencies.forget_before(self._cutoff)
        self.accelerator_seconds.forget_before(self._cutoff)
        return snapshot

    def _service_health(self, health: QueueHealth) -> Iterator[Metric]:
        leases = GaugeMetricFamily(
            "ckval_leases",
            "Leased jobs (RUNNING or WAITING_FOR_RESOURCES) by whether their lease is live.",
            labels=["state"],
        )
        leases.add_metric(["live"], health.live_leases)
        leases.add_metric(["expired"], health.expired_leases)
        yield leases
        oldest = GaugeMetricFamily(
            "ckval_oldest_due_job_age_seconds",
            "How long the oldest due QUEUED job has waited for a claim (0: none waits).",
        )
        oldest.add_metric([], health.oldest_due_s)
        yield oldest
        up, source = self._service_up(health)
        service_up = GaugeMetricFamily(
            "ckval_service_up",
            "1 when the validation service serves the queue, else 0; source says how it "
            "was judged: the service actor answered (actor) or the queue's leases (registry).",
            labels=["source"],
        )
        service_up.add_metric([source], up)
        yield service_up

    def _service_up(self, health: QueueHealth) -> tuple[int, str]:
        # Ask the actor only where Ray already runs in this process (`ckval serve`): the
        # API of `ckval ui` never imports or starts Ray for a scrape.
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            from validation_service.service import ValidationService

            try:
                handle = ValidationService.get(self.settings)
                if handle is not None:
                    handle.status(timeout_s=SERVICE_STATUS_TIMEOUT_S)
                    return 1, "actor"
            except Exception:  # noqa: BLE001 - a dead or busy actor is a down service
                logger.warning("/metrics: the ckval service did not answer", exc_info=True)
                return 0, "actor"
            # No service actor on this Ray: it may run on another cluster; the registry's
            # leases tell.
        # A scheduler extends its leases every heartbeat and requeues expired ones every
        # tick: a live lease means it ran within a lease period; an expired lease, or a due
        # job nobody claimed for a lease period, means none runs. An idle queue is served.
        if health.live_leases:
            return 1, "registry"
        return int(not health.expired_leases and not health.overdue_queued), "registry"


def _replica_metrics(replicas: list[ReplicaRecord], lease_s: float) -> Iterator[Metric]:
    """Per replica of the service, from the rows their heartbeats write."""
    now = utcnow()
    up = GaugeMetricFamily(
        "ckval_replica_up",
        "1 when the service replica's last heartbeat is younger than a lease, else 0.",
        labels=["replica"],
    )
    age = GaugeMetricFamily(
        "ckval_replica_heartbeat_age_seconds",
        "Seconds since the service replica's last heartbeat.",
        labels=["replica"],
    )
    leases = GaugeMetricFamily(
        "ckval_replica_leases",
        "Jobs the service replica holds (RUNNING or WAITING_FOR_RESOURCES).",
        labels=["replica"],
    )
    for replica in replicas:
        up.add_metric([replica.name], int(replica.fresh(lease_s, now)))
        age.add_metric([replica.name], replica.heartbeat_age_s(now))
        leases.add_metric([replica.name], replica.leases)
    yield from (up, age, leases)


def _wait_metrics(snapshot: MetricsSnapshot) -> Iterator[Metric]:
    """How long each pool's longest-waiting job has waited for resources (a node the
    autoscaler adds, GPUs other work holds); ckval_jobs{status="WAITING_FOR_RESOURCES"}
    counts them."""
    longest = GaugeMetricFamily(
        "ckval_resource_wait_seconds",
        "Per pool, how long its longest-waiting WAITING_FOR_RESOURCES job has waited "
        "(absent: none waits).",
        labels=["pool"],
    )
    for pool, seconds in sorted(snapshot.waits.items()):
        longest.add_metric([pool], seconds)
    yield longest


def _queue_metrics(snapshot: MetricsSnapshot) -> Iterator[Metric]:
    jobs = GaugeMetricFamily(
        "ckval_jobs", "Validation jobs by status and pool.", labels=["status", "pool"]
    )
    queued: dict[str, int] = {}
    for status, pool, count in sorted(snapshot.jobs):
        jobs.add_metric([status, pool], count)
        if status == JobStatus.QUEUED.value:
            queued[pool] = count
    yield jobs
    depth = GaugeMetricFamily(
        "ckval_queue_depth", "QUEUED validation jobs per pool.", labels=["pool"]
    )
    for pool, count in sorted(queued.items()):
        depth.add_metric([pool], count)
    yield depth
    runs = GaugeMetricFamily("ckval_runs", "Runs by status.", labels=["status"])
    for status in RunStatus:
        runs.add_metric([status.value], snapshot.runs.get(status.value, 0))
    yield runs
    registered = CounterMetricFamily(
        "ckval_checkpoints_registered", "Checkpoints registered (deleted ones included)."
    )
    registered.add_metric([], snapshot.checkpoints_registered)
    yield registered


def metrics_router(reader: DashboardReader, settings: Settings) -> APIRouter:
    """GET /metrics in Prometheus' text format, over the registry's ``reader``."""
    collectors = CollectorRegistry(auto_describe=False)
    collectors.register(RegistryCollector(reader, settings))
    router = APIRouter(include_in_schema=False)

    @router.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(collectors), media_type=CONTENT_TYPE_LATEST)

    return router
