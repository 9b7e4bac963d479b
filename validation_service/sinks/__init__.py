"""Sinks: where validated metrics go besides the registry (MLflow, Weights & Biases).

``Settings.sinks`` (``CKVAL_SINKS``) names them: ``"mlflow,wandb"``, or a JSON list of
objects with a ``kind`` and that kind's options, e.g.
``[{"kind": "mlflow", "tracking_uri": "sqlite:////data/mlflow.db"}]``. A kind is one of
SINK_KINDS or an importable ``"package.module:Class"`` taking the options as keyword
arguments. The scheduler hands each SUCCEEDED job to a SinkDispatcher, which logs its
metrics from a background thread: a sink that fails is retried with backoff and, once out
of attempts, logged as a WARNING and counted (``sink_failures`` in the service's status);
the validation itself is never failed by a sink. What a sink did otherwise than the run
asked (its own tracker run instead of the one recorded) is stored with the job as a
warning (``ckval job N``, ``/jobs/N``).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from validation_service.errors import InvalidInput

logger = logging.getLogger(__name__)

# The run tag under which report() records the tracker runs the training logged to.
TRACKERS_TAG = "trackers"
# The x-axis that validated metrics are logged against where a tracker has its own step.
STEP_KEY = "ckval/step"


@dataclasses.dataclass(frozen=True)
class ValidatedMetrics:
    """One SUCCEEDED validation, as the sinks log it."""

    job_id: int
    run: str
    namespace: str
    report_index: int
    # The checkpoint's training step: its reported "step", else "epoch", else report index.
    step: int
    metrics: dict[str, float]  # the finite numeric validated metrics
    checkpoint_uri: str
    # The tracker runs the training logged to: {"mlflow": {"run_id", "tracking_uri",
    # "experiment_id"}, "wandb": {"id", "project", "entity"}}, each only if it had one.
    trackers: dict[str, dict[str, Any]]


class Sink(Protocol):
    """Logs validated metrics somewhere; raises on failure (the dispatcher retries).

    ``log()`` may return warnings by job id (or None): each is stored with its job. The
    sinks of this package warn when they log elsewhere than the tracker run recorded.
    ``close()`` lets go of what the sink holds open (tracker runs, connections); the
    dispatcher calls it when idle and at shutdown, and may call ``log()`` again after it.
    """

    kind: str

    def log(self, batch: Sequence[ValidatedMetrics]) -> Mapping[int, Sequence[str]] | None: ...

    def close(self) -> None: ...


# kind -> (the class, as "module:Class", and the options it takes)
SINK_KINDS: dict[str, tuple[str, frozenset[str]]] = {
    "mlflow": (
        "validation_service.sinks.mlflow:MlflowSink",
        frozenset(
            {"tracking_uri", "experiment", "prefix", "allowed_tracking_uris", "allowed_experiments"}
        ),
    ),
    "wandb": (
        "validation_service.sinks.wandb:WandbSink",
        frozenset({"project", "entity", "prefix", "mode", "dir", "allowed_entities"}),
    ),
}


def parse_sinks(value: Any) -> list[dict[str, Any]]:
    """The sink configurations of ``CKVAL_SINKS`` / ``Settings(sinks=...)``, checked.

    Accepts ``None`` or ``""`` (no sinks), ``"mlflow,wandb"``, a JSON list, or a list of
    kinds and ``{"kind": ..., **options}`` dicts. Raises InvalidInput naming the problem.
    """
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        if text.startswith(("[", "{")):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InvalidInput(
                    f"CKVAL_SINKS is not valid JSON ({exc}); write e.g. "
                    '[{"kind": "mlflow", "tracking_uri": "sqlite:///mlflow.db"}] or mlflow,wandb'
                ) from None
        else:
            value = [kind.strip() for kind in text.split(",") if kind.strip()]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise InvalidInput(
            "sinks must be a list of sink kinds or {'kind': ...} objects, got a "
            f"{type(value).__name__}"
        )
    return [_checked_sink(item) for item in value]


def _checked_sink(item: Any) -> dict[str, Any]:
    if isinstance(item, str):
        item = {"kind": item}
    if not isinstance(item, dict) or not isinstance(item.get("kind"), str):
        # The item itself is not shown: its options may hold credentials.
        raise InvalidInput(
            f"each sink is a kind ({', '.join(SINK_KINDS)}) or an object with a 'kind', "
            f"got a {type(item).__name__}"
            + (f" with the keys {sorted(item)}" if isinstance(item, dict) else "")
        )
    kind = item["kind"]
    options = set(item) - {"kind"}
    if kind in SINK_KINDS:
        unknown = options - SINK_KINDS[kind][1]
        if unknown:
            raise InvalidInput(
                f"sink {kind!r} has unknown options {sorted(unknown)}; it takes "
                f"{sorted(SINK_KINDS[kind][1])}"
            )
    elif ":" not in kind:
        raise InvalidInput(
            f"unknown sink kind {kind!r}: use one of {sorted(SINK_KINDS)} or an importable "
            "'package.module:Class'"
        )
    return dict(item)


def build_sink(config: dict[str, Any]) -> Sink:
    """The sink a checked configuration names (imports its tracker's package)."""
    options = {k: v for k, v in config.items() if k != "kind"}
    kind = config["kind"]
    reference = SINK_KINDS[kind][0] if kind in SINK_KINDS else kind
    module_name, _, class_name = reference.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except ImportError as exc:
        extra = f" (pip install 'ckval[{kind}]')" if kind in SINK_KINDS else ""
        raise InvalidInput(f"sink {kind!r} cannot be loaded: {exc}{extra}") from None
    except AttributeError:
        raise InvalidInput(f"sink {kind!r}: {module_name} has no {class_name}") from None
    return cls(**options)


def finite_metrics(metrics: dict[str, Any] | None) -> dict[str, float]:
    """The values a tracker can plot: numbers (not bools) that are finite."""
    return {
        name: float(value)
        for name, value in (metrics or {}).items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


def checkpoint_step(reported_metrics: dict[str, Any], report_index: int) -> int:
    """The training step a checkpoint was reported at: "step", else "epoch", else its index."""
    for key in ("step", "epoch"):
        value = reported_metrics.get(key)
        if isinstance(value, bool):
            continue
        if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
            return int(value)
    return report_index


@dataclasses.dataclass
class _Delivery:
    sink_index: int
    item: ValidatedMetrics
    attempts: int = 0
    due: float = 0.0


class SinkDispatcher:
    """Logs SUCCEEDED jobs' metrics to the sinks from one background thread.

    ``submit(job)`` never blocks the scheduler. Each (sink, job) is tried up to
    ``attempts`` times, ``backoff_s`` doubling between tries; what still fails is logged
    as a WARNING, counted in ``stats["sink_failures"]`` and kept in ``failures``.
    """

    def __init__(
        self,
        configs: Sequence[dict[str, Any]],
        jobs,
        stats: dict[str, int],
        *,
        attempts: int = 4,
        backoff_s: float = 2.0,
        release_after_s: float = 30.0,
    ):
        self.configs = [parse_sinks([c])[0] for c in configs]
        # The registry's JobQueue: a job's record and its run's tags, its warnings stored.
        self.jobs = jobs
        self.stats = stats
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.stats.setdefault("sink_deliveries", 0)
        self.stats.setdefault("sink_failures", 0)
        # (job id, sink kind, error) of deliveries that ran out of attempts, newest last.
        self.failures: collections.deque[tuple[int, str, str]] = collections.deque(maxlen=100)
        self._sinks: list[Sink | None] = [None] * len(self.configs)
        self._incoming: collections.deque = collections.deque()
        self._retries: list[_Delivery] = []
        self._wake = threading.Condition()
        self._idle = True
        self._stopped = False
        self._thread: threading.Thread | None = None
        # Sinks keep tracker runs open while validations keep coming; once nothing came
        # for release_after_s they are closed (finished), and reopened by the next batch.
        self.release_after_s = release_after_s
        self._last_delivery: float | None = None

    @classmethod
    def from_settings(cls, settings, jobs, stats: dict[str, int]) -> SinkDispatcher:
        # The MLflow sink logs only to the tracking servers, and into recorded runs of the
        # experiments, that the service's settings allow.
        allowed = {
            "allowed_tracking_uris": list(settings.mlflow_allowed_uris),
            "allowed_experiments": list(settings.mlflow_allowed_experiments),
        }
        return cls(
            [
                {**allowed, **c}
                if c.get("kind") == "mlflow"
                else {"allowed_entities": list(settings.wandb_allowed_entities), **c}
                if c.get("kind") == "wandb"
                else c
                for c in settings.sinks
            ],
            jobs,
            stats,
            attempts=settings.sink_attempts,
            backoff_s=settings.sink_backoff_s,
        )

    def submit(self, job) -> None:
        """Queues a finished job (a ClaimedJob) whose metrics the sinks should log."""
        if not self.configs:
            return
        with self._wake:
            self._incoming.append(job)
            self._idle = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ckval-sinks", daemon=True)
                self._thread.start()
            self._wake.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits until nothing is queued or waiting for a retry; returns whether it was."""
        with self._wake:
            return self._wake.wait_for(lambda: self._idle, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Delivers what is due within ``timeout_s``, then stops the thread."""
        self.wait_idle(timeout_s)
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._release_sinks()

    # ------------------------------------------------------------- the thread
    def _loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(self._has_due_work, self._seconds_to_wait())
                if self._stopped:
                    return
                jobs = list(self._incoming)
                self._incoming.clear()
                now = time.monotonic()
                due = [d for d in self._retries if d.due <= now]
                self._retries = [d for d in self._retries if d.due > now]
            deliveries = due + [
                _Delivery(index, item)
                for item in self._items(jobs)
                for index in range(len(self.configs))
            ]
            if deliveries:
                self._deliver(deliveries)
                self._last_delivery = time.monotonic()
            elif self._last_delivery is not None and (
                time.monotonic() - self._last_delivery >= self.release_after_s
            ):
                self._release_sinks()
                self._last_delivery = None
            with self._wake:
                if not self._incoming and not self._retries:
                    self._idle = True
                    self._wake.notify_all()

    def _has_due_work(self) -> bool:
        now = time.monotonic()
        return self._stopped or bool(self._incoming) or any(d.due <= now for d in self._retries)

    def _seconds_to_wait(self) -> float | None:
        """Until the next retry is due, or until idle sinks should let go of their runs."""
        times = [d.due for d in self._retries]
        if self._last_delivery is not None:
            times.append(self._last_delivery + self.release_after_s)
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _release_sinks(self) -> None:
        for sink in self._sinks:
            if sink is not None:
                try:
                    sink.close()
                except Exception:  # noqa: BLE001 - the next batch opens afresh
                    logger.warning("closing sink %r failed", sink.kind, exc_info=True)

    def _items(self, jobs) -> list[ValidatedMetrics]:
        items = []
        for job in jobs:
            try:
                record, tags = self.jobs.job_and_run_tags(job.job_id, job.run, job.namespace)
                if record.status != "SUCCEEDED":
                    continue  # e.g. metrics that could not be stored failed the attempt
            except Exception:  # noqa: BLE001 - the registry is down: this job is not logged
                logger.warning(
                    "could not read validation job %s to log its metrics to the sinks",
                    job.job_id,
                    exc_info=True,
                )
                self.stats["sink_failures"] += len(self.configs)
                continue
            items.append(
                ValidatedMetrics(
                    job_id=job.job_id,
                    run=job.run,
                    namespace=job.namespace,
                    report_index=job.report_index,
                    step=checkpoint_step(job.reported_metrics, job.report_index),
                    metrics=finite_metrics(record.result_metrics),
                    checkpoint_uri=job.uri,
                    trackers=dict(tags.get(TRACKERS_TAG) or {}),
                )
            )
        return items

    def _deliver(self, deliveries: list[_Delivery]) -> None:
        by_sink: dict[int, list[_Delivery]] = {}
        for delivery in deliveries:
            by_sink.setdefault(delivery.sink_index, []).append(delivery)
        for index, batch in by_sink.items():
            kind = self.configs[index]["kind"]
            try:
                sink = self._sinks[index]
                if sink is None:
                    sink = self._sinks[index] = build_sink(self.configs[index])
                warnings = sink.log([d.item for d in batch])
            except Exception as exc:  # noqa: BLE001 - a sink never fails a validation
                self._failed(kind, batch, exc)
            else:
                self.stats["sink_deliveries"] += len(batch)
                self._store_warnings(kind, warnings or {})

    def _store_warnings(self, kind: str, warnings: Mapping[int, Sequence[str]]) -> None:
        """Stores a sink's warnings with their jobs (shown wherever a job is shown)."""
        for job_id, messages in warnings.items():
            if not messages:
                continue
            try:
                self.jobs.add_warnings(job_id, [f"sink {kind}: {message}" for message in messages])
            except Exception:  # noqa: BLE001 - the warning is in the log still
                logger.warning(
                    "could not store the warning of sink %r with validation job %s",
                    *(kind, job_id),
                    exc_info=True,
                )

    def _failed(self, kind: str, batch: list[_Delivery], exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}"
        for delivery in batch:
            delivery.attempts += 1
            if delivery.attempts < self.attempts:
                delay = self.backoff_s * 2 ** (delivery.attempts - 1)
                delivery.due = time.monotonic() + delay
                with self._wake:
                    self._retries.append(delivery)
                continue
            self.stats["sink_failures"] += 1
            self.failures.append((delivery.item.job_id, kind, error))
            logger.warning(
                "could not log the metrics of validation job %s (run %r) to sink %r after "
                "%d attempts: %s. The validation itself SUCCEEDED; its metrics are in the "
                "registry (`ckval job %s`).",
                delivery.item.job_id,
                delivery.item.run,
                kind,
                delivery.attempts,
                error,
                delivery.item.job_id,
            )
        logger.debug("sink %r failed", kind, exc_info=exc)
