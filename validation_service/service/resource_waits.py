"""A replica's attempts whose Ray task waits for resources (a node the autoscaler adds,
GPUs other work holds): recorded WAITING_FOR_RESOURCES with what they wait for, RUNNING
once their task runs, and ended FAILED when what they ask can never come
(InfeasibleResources) or when they waited CKVAL_RESOURCE_WAIT_S (ResourcesUnavailable).

A job that asks for resources no node and no node type offers is failed before its task
is launched: it never holds its pool's slot.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from validation_service.capacity import describe_resources
from validation_service.executors import (
    AttemptHandle,
    Executor,
    running_since,
    usage_of,
    verdict_on,
)
from validation_service.registry.records import ClaimedJob, JobOutcome

if TYPE_CHECKING:
    from validation_service.capacity import Verdict
    from validation_service.registry.jobs import JobQueue

# An attempt whose task has not begun this long after its launch waits for resources: a
# Ray task whose resources are free starts within a second (a new worker process).
WAITING_AFTER_S = 2.0
# How often the attempts that wait are judged again (a node type gone, a node lost).
REJUDGE_S = 10.0

InFlight = dict[int, tuple[Executor, AttemptHandle]]


@dataclasses.dataclass
class ResourceWaits:
    """What a scheduler knows of its attempts that wait: since when each was recorded
    WAITING_FOR_RESOURCES (time.monotonic()), and what it waits for."""

    jobs: JobQueue
    owner: str
    wait_limit_s: float
    waiting: dict[int, tuple[float, dict[str, Any]]] = dataclasses.field(default_factory=dict)
    _last_judged: float = -math.inf

    def refused(self, executor: Executor, job: ClaimedJob) -> JobOutcome | None:
        """Before a launch: the outcome that fails the job when no node of the cluster and
        no node type its autoscaler can add can ever run it; None to launch it."""
        verdict = verdict_on(executor, job)
        if verdict is None or verdict.feasible is not False:
            return None
        return infeasible(job, verdict)

    def update(self, in_flight: InFlight, now: float) -> list[tuple[int, JobOutcome]]:
        """Records the attempts that began to wait and those that began to run; returns
        (job id, outcome) of those to end: they can never run, or waited too long."""
        self.waiting = {job_id: w for job_id, w in self.waiting.items() if job_id in in_flight}
        judge = now - self._last_judged >= REJUDGE_S
        if judge:
            self._last_judged = now
        began, waits, ended = [], [], []
        for job_id, (executor, handle) in in_flight.items():
            if running_since(executor, handle) is not None:
                if job_id in self.waiting:
                    began.append((job_id, handle.job.lease_token))
                continue
            waited = now - handle.launched_at
            if waited >= self.wait_limit_s:
                ended.append((job_id, self._waited_too_long(handle, waited)))
            elif waited >= WAITING_AFTER_S and (judge or job_id not in self.waiting):
                verdict = verdict_on(executor, handle.job)
                if verdict is not None and verdict.feasible is False:
                    ended.append((job_id, infeasible(handle.job, verdict)))
                elif job_id not in self.waiting:
                    waits.append((job_id, handle.job.lease_token, waiting_for(handle, verdict)))
        for job_id in self.jobs.wait_for_resources(self.owner, waits):
            self.waiting[job_id] = (now, next(w for i, _, w in waits if i == job_id))
        for job_id in self.jobs.start_running(self.owner, began):
            self.waiting.pop(job_id, None)
        return ended

    def _waited_too_long(self, handle: AttemptHandle, waited: float) -> JobOutcome:
        what = self.waiting.get(handle.job.job_id, (0.0, waiting_for(handle, None)))[1]
        note = f" ({what['note']})" if what.get("note") else ""
        return JobOutcome(
            succeeded=False,
            error_type="ResourcesUnavailable",
            error_message=(
                f"waited {waited:.3g}s for a node to run its task, which asks for "
                f"{describe_resources(what['resources'])}{note}; CKVAL_RESOURCE_WAIT_S="
                f"{self.wait_limit_s:g} bounds that wait. See `ray status` for pending "
                "nodes and demands; give the cluster room (or raise CKVAL_RESOURCE_WAIT_S), "
                f"then `ckval retry {handle.job.job_id}`."
            ),
            retryable=False,
        )

    def status(self, now: float) -> list[dict[str, Any]]:
        """The attempts recorded waiting: job, since how long, what for (`ckval status`)."""
        return [
            {"job_id": job_id, "waiting_s": round(now - since, 1), **what}
            for job_id, (since, what) in sorted(self.waiting.items())
        ]


def waiting_for(handle: AttemptHandle, verdict: Verdict | None) -> dict[str, Any]:
    """What the attempt's task waits for, as the registry keeps it."""
    if verdict is not None:
        return verdict.waiting_for()
    return {"resources": dict(handle.job.resources), "fits": [], "note": ""}


def infeasible(job: ClaimedJob, verdict: Verdict) -> JobOutcome:
    """The outcome of a job that no node and no node type can ever run."""
    return JobOutcome(
        succeeded=False,
        error_type="InfeasibleResources",
        error_message=(
            f"validation_resources {_shown(job.resources)} can never be served: "
            f"{verdict.reason}. Fix the resources (or the cluster's node types, pools), then "
            f"`ckval retry {job.job_id}`."
        ),
        retryable=False,
    )


def with_usage(executor: Executor, handle: AttemptHandle, outcome: JobOutcome) -> JobOutcome:
    """``outcome`` with what the attempt held while it ran (an attempt the service ends
    itself: a timeout, a wait too long)."""
    usage = usage_of(executor, handle)
    if usage is None:
        return outcome
    return dataclasses.replace(
        outcome, node_id=usage.node_id, started_at=usage.started_at, **usage.outcome_fields()
    )


def _shown(resources: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{key}: {value}" for key, value in sorted(resources.items())) + "}"
