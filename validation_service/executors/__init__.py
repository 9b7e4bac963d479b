"""Executors: how one validation attempt runs. Small classes behind one protocol."""

from __future__ import annotations

from typing import Any, Protocol

from validation_service.executors._run import ValidationContext, current_validation
from validation_service.registry.records import ClaimedJob, JobOutcome

__all__ = ["Executor", "ValidationContext", "current_validation", "default_executors"]


class Executor(Protocol):
    """launch(job) -> handle; poll(handle) -> outcome once done; cancel(handle)."""

    kind: str

    def launch(self, job: ClaimedJob) -> Any: ...

    def poll(self, handle: Any) -> JobOutcome | None: ...

    def cancel(self, handle: Any) -> None: ...


def default_executors(settings) -> dict[str, Executor]:
    from validation_service.executors.ray_task import RayTaskExecutor

    executor = RayTaskExecutor(settings)
    return {executor.kind: executor}
