"""Runs a validation attempt as a plain Ray task with the resources the job asked for."""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from collections.abc import Callable, Iterable
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


# What a warm-up may import besides ckval's attempt code: the frameworks a validation of
# a training's checkpoints most likely needs. A fixed list, so that a caller of the
# service can never have it import anything else.
WARM_UP_MODULES = (
    "torch",
    "torchmetrics",
    "tensorflow",
    "jax",
    "lightning",
    "sklearn",
    "transformers",
)
# What validations of a framework's checkpoints usually import although training did not:
# their metrics.
COMPANIONS = {"torch": ("torchmetrics",)}


@ray.remote(max_retries=0)
def _warm_up_task(modules: tuple[str, ...]) -> tuple[int, list[str]]:
    """Starts a worker process and imports what an attempt will; returns its pid and the
    modules it imported. Ray keeps an idle worker for the next task while CPUs are free."""
    # ckval's attempt code is imported already (this function's module imports it), all
    # but Ray Train, which an attempt imports for the Checkpoint it hands validate_fn.
    import ray.train  # noqa: F401

    imported = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - best effort: a validation that needs it will say why
            continue
        imported.append(name)
    return os.getpid(), imported


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

    def warm_up(self, count: int, modules: Iterable[str]) -> list[ray.ObjectRef]:
        """Starts up to ``count`` worker processes for CPU validations, importing the
        named frameworks (those in WARM_UP_MODULES only), so that a run's first
        validations do not pay for a process start and framework imports. Their
        COMPANIONS are left to keep_warm(): as a run starts, every second of importing
        is taken from training.

        Only CPUs free now are used: a warm-up never waits for resources, never holds
        any back from a validation for long, and never makes an autoscaler add a node.
        """
        free = int(ray.available_resources().get("CPU", 0))
        return self._warm_up(min(count, free), modules, companions=False)

    @staticmethod
    def ended(refs: list[ray.ObjectRef]) -> tuple[list[ray.ObjectRef], list[ray.ObjectRef]]:
        """The warm-up tasks of ``refs`` that ended, and those under way."""
        return ray.wait(refs, num_returns=len(refs), timeout=0)

    @staticmethod
    def warm_pids(ended: list[ray.ObjectRef]) -> list[int]:
        """The worker processes that ended warm-ups ran in (those that did not fail)."""
        pids = []
        for ref in ended:
            try:
                pids.append(ray.get(ref, timeout=0)[0])
            except Exception:  # noqa: BLE001 - a failed warm-up warmed nothing
                continue
        return pids

    def keep_warm(self, count: int, modules: Iterable[str]) -> list[ray.ObjectRef]:
        """warm_up() on this process's node, only while no CPU of the cluster is in use."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        total = int(ray.cluster_resources().get("CPU", 0))
        if int(ray.available_resources().get("CPU", 0)) < total:
            return []  # training or validations run: no CPU is taken from them
        node_id = ray.get_runtime_context().get_node_id()
        [node] = [node for node in ray.nodes() if node["NodeID"] == node_id]
        here = NodeAffinitySchedulingStrategy(node_id, soft=False)
        count = min(count, int(node["Resources"].get("CPU", 0)))
        return self._warm_up(count, modules, scheduling_strategy=here)

    def _warm_up(
        self, count: int, modules: Iterable[str], *, companions: bool = True, **options
    ) -> list[ray.ObjectRef]:
        named = set(modules)
        if companions:
            named.update(*(COMPANIONS.get(name, ()) for name in list(named)))
        wanted = tuple(name for name in WARM_UP_MODULES if name in named)
        return [
            _warm_up_task.options(name="ckval-warm-up", num_cpus=1, **options).remote(wanted)
            for _ in range(max(0, count))
        ]

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
