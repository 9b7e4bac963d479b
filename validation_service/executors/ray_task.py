"""Runs a validation attempt as a plain Ray task with the resources the job asked for.

The task streams two results: first where it runs and what Ray assigned it (the moment it
runs: until then it waits for resources, and its timeout does not count), then the
attempt's outcome.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ray

from validation_service.capacity import (
    ClusterCapacity,
    Verdict,
    accelerator_type_in,
    accelerators_held,
    task_options,
)
from validation_service.config import Settings
from validation_service.executors import AttemptHandle, AttemptUsage
from validation_service.executors._run import run_attempt
from validation_service.jobs import ExecutorKind
from validation_service.registry.records import ClaimedJob, JobOutcome
from validation_service.signing import PayloadTrust

__all__ = ["RayTaskExecutor", "task_options"]


@ray.remote(max_retries=0, num_returns="streaming")
def _validation_task(
    job: ClaimedJob, storage_root: str, storage_options: dict, trust: PayloadTrust
) -> Iterator[dict]:
    # The keys travel as an argument: Ray's state API shows a task's runtime_env, never
    # its arguments.
    context = ray.get_runtime_context()
    yield {
        "node_id": context.get_node_id(),
        "started_at": dt.datetime.now(dt.timezone.utc),
        "assigned": context.get_assigned_resources(),
    }
    yield run_attempt(job, storage_root, storage_options, trust)


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
    # The task's two results (ray.ObjectRefGenerator): where it runs, then the outcome.
    stream: Any = None
    running_since: float | None = None  # time.monotonic() when its first result came
    usage: AttemptUsage | None = None


class RayTaskExecutor:
    kind = ExecutorKind.RAY_TASK.value

    def __init__(self, settings: Settings, capacity: ClusterCapacity | None = None):
        self.settings = settings
        self.trust = PayloadTrust.from_settings(settings)
        self.capacity = capacity or ClusterCapacity(settings.node_types)

    def launch(self, job: ClaimedJob) -> RayTaskHandle:
        stream = _validation_task.options(
            name=f"ckval-validate:{job.run}:{job.report_index}",
            **task_options(job.resources),
        ).remote(job, job.storage_root, self.settings.storage_options, self.trust)
        return RayTaskHandle(job, time.monotonic(), stream)

    def judge(self, job: ClaimedJob) -> Verdict:
        """Whether a node of the cluster, or one its autoscaler can add, can run the job's
        task (see capacity.ClusterCapacity)."""
        return self.capacity.judge(job.resources)

    def started(self, handle: RayTaskHandle) -> float | None:
        return handle.running_since

    def usage(self, handle: RayTaskHandle) -> AttemptUsage | None:
        return handle.usage

    def _began(self, handle: RayTaskHandle, first: dict[str, Any]) -> None:
        """The task's first result: it runs, on this node, holding what Ray assigned."""
        assigned = first.get("assigned") or {}
        held = accelerators_held(assigned)
        kind = accelerator_type_in(assigned)
        if kind is None and held:
            kind = self.capacity.accelerator_type_of(first["node_id"])
        handle.running_since = time.monotonic()
        handle.usage = AttemptUsage(first["node_id"], first["started_at"], kind, held)

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
        try:
            while handle.stream.next_ready():
                result = ray.get(next(handle.stream))
                if handle.usage is None:
                    self._began(handle, result)
                    continue
                return JobOutcome(**result, **handle.usage.outcome_fields())
            if handle.stream.is_finished():
                raise StopIteration
        except ray.exceptions.TaskCancelledError:
            return self._lost(handle, "TaskCancelled", "the validation task was cancelled", False)
        except ray.exceptions.RayError as exc:
            # Worker crash, node loss, out of memory: the attempt may succeed elsewhere.
            text = str(exc).strip()
            message = text.splitlines()[0] if text else repr(exc)
            return self._lost(handle, type(exc).__name__, message, True, text)
        except StopIteration:
            message = "the validation task ended without an outcome"
            return self._lost(handle, "TaskLost", message, True)
        return None

    def _lost(self, handle, error_type, message, retryable, traceback=None) -> JobOutcome:
        """The outcome of an attempt whose task ended without one, with what it held."""
        usage = handle.usage
        held = {} if usage is None else usage.outcome_fields()
        return JobOutcome(
            succeeded=False,
            error_type=error_type,
            error_message=message,
            error_traceback=traceback,
            retryable=retryable,
            node_id=None if usage is None else usage.node_id,
            started_at=None if usage is None else usage.started_at,
            **held,
        )

    def cancel(self, handle: RayTaskHandle) -> None:
        ray.cancel(handle.stream, force=True)

    def when_done(self, handle: RayTaskHandle, callback: Callable[[], None]) -> None:
        handle.stream.completed().future().add_done_callback(lambda _future: callback())
