"""The scheduler loop: claim due jobs -> launch executors -> collect -> record outcomes.

Leases are held with heartbeats, expired leases of lost schedulers are requeued, and
attempts past their timeout (counted from when they run) are cancelled. Attempts whose
task waits for resources are recorded so, and ended when what they ask can never come or
they waited too long (resource_waits.py). All database work goes through the registry's
JobQueue and ReplicaBook (composition.ServiceParts).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING

from validation_service.config import Settings
from validation_service.errors import RegistryRejected
from validation_service.executors import (
    AttemptHandle,
    Executor,
    default_executors,
    running_since,
    usage_of,
)
from validation_service.jobs import ExecutorKind
from validation_service.registry.models import utcnow
from validation_service.registry.records import ClaimedJob, JobOutcome
from validation_service.registry.wakeups import QueueListener
from validation_service.retry import RetryPolicy
from validation_service.service.resource_waits import ResourceWaits, with_usage
from validation_service.service.warmth import WarmWorkers
from validation_service.service.watcher import FolderWatcher
from validation_service.service.worker_groups import end_reports_of_ended_groups
from validation_service.sinks import SinkDispatcher

if TYPE_CHECKING:
    from validation_service.registry.composition import ServiceParts
    from validation_service.registry.registry import Registry

logger = logging.getLogger(__name__)

# How long a woken loop waits for more wake-ups before it ticks (a cap on ticks/s).
COALESCE_S = 0.005
# How often an idle service looks whether the cluster is idle, to keep workers warm.
KEEP_WARM_S = 2.0
# The least time between two writes of the replica's row (heartbeat_s may be 0 in tests).
REPLICA_BEAT_MIN_S = 1.0


def past_its_timeout(job: ClaimedJob, outcome: JobOutcome) -> JobOutcome:
    """The outcome of an attempt that ran longer than its timeout_s is a timeout, as it
    is when the loop cancels the attempt in time: a busy loop may see a task's start and
    its end together, and what the job records must not depend on when the loop looked
    (Ray Train too cancels what is past its deadline before it collects results)."""
    if (
        job.timeout_s is None
        or outcome.timed_out
        or None in (outcome.started_at, outcome.finished_at)
    ):
        return outcome
    ran_s = (outcome.finished_at - outcome.started_at).total_seconds()
    if ran_s <= job.timeout_s:
        return outcome
    ended = f" ({ran_s:.1f} s); it ended before its Ray task could be cancelled"
    return dataclasses.replace(
        outcome, metrics=None, error_traceback=None, **_timed_out(job.timeout_s, ended)
    )


def _timed_out(timeout_s: float, what_then: str) -> dict:
    """The JobOutcome fields of an attempt that ran longer than ``timeout_s``."""
    return {
        "succeeded": False,
        "error_type": "TimeoutError",
        "error_message": f"validation ran longer than timeout_s={timeout_s:g}{what_then}",
        "retryable": False,
        "timed_out": True,
    }


class Scheduler:
    """Runs validations of the registry's queue with the given executors (by job kind).

    ``parts``: the service's parts of the registry (composition.open_service_parts), or a
    Registry, which holds the same (``job_queue``, ``replicas``, ``engine``).
    """

    def __init__(
        self,
        parts: ServiceParts | Registry,
        settings: Settings,
        *,
        owner: str | None = None,
        name: str | None = None,
        executors: dict[str, Executor] | None = None,
        retry_policy: RetryPolicy | None = None,
    ):
        self.jobs = parts.job_queue
        self.replicas = parts.replicas
        self.assemblies = parts.assemblies
        self.engine = parts.engine
        self.settings = settings
        # The replica's name (the service's, for the first): its leases' owner prefix, so
        # a restarted replica releases its own predecessor's leases and no other's.
        self.name = name or settings.service_name
        self.owner_prefix = f"{self.name}/"
        incarnation = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.owner = owner or self.owner_prefix + incarnation
        self.executors = executors or default_executors(settings)
        # Asked what a failed attempt or a lost lease leads to; the registry records it.
        self.retry_policy = retry_policy or RetryPolicy.from_settings(settings)
        # job id -> (the executor running it, its attempt)
        self._in_flight: dict[int, tuple[Executor, AttemptHandle]] = {}
        # The attempts whose task waits for resources, and the limit of that wait.
        self.waits = ResourceWaits(self.jobs, self.owner, settings.resource_wait_s)
        self._wake = threading.Event()
        self._stop = threading.Event()
        # -inf: the first tick heartbeats and scans, whatever the monotonic clock reads.
        self._last_heartbeat = -math.inf
        self._last_expiry_scan = -math.inf
        self._last_keep_warm = -math.inf
        self.started_at = utcnow()
        self._last_replica_beat = -math.inf
        self._listener: QueueListener | None = None
        # The frameworks the last run's warm-up named; kept warm between runs.
        self._warm_modules: tuple[str, ...] | None = None
        # The CPU pool's warm worker processes, and the warm-up tasks under way.
        self.warmth = WarmWorkers(settings.pool_size("CPU"))
        self._warming: list = []
        self._warming_lock = threading.Lock()  # warm_up() runs on the actor's threads
        self.stats = {
            "claimed": 0,
            "finished": 0,
            "stale": 0,
            "timed_out": 0,
            "recovered": 0,
            "warmed": 0,
            "ticks": 0,
            "notified": 0,
            "infeasible": 0,
            "waited_too_long": 0,
        }
        # Logs SUCCEEDED jobs' metrics to the configured trackers (MLflow, W&B), off the loop.
        self.sinks = SinkDispatcher.from_settings(settings, self.jobs, self.stats)
        # Watched folders are listed on a thread of their own (service/watcher.py).
        self.watcher = FolderWatcher(parts.watch_listings, settings, self.owner, self.wake)

    # ------------------------------------------------------------- controls
    def wake(self) -> None:
        """Nudge: new work was enqueued; claim at once instead of at the next poll."""
        self._wake.set()

    def check_leases(self) -> None:
        """Jobs were cancelled: look at the leases at once and stop their attempts."""
        self._last_heartbeat = -math.inf
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def warm_up(self, modules: Iterable[str]) -> list:
        """Starts a worker process for the CPU pool before a run's first validations need
        it (see RayTaskExecutor.warm_up), when the pool has a free slot; returns the
        warm-up task's object refs, or none where the executor has no warm-up or
        keep_warm is off. One process: as training starts, the CPUs are training's, and
        several processes importing the same frameworks at once would slow training and
        every one of them; it counts as a process starting (service/warmth.py)."""
        self._warm_modules = tuple(modules)
        executor = self.executors.get(ExecutorKind.RAY_TASK.value)
        if not self.settings.keep_warm or not hasattr(executor, "warm_up"):
            return []
        busy = self._busy_by_pool().get("CPU", 0)
        refs = executor.warm_up(min(1, self.settings.pool_size("CPU") - busy), modules)
        with self._warming_lock:
            self._warming.extend(refs)
            self.warmth.warming(len(self._warming))
        self.stats["warmed"] += len(refs)
        return refs

    def _collect_warm_ups(self) -> None:
        """The warm-up tasks that ended: their workers are warm."""
        if not self._warming:
            return
        executor = self.executors[ExecutorKind.RAY_TASK.value]
        with self._warming_lock:
            ended, self._warming = executor.ended(self._warming)
            self.warmth.warming(len(self._warming))
        self.warmth.saw(executor.warm_pids(ended))

    def keep_warm(self) -> list:
        """Between runs, keeps the CPU pool's workers warm for the next run's first
        validations: when no validation runs here and no CPU of the cluster is in use, it
        starts (or, as a rule, finds idle and reuses) a worker per slot on the service's
        own node, importing what the last run's warm-up named. Never while anything else
        runs, so it takes no CPU from training or other validations, and never on a node
        an autoscaler could remove."""
        executor = self.executors.get(ExecutorKind.RAY_TASK.value)
        if self._warm_modules is None or self._in_flight or not hasattr(executor, "keep_warm"):
            return []
        refs = executor.keep_warm(self.settings.pool_size("CPU"), self._warm_modules)
        self.stats["warmed"] += len(refs)
        return refs

    def _busy_by_pool(self) -> dict[str, int]:
        """How many attempts run in each pool. list(): warm_up() reads this from another
        thread than the loop's, which changes the dict; copying it holds the GIL."""
        busy: dict[str, int] = {}
        for _, handle in list(self._in_flight.values()):
            busy[handle.job.pool] = busy.get(handle.job.pool, 0) + 1
        return busy

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def waiting_for_resources(self) -> list[dict]:
        """This replica's attempts recorded WAITING_FOR_RESOURCES: job, run, report,
        pool, since how long, and what for (`ckval status`)."""
        found = []
        for entry in self.waits.status(time.monotonic()):
            in_flight = self._in_flight.get(entry["job_id"])
            if in_flight is not None:
                job = in_flight[1].job
                entry.update(run=job.run, report_index=job.report_index, pool=job.pool)
                found.append(entry)
        return found

    def cluster_offer(self) -> dict | None:
        """What the Ray cluster offers validations, as the Ray task executor reads it:
        where its node types come from, whether an autoscaler can add nodes, and its
        nodes' and node types' resources (`ckval status`); None where it cannot tell."""
        capacity = getattr(self.executors.get(ExecutorKind.RAY_TASK.value), "capacity", None)
        if capacity is None:
            return None
        try:
            offer = capacity.offer()
        except Exception:  # noqa: BLE001 - status only
            logger.debug("reading the cluster's offer failed", exc_info=True)
            return None
        return {
            "node_types_from": offer.node_types_from,
            "autoscaler": offer.autoscaler,
            "offers": offer.describe(),
        }

    def recover(self) -> list[int]:
        """On start: requeue what an earlier incarnation of this service left RUNNING.

        One service (name) per database: its predecessor is known to be dead.
        """
        requeued = self.jobs.release_leases(
            self.owner_prefix, keep_owner=self.owner, policy=self.retry_policy
        )
        if requeued:
            logger.warning(
                "requeued %d job(s) left running by a previous incarnation: %s",
                len(requeued),
                requeued,
            )
        self.stats["recovered"] = len(requeued)
        return requeued

    def run_forever(self) -> None:
        logger.info("scheduler %s started", self.owner)
        try:
            self.recover()
        except Exception:  # noqa: BLE001 - leases also expire on their own
            logger.exception("recovering earlier leases failed")
        self.watcher.start(self.owner_prefix)
        if QueueListener.applies_to(self.engine):
            self._listener = QueueListener(self.engine, self._notified).start()
        try:
            self._loop()
        finally:
            self.watcher.stop()
            if self._listener is not None:
                self._listener.stop()
        self._cancel_all()
        self.sinks.close()
        self._beat_replica(stopped=True)
        logger.info("scheduler %s stopped", self.owner)

    def _notified(self) -> None:
        self.stats["notified"] += 1
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a database blip must not kill the loop
                logger.exception("scheduler tick failed; retrying")
                self._stop.wait(1.0)
            if self._wake.wait(self.settings.poll_interval_s):
                # Let a burst of nudges and completions share one tick.
                self._stop.wait(COALESCE_S)
            self._wake.clear()

    # ----------------------------------------------------------------- loop
    def tick(self) -> None:
        self.stats["ticks"] += 1
        now = time.monotonic()
        if now - self._last_heartbeat >= self.settings.heartbeat_s:
            self._heartbeat()
            self._last_heartbeat = now
        if now - self._last_expiry_scan >= self.settings.heartbeat_s:
            requeued = self.jobs.requeue_expired(policy=self.retry_policy)
            if requeued:
                logger.warning("requeued jobs with expired leases: %s", requeued)
            self._end_reports_of_ended_groups()
            self._last_expiry_scan = now
        self._collect_warm_ups()
        self._collect()
        self._enforce_timeouts()
        self._watch_resource_waits()
        self._claim_and_launch()
        if self.settings.keep_warm and now - self._last_keep_warm >= KEEP_WARM_S:
            self._last_keep_warm = now
            try:
                self.keep_warm()
            except Exception:  # noqa: BLE001 - best effort: validations start workers anyway
                logger.debug("keeping validation workers warm failed", exc_info=True)

    def _end_reports_of_ended_groups(self) -> None:
        try:
            end_reports_of_ended_groups(self.assemblies)
        except Exception:  # noqa: BLE001 - best effort: an ended run's gc ends them too
            logger.debug("looking for sharded reports of ended worker groups failed", exc_info=True)

    def _claim_and_launch(self) -> None:
        # A read first: the write transaction of a claim only when a pool has due work
        # and room, so nudges and polls do not contend with reporters for the write lock.
        # One replica knows what runs; replicas read the pools' running jobs (a report
        # wakes every replica, and most of them find the pools full).
        due = self.jobs.due_pools()
        if not due:
            return
        busy = self._busy_by_pool() if self.settings.replicas == 1 else self.jobs.running_per_pool()
        # The CPU pool starts as many attempts as it has warm workers (service/warmth.py).
        cpu = self.warmth.limit(busy.get("CPU", 0), "CPU" in due)
        pools = {**self.settings.pools, "CPU": min(self.settings.pool_size("CPU"), cpu)}
        if not any(
            busy.get(pool, 0) < pools.get(pool, self.settings.pool_size(pool)) for pool in due
        ):
            return
        claimed = self.jobs.claim_due_jobs(
            self.owner,
            pools,
            lease_s=self.settings.lease_s,
            default_limit=self.settings.default_pool_size,
        )
        for job in claimed:
            self.stats["claimed"] += 1
            self._launch(job)

    def _launch(self, job: ClaimedJob) -> None:
        executor = self.executors.get(job.executor_kind)
        if executor is None:
            self._finish(
                job,
                JobOutcome(
                    succeeded=False,
                    error_type="UnknownExecutor",
                    error_message=f"no executor for kind {job.executor_kind!r}",
                    retryable=False,
                ),
            )
            return
        refused = self.waits.refused(executor, job)
        if refused is not None:  # no node (type) can ever run it: it holds no slot
            self.stats["infeasible"] += 1
            logger.warning("job %s: %s", job.job_id, refused.error_message)
            self._finish(job, refused)
            return
        try:
            handle = executor.launch(job)
        except Exception as exc:  # noqa: BLE001 - recorded as a retryable failure
            logger.exception("launching job %s failed", job.job_id)
            self._finish(
                job,
                JobOutcome(
                    succeeded=False,
                    error_type=type(exc).__name__,
                    error_message=str(exc),
                    retryable=True,
                ),
            )
            return
        self._in_flight[job.job_id] = (executor, handle)
        # Wake the loop the moment the attempt ends, not at the next poll.
        executor.when_done(handle, self._wake.set)

    def _collect(self) -> None:
        for job_id, (executor, handle) in list(self._in_flight.items()):
            outcome = executor.poll(handle)
            if outcome is None:
                continue
            del self._in_flight[job_id]
            if handle.job.pool == "CPU":
                self.warmth.saw([outcome.worker_pid])
            judged = past_its_timeout(handle.job, outcome)
            if judged is not outcome:
                self.stats["timed_out"] += 1
            self._finish(handle.job, judged)

    def _finish(self, job: ClaimedJob, outcome: JobOutcome) -> None:
        try:
            finished = self._record(job, outcome)
        except RegistryRejected as exc:
            # The database refuses this outcome (say, a value its column cannot hold):
            # recording it again would give the same answer, so the job fails with why.
            logger.error("job %s: its outcome could not be recorded: %s", job.job_id, exc)
            outcome = JobOutcome(
                succeeded=False,
                error_type="RegistryRejected",
                error_message=f"the registry refused this attempt's outcome: {exc}",
                retryable=False,
            )
            finished = self._record(job, outcome)
        self.stats["finished" if finished else "stale"] += 1
        if finished and outcome.succeeded:
            self.sinks.submit(job)

    def _record(self, job: ClaimedJob, outcome: JobOutcome) -> bool:
        return self.jobs.finish_job(job.job_id, job.lease_token, outcome, policy=self.retry_policy)

    def _enforce_timeouts(self) -> None:
        """Cancels the attempts that ran longer than their timeout_s, counted from when
        they began to run (an attempt waiting for resources has not)."""
        now = time.monotonic()
        for job_id, (executor, handle) in list(self._in_flight.items()):
            timeout_s = handle.job.timeout_s
            began = running_since(executor, handle)
            if timeout_s is None or began is None or now - began < timeout_s:
                continue
            del self._in_flight[job_id]
            executor.cancel(handle)
            self.stats["timed_out"] += 1
            outcome = JobOutcome(**_timed_out(timeout_s, "; its Ray task was cancelled"))
            self._finish(handle.job, with_usage(executor, handle, outcome))

    def _watch_resource_waits(self) -> None:
        """Records attempts that wait for resources and those that began to run; ends
        those that can never run or waited longer than resource_wait_s."""
        for job_id, outcome in self.waits.update(self._in_flight, time.monotonic()):
            executor, handle = self._in_flight.pop(job_id)
            executor.cancel(handle)
            key = "infeasible" if outcome.error_type == "InfeasibleResources" else "waited_too_long"
            self.stats[key] += 1
            logger.warning("job %s: %s", job_id, outcome.error_message)
            self._finish(handle.job, outcome)

    def _beat_replica(self, stopped: bool = False) -> None:
        """Writes this replica's row (who, where, how fresh) for status and /metrics."""
        now = time.monotonic()
        if not stopped and now - self._last_replica_beat < REPLICA_BEAT_MIN_S:
            return
        self._last_replica_beat = now
        try:
            if stopped:
                self.replicas.stopped(self.name, self.owner)
                return
            self.replicas.beat(
                name=self.name,
                service_name=self.settings.service_name,
                owner=self.owner,
                pid=os.getpid(),
                hostname=socket.gethostname(),
                node_id=_ray_node_id(),
                started_at=self.started_at,
            )
        except Exception:  # noqa: BLE001 - status only; the leases are what count
            logger.warning("writing replica %s's heartbeat failed", self.name, exc_info=True)

    def _heartbeat(self) -> None:
        self._beat_replica()
        unlaunched = self.jobs.release_unlaunched(
            self.owner, self._in_flight, policy=self.retry_policy
        )
        if unlaunched:
            logger.warning("requeued jobs claimed but never launched: %s", unlaunched)
        leases = [(job_id, h.job.lease_token) for job_id, (_, h) in self._in_flight.items()]
        if not leases:
            return
        held = self.jobs.heartbeat(self.owner, leases, lease_s=self.settings.lease_s)
        for job_id in [j for j, _ in leases if j not in held]:
            # Cancelled by a user, or taken over after our lease expired: stop the attempt.
            executor, handle = self._in_flight.pop(job_id)
            logger.info("job %s is no longer ours; cancelling its attempt", job_id)
            executor.cancel(handle)
            self._record_usage(executor, handle)

    def _record_usage(self, executor: Executor, handle: AttemptHandle) -> None:
        """What an attempt stopped after losing its lease held, up to now."""
        usage = usage_of(executor, handle)
        if usage is None:
            return
        held = JobOutcome(
            succeeded=False,
            node_id=usage.node_id,
            started_at=usage.started_at,
            **usage.outcome_fields(),
        )
        try:
            self.jobs.record_usage(handle.job.job_id, handle.job.lease_token, held)
        except Exception:  # noqa: BLE001 - the cost of one attempt, not the job's fate
            logger.warning("recording job %s's usage failed", handle.job.job_id, exc_info=True)

    def _cancel_all(self) -> None:
        for executor, handle in self._in_flight.values():
            try:
                executor.cancel(handle)
            except Exception:  # noqa: BLE001 - best effort on shutdown
                logger.exception("cancelling job %s on shutdown failed", handle.job.job_id)
        self._in_flight.clear()


def _ray_node_id() -> str | None:
    """The Ray node this process runs on, or None outside Ray."""
    import ray

    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()
