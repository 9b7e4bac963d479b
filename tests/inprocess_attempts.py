"""A Scheduler whose attempts run in this process (run_attempt, the body every executor
runs), for tests of what an attempt refuses or records that need no Ray worker."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from validation_service.config import Settings
from validation_service.executors import AttemptHandle
from validation_service.executors._run import run_attempt
from validation_service.registry.records import ClaimedJob, JobOutcome
from validation_service.registry.registry import Registry
from validation_service.retry import RetryPolicy
from validation_service.service.scheduler import Scheduler
from validation_service.signing import PayloadTrust


@dataclasses.dataclass
class InProcessHandle(AttemptHandle):
    outcome: JobOutcome | None = None


class InProcessExecutor:
    """Runs each attempt at launch, in this process, with the service's trust."""

    kind = "ray_task"

    def __init__(self, settings: Settings):
        self.settings = settings
        self.trust = PayloadTrust.from_settings(settings)

    def launch(self, job: ClaimedJob) -> InProcessHandle:
        options = dict(self.settings.storage_options)
        outcome = run_attempt(job, job.storage_root, options, self.trust)
        return InProcessHandle(job, time.monotonic(), JobOutcome(**outcome))

    def poll(self, handle: InProcessHandle) -> JobOutcome | None:
        return handle.outcome

    def cancel(self, handle: InProcessHandle) -> None:
        pass

    def when_done(self, handle: InProcessHandle, callback: Callable[[], None]) -> None:
        callback()


def run_until_settled(registry: Registry, settings: Settings, job_id: int, timeout_s=60.0):
    """Ticks a scheduler with in-process attempts until the job leaves QUEUED and
    RUNNING (or its retries are spent); returns the job."""
    scheduler = Scheduler(
        registry,
        settings,
        executors={"ray_task": InProcessExecutor(settings)},
        retry_policy=RetryPolicy(backoff_s=0.0),
    )
    deadline = time.monotonic() + timeout_s
    while registry.get_job(job_id).status in ("QUEUED", "RUNNING"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {registry.get_job(job_id).status}")
        scheduler.tick()
    return registry.get_job(job_id)
