"""Prometheus metrics at /metrics, computed from the registry at scrape time.

A custom collector reads one snapshot per scrape (registry/stats.py: a few grouped
statements, never a query per job), so every API replica reports the same numbers and
nothing is lost when one restarts. The two histograms are bucketed in SQL over every
started job: the database returns a few sums per pool, and the buckets only grow as jobs
finish, which is what rate() and histogram_quantile() expect of a histogram.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

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
from validation_service.jobs import JobStatus, RunStatus
from validation_service.registry.registry import Registry
from validation_service.registry.stats import DurationHistogram, MetricsSnapshot, QueueHealth

logger = logging.getLogger(__name__)

# Validation duration (first claim -> finish): from a quick CPU eval to a long GPU one.
DURATION_BUCKETS_S = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)
# Dispatch latency (enqueue -> first claim): the scheduler polls every second or so.
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
# How long GET /metrics waits for the service actor's status before it counts as down.
SERVICE_STATUS_TIMEOUT_S = 2.0


class RegistryCollector(Collector):
    """The queue, the registrations and the service's health, read at every scrape."""

    def __init__(self, registry: Registry, settings: Settings):
        self.registry = registry
        self.settings = settings

    def collect(self) -> Iterator[Metric]:
        try:
            snapshot = self.registry.metrics_snapshot(
                duration_bounds=DURATION_BUCKETS_S,
                latency_bounds=LATENCY_BUCKETS_S,
                grace_s=self.settings.lease_s,
            )
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
        yield _histogram(
            "ckval_validation_duration_seconds",
            "Validation time of finished jobs, first claim to finish (retries included).",
            snapshot.durations,
        )
        yield _histogram(
            "ckval_dispatch_latency_seconds",
            "Time from enqueue to the first claim of started jobs.",
            snapshot.dispatch_latencies,
        )
        yield from self._service_health(snapshot.health)

    def _service_health(self, health: QueueHealth) -> Iterator[Metric]:
        leases = GaugeMetricFamily(
            "ckval_leases", "RUNNING jobs by whether their lease is live.", labels=["state"]
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
        # A scheduler extends its leases every heartbeat and requeues expired ones every
        # tick: a live lease means it ran within a lease period; an expired lease, or a due
        # job nobody claimed for a lease period, means none runs. An idle queue is served.
        if health.live_leases:
            return 1, "registry"
        return int(not health.expired_leases and not health.overdue_queued), "registry"


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


def _histogram(name: str, documentation: str, by_pool: dict[str, DurationHistogram]) -> Metric:
    family = HistogramMetricFamily(name, documentation, labels=["pool"])
    for pool, histogram in sorted(by_pool.items()):
        bounds = [*(f"{bound:g}" for bound in histogram.bounds), "+Inf"]
        family.add_metric(
            [pool],
            buckets=list(zip(bounds, histogram.cumulative, strict=True)),
            sum_value=histogram.total_s,
        )
    return family


def metrics_router(registry: Registry, settings: Settings) -> APIRouter:
    """GET /metrics in Prometheus' text format, over ``registry``."""
    collectors = CollectorRegistry(auto_describe=False)
    collectors.register(RegistryCollector(registry, settings))
    router = APIRouter(include_in_schema=False)

    @router.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(collectors), media_type=CONTENT_TYPE_LATEST)

    return router
