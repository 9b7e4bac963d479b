"""Executors: how one validation attempt runs. Small classes behind one protocol."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from validation_service.context import ValidationContext, current_validation
from validation_service.registry.records import ClaimedJob, JobOutcome

if TYPE_CHECKING:
    from validation_service.capacity import Verdict

__all__ = [
    "AttemptHandle",
    "AttemptUsage",
    "Executor",
    "ValidationContext",
    "current_validation",
    "default_executors",
]


@dataclasses.dataclass
class AttemptHandle:
    """One launched attempt: the job it runs and when it started (time.monotonic())."""

    job: ClaimedJob
    launched_at: float


@dataclasses.dataclass(frozen=True)
class AttemptUsage:
    """Where a launched attempt runs and what it holds, from the moment it runs."""

    node_id: str | None
    started_at: dt.datetime
    accelerator_type: str | None
    accelerators: float

    def outcome_fields(self) -> dict[str, Any]:
        """The JobOutcome fields of what the attempt held."""
        return {"accelerator_type": self.accelerator_type, "accelerators": self.accelerators}


class Executor(Protocol):
    """launch(job) -> handle; poll(handle) -> outcome once done; cancel(handle).

    An executor whose attempts may wait for resources before they run (a Ray task
    pending on a node) also has ``started(handle)``: when it began to run
    (time.monotonic()), None while it waits; ``usage(handle)``: its AttemptUsage once it
    runs; and ``judge(job)``: whether what the job asks can ever be served (a
    capacity.Verdict). See running_since, usage_of and verdict_on.
    """

    kind: str

    def launch(self, job: ClaimedJob) -> AttemptHandle: ...

    def poll(self, handle: AttemptHandle) -> JobOutcome | None: ...

    def cancel(self, handle: AttemptHandle) -> None: ...

    def when_done(self, handle: AttemptHandle, callback: Callable[[], None]) -> None:
        """Calls ``callback`` (from any thread) once the attempt ends, so that the
        scheduler collects it at once rather than at its next poll."""


def default_executors(settings) -> dict[str, Executor]:
    from validation_service.executors.ray_task import RayTaskExecutor

    executor = RayTaskExecutor(settings)
    return {executor.kind: executor}


def running_since(executor: Executor, handle: AttemptHandle) -> float | None:
    """When the attempt began to run (time.monotonic()), None while it waits for
    resources; an executor that cannot tell runs its attempts from their launch."""
    started = getattr(executor, "started", None)
    return handle.launched_at if started is None else started(handle)


def usage_of(executor: Executor, handle: AttemptHandle) -> AttemptUsage | None:
    """What the attempt holds where, once it runs (None: not known)."""
    usage = getattr(executor, "usage", None)
    return None if usage is None else usage(handle)


def verdict_on(executor: Executor, job: ClaimedJob) -> Verdict | None:
    """Whether the job's resources can ever be served where the executor runs it (None:
    the executor cannot tell)."""
    judge = getattr(executor, "judge", None)
    return None if judge is None else judge(job)
