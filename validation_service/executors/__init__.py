"""Executors: how one validation attempt runs. Small classes behind one protocol."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from validation_service.context import ValidationContext, current_validation
from validation_service.registry.records import ClaimedJob, JobOutcome

__all__ = [
    "AttemptHandle",
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


class Executor(Protocol):
    """launch(job) -> handle; poll(handle) -> outcome once done; cancel(handle)."""

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
