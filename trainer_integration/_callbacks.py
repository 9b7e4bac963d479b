"""What the framework callbacks share (Keras, Transformers, Lightning): their report
arguments, where a checkpoint goes (report() in Ray Train, a Client outside), and the
validated metrics that come back from the registry while training goes on."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import shutil
import sys
import threading
from collections.abc import Callable
from typing import Any

from trainer_integration import CheckpointUploadMode, Client, report, upload_mode
from trainer_integration._context import started_run as _started_run
from trainer_integration._context import train_context
from trainer_integration._imports import import_once
from validation_service.errors import InvalidInput

logger = logging.getLogger(__name__)

# A validation that ended without metrics: said once, in the training's log.
_ENDED_WITHOUT_METRICS = ("FAILED", "TIMED_OUT", "CANCELLED")


class CallbackReporter:
    """Reports a callback's checkpoints with the callback's validation options.

    Checks the arguments every front-door callback takes (those of the Keras callback)
    when the callback is made, before training starts: a validate_fn that cannot be
    pickled, or a run name given inside Ray Train, fails there. Inside Ray Train each
    report goes through ``report()`` (rank 0 passes the checkpoint, the other ranks
    report without one); outside, through ``Client(run)``.
    """

    def __init__(
        self,
        what: str,
        *,
        validate_fn: Callable[..., dict] | str | None,
        validate_config: dict | None,
        validation_resources: dict | None,
        checkpoint_upload_mode: CheckpointUploadMode,
        max_attempts: int,
        timeout_s: float | None,
        run: str | None,
        temporary_folders: bool = True,
    ) -> None:
        check_validate_fn(validate_fn)
        checkpoint_upload_mode = upload_mode(checkpoint_upload_mode)
        if temporary_folders and checkpoint_upload_mode is CheckpointUploadMode.NO_UPLOAD:
            raise InvalidInput(
                f"{what} saves each checkpoint into a folder of its own, which is not in "
                "ckval's storage: use CheckpointUploadMode.SYNC or ASYNC, not NO_UPLOAD."
            )
        context = train_context()
        if run is not None and context is not None:
            raise InvalidInput(
                f"run={run!r} was given inside a Ray Train worker, where the run is "
                "RunConfig(name=...): leave run= out there."
            )
        if run is None and context is None and _started_run() is None:
            raise InvalidInput(
                f"{what} outside a Ray Train worker needs run='my-run' (the ckval run its "
                "checkpoints go to); inside a Ray Train worker it uses RunConfig(name=...)."
            )
        if validate_fn is not None:
            check_report_options(
                validate_fn, validate_config, validation_resources, max_attempts, timeout_s
            )
        elif validate_config or validation_resources:
            raise InvalidInput(
                f"{what}: validate_config and validation_resources need a validate_fn."
            )
        self.what = what
        self.mode = checkpoint_upload_mode
        self.options = {
            "validate_fn": validate_fn,
            "validate_config": validate_config,
            "validation_resources": validation_resources,
            "checkpoint_upload_mode": checkpoint_upload_mode,
            "max_attempts": max_attempts,
            "timeout_s": timeout_s,
        }
        self._run = run
        self._client: Client | None = None
        self._registry = None

    @property
    def chief(self) -> bool:
        """Whether this process reports checkpoints: rank 0 in Ray Train, or the script."""
        context = train_context()
        return context is None or context.get_world_rank() == 0

    @property
    def run_name(self) -> str:
        """The ckval run: ``run=``, or the Ray Train run's name (RunConfig(name=...))."""
        if self._run is not None:
            return self._run
        context = train_context()
        if context is None:
            return _started_run()
        from trainer_integration._client import ray_train_run_name

        return ray_train_run_name(context)

    @property
    def registry(self):
        """The registry the run's checkpoints are registered in (the reporter's settings)."""
        if self._registry is None:
            from trainer_integration._service_link import resolve_settings

            Registry = import_once("validation_service.registry.registry").Registry

            self._registry = Registry(settings=resolve_settings())
        return self._registry

    def should_stop(self) -> bool:
        """trainer_integration.should_stop() for the callback's run: rank 0's answer on
        every rank (a collective: each rank asks at the same hook)."""
        from trainer_integration import should_stop

        return should_stop(run=self._run)

    def report_metrics(self, metrics: dict) -> None:
        """A report without a checkpoint (the other ranks of a Ray Train run)."""
        if self._run is None:
            report(metrics, None)

    def report_folder(self, metrics: dict, directory: str, *, owned: bool) -> None:
        """Reports the checkpoint folder with the callback's options.

        An ``owned`` folder (made by the callback) is gone afterwards: deleted here once
        SYNC has copied it, by ckval once ASYNC has. A folder of the framework's own
        (the Hugging Face Trainer's) is left where it is.
        """
        from ray.train import Checkpoint

        checkpoint = Checkpoint.from_directory(directory)
        delete_after_copy = owned and self.mode is CheckpointUploadMode.ASYNC
        try:
            if self._run is None:
                report(
                    metrics,
                    checkpoint,
                    **self.options,
                    delete_local_checkpoint_after_upload=delete_after_copy,
                )
            else:
                if self._client is None:
                    self._client = Client(self._run)
                self._client.report(
                    metrics,
                    checkpoint,
                    **self.options,
                    delete_local_checkpoint_after_upload=delete_after_copy,
                )
        finally:
            if owned and not delete_after_copy:
                shutil.rmtree(directory, ignore_errors=True)

    def close(self, *, failed: bool = False) -> None:
        """Ends the run of ``run=`` (FINISHED, or FAILED), once its reports are delivered."""
        client, self._client = self._client, None
        if client is not None:
            client.close(failed=failed)


def check_validate_fn(validate_fn: Any) -> None:
    if validate_fn is not None and not (callable(validate_fn) or isinstance(validate_fn, str)):
        raise InvalidInput(
            f"validate_fn must be a callable (checkpoint, config) -> dict or an import "
            f"reference 'pkg.module:fn', got {validate_fn!r}."
        )


def check_report_options(
    validate_fn, validate_config, validation_resources, max_attempts, timeout_s
) -> None:
    """Checks what every report of the callback will ask for, now: a validate_fn or
    validate_config that cannot be pickled, or resources ckval cannot use, fail here."""
    from validation_service.payloads import validation_request
    from validation_service.validate_fn import takes_config_as_keywords

    validation_request(
        validate_fn,
        validate_config,
        validation_resources,
        priority=0,
        timeout_s=timeout_s,
        max_attempts=max_attempts,
    )
    if callable(validate_fn):
        takes_config_as_keywords(validate_fn, validate_config or {})


# The keyword arguments every front-door callback takes for its reports.
REPORT_OPTIONS = (
    "validate_fn",
    "validate_config",
    "validation_resources",
    "checkpoint_upload_mode",
    "max_attempts",
    "timeout_s",
    "run",
)


def callback_reporter(arguments: dict[str, Any], **extra: Any) -> CallbackReporter:
    """The reporter of a ``ReportCheckpointCallback`` made with ``arguments`` (its
    ``__init__``'s ``locals()``): the options of ``REPORT_OPTIONS``, checked now."""
    options = {name: arguments[name] for name in REPORT_OPTIONS}
    return CallbackReporter("ReportCheckpointCallback", **options, **extra)


class ValidatedMetricsCallback:
    """What the Transformers and Lightning callbacks share: a reporter, and a feed of the
    validated metrics that come back from the registry while training goes on."""

    _reporter: CallbackReporter
    _feed: ValidatedMetricsFeed

    def _start_reporting(self, reporter: CallbackReporter, poll_interval_s: float) -> None:
        self._reporter = reporter
        self._feed = ValidatedMetricsFeed(reporter, poll_interval_s)

    @property
    def run_name(self) -> str:
        """The ckval run the checkpoints go to."""
        return self._reporter.run_name

    @property
    def received(self) -> dict[int, dict[str, Any]]:
        """Validated metrics by report index, as they have arrived so far."""
        return self._feed.received()

    def best_checkpoints(self, metric: str, mode: str = "max", k: int = 1) -> list:
        """The run's top-k checkpoints by a metric, from the registry: [(Checkpoint, metrics)]."""
        return self._reporter.registry.best_checkpoints(self.run_name, metric, mode=mode, k=k)


def check_poll_interval(poll_interval_s: Any) -> None:
    if not isinstance(poll_interval_s, (int, float)) or not poll_interval_s > 0:
        raise InvalidInput(f"poll_interval_s must be a number > 0, got {poll_interval_s!r}")


# ---------------------------------------------------------------- metrics coming back
@dataclasses.dataclass(frozen=True)
class Validated:
    """The outcome of one checkpoint's validation, as the registry recorded it."""

    report_index: int
    step: int | None
    epoch: int | None
    status: str
    metrics: dict[str, Any]


class ValidatedMetricsFeed:
    """Polls the registry on a daemon thread for the run's validations as they end.

    The training thread calls ``take()`` at points of its choosing: it never waits for
    the registry, which only the polling thread reads. ``received()`` gives every
    validated checkpoint's metrics by report index, as they arrived.
    """

    def __init__(self, reporter: CallbackReporter, poll_interval_s: float) -> None:
        self._reporter = reporter
        self._poll_interval_s = poll_interval_s
        self._run: str | None = None
        self._lock = threading.Lock()
        self._seen: set[int] = set()
        self._pending: list[Validated] = []
        self._received: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts polling; the run's name is settled here, on the training thread."""
        self._run = self._reporter.run_name
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll_loop, name="ckval-feed", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=30)

    def received(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            return dict(self._received)

    def take(self) -> list[Validated]:
        """The validations that ended since the last take, in report order."""
        with self._lock:
            taken, self._pending = self._pending, []
        return sorted(taken, key=lambda v: v.report_index)

    def wait(self, timeout_s: float) -> list[Validated]:
        """Waits until no validation of the run is queued or running, then takes."""
        from validation_service.errors import RunNotFound

        self.stop()
        self._run = self._run or self._reporter.run_name
        try:
            self._reporter.registry.wait(self._run, timeout_s=timeout_s)
        except RunNotFound:
            return []  # nothing was reported
        self.poll()
        return self.take()

    def poll(self) -> None:
        """One look at the registry: records the validations that ended since the last."""
        from validation_service.errors import RunNotFound

        try:
            records = self._reporter.registry.checkpoints(self._run)
        except RunNotFound:
            return  # nothing reported yet
        for record in records:
            if record.report_index in self._seen:
                continue
            if record.validation_status == "VALIDATED":
                metrics = dict(record.validated_metrics or {})
            elif record.validation_status in _ENDED_WITHOUT_METRICS:
                logger.warning(
                    "validation of checkpoint %d of run %r ended %s: see `ckval jobs %s`",
                    record.report_index,
                    record.run,
                    record.validation_status,
                    record.run,
                )
                metrics = {}
            else:
                continue
            outcome = Validated(
                record.report_index, record.step, record.epoch, record.validation_status, metrics
            )
            with self._lock:
                self._seen.add(record.report_index)
                self._pending.append(outcome)
                if metrics:
                    self._received[record.report_index] = metrics

    def _poll_loop(self) -> None:
        while not self._stop.wait(self._poll_interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the next look tries again; training goes on
                logger.debug("looking for validated metrics failed", exc_info=True)


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics dict (what loggers and monitors can take)."""
    return {
        name: float(value)
        for name, value in metrics.items()
        if isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    }


# ---------------------------------------------------------------- environment
def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return sys.modules.get(module) is not None


def plain(value: Any) -> Any:
    """A Python number from a framework's scalar (numpy, tensor)."""
    if hasattr(value, "numpy") and not hasattr(value, "item"):
        value = value.numpy()
    if hasattr(value, "item"):
        try:
            return value.item()
        except (ValueError, RuntimeError):  # not one element
            return value
    return value
