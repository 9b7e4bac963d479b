"""Runs a validation attempt as a plain Ray task with the resources the job asked for."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import ray

from validation_service.config import Settings
from validation_service.executors import AttemptHandle
from validation_service.executors._run import run_attempt
from validation_service.jobs import ExecutorKind
from validation_service.registry.records import ClaimedJob, JobOutcome
from validation_service.signing import PayloadTrust


@ray.remote(max_retries=0)
def _validation_task(
    job: ClaimedJob, storage_root: str, storage_options: dict, trust: PayloadTrust
) -> dict:
    # The keys travel as an argument: Ray's state API shows a task's runtime_env, never
    # its arguments.
    return run_attempt(job, storage_root, storage_options, trust)


@dataclasses.dataclass
class RayTaskHandle(AttemptHandle):
    ref: ray.ObjectRef | None = None


def task_options(resources: dict[str, Any]) -> dict[str, Any]:
    """Ray task options from a job's resources dict."""
    options: dict[str, Any] = {"num_cpus": resources.get("num_cpus", 1)}
    if resources.get("num_gpus"):
        options["num_gpus"] = resources["num_gpus"]
    if resources.get("memory"):
        options["memory"] = resources["memory"]
    if resources.get("resources"):
        options["resources"] = dict(resources["resources"])
    if resources.get("accelerator_type"):
        options["accelerator_type"] = resources["accelerator_type"]
    return options


class RayTaskExecutor:
    kind = ExecutorKind.RAY_TASK.value

    def __init__(self, settings: Settings):
        self.settings = settings
        self.trust = PayloadTrust.from_settings(settings)

    def launch(self, job: ClaimedJob) -> RayTaskHandle:
        ref = _validation_task.options(
            name=f"ckval-validate:{job.run}:{job.report_index}",
            **task_options(job.resources),
        ).remote(job, job.storage_root, self.settings.storage_options, self.trust)
        return RayTaskHandle(job, time.monotonic(), ref)

    def poll(self, handle: RayTaskHandle) -> JobOutcome | None:
        ready, _ = ray.wait([handle.ref], timeout=0)
        if not ready:
            return None
        try:
            result = ray.get(handle.ref)
        except ray.exceptions.TaskCancelledError:
            return JobOutcome(
                succeeded=False,
                error_type="TaskCancelled",
                error_message="the validation task was cancelled",
                retryable=False,
            )
        except ray.exceptions.RayError as exc:
            # Worker crash, node loss, out of memory: the attempt may succeed elsewhere.
            return JobOutcome(
                succeeded=False,
                error_type=type(exc).__name__,
                error_message=str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc),
                error_traceback=str(exc),
                retryable=True,
            )
        return JobOutcome(**result)

    def cancel(self, handle: RayTaskHandle) -> None:
        ray.cancel(handle.ref, force=True)

    def when_done(self, handle: RayTaskHandle, callback: Callable[[], None]) -> None:
        handle.ref.future().add_done_callback(lambda _future: callback())
