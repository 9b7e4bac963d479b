"""The body of one validation attempt, wherever it runs: load, verify, call, check."""

from __future__ import annotations

import contextvars
import dataclasses
import datetime as dt
import importlib
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle

from validation_service.errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    InvalidInput,
    PermanentValidationError,
)
from validation_service.metrics import normalize_metrics
from validation_service.registry.records import ClaimedJob
from validation_service.storage import CheckpointStorage


@dataclasses.dataclass(frozen=True)
class ValidationContext:
    """Which validation is running, for validators that name things after it."""

    run: str
    namespace: str
    report_index: int
    job_id: int
    attempt: int
    checkpoint_uri: str
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def stored_checkpoint(self):
        """The checkpoint where it is stored (any node can read it), not a local copy."""
        from validation_service.storage import ray_checkpoint

        return ray_checkpoint(self.checkpoint_uri, self.storage_options)


_current: contextvars.ContextVar[ValidationContext | None] = contextvars.ContextVar(
    "ckval_current_validation", default=None
)


def current_validation() -> ValidationContext | None:
    """The validation this code runs in (inside a validate_fn), else None."""
    return _current.get()


# Errors that cannot go away by running the same attempt again.
_PERMANENT = (CheckpointNotFound, CheckpointCorrupt, PermanentValidationError, InvalidInput)


def load_validate_fn(ref: str | None, pickled: bytes | None) -> Callable[..., Any]:
    if pickled is not None:
        return cloudpickle.loads(pickled)
    if not ref:
        raise InvalidInput("the job has no validate_fn")
    return import_validate_fn(ref)


def import_validate_fn(ref: str) -> Callable[..., Any]:
    """Imports "package.module:function" (dots after the colon walk attributes)."""
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise InvalidInput(
            f"validate_fn reference {ref!r} is not of the form 'package.module:function'."
        )
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInput(
            f"validate_fn reference {ref!r}: module {module_name!r} does not import ({exc}). "
            "Install the package that defines it on the cluster, or pass the function itself."
        ) from None
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InvalidInput(
                f"validate_fn reference {ref!r}: {module_name!r} has no attribute {attr_path!r}."
            ) from None
    if not callable(target):
        raise InvalidInput(f"validate_fn reference {ref!r} names a {type(target).__name__}.")
    return target


def run_attempt(job: ClaimedJob, storage_root: str, storage_options: dict) -> dict[str, Any]:
    """Runs one attempt and returns a plain outcome dict (errors are values, not raises)."""
    started_at = dt.datetime.now(dt.timezone.utc)
    where = _where()
    workdir = tempfile.mkdtemp(prefix=f"ckval-job{job.job_id}-")
    try:
        from ray.train import Checkpoint

        storage = CheckpointStorage(storage_root, storage_options)
        validate_fn = load_validate_fn(job.validate_fn_ref, job.validate_fn_pickle)
        config = cloudpickle.loads(job.validate_config) if job.validate_config else {}
        local_dir = storage.materialize(job.uri, job.manifest_sha256, workdir)
        token = _current.set(
            ValidationContext(
                job.run,
                job.namespace,
                job.report_index,
                job.job_id,
                job.attempt,
                job.uri,
                storage_options,
            )
        )
        try:
            result = validate_fn(Checkpoint.from_directory(local_dir), config)
        finally:
            _current.reset(token)
        if not isinstance(result, dict):
            raise InvalidInput(
                f"validate_fn {_name(validate_fn)} returned {type(result).__name__} "
                f"({_preview(result)}); it must return a dict of metric name -> value, "
                "e.g. {'accuracy': 0.93}."
            )
        metrics = normalize_metrics(result, what=f"validate_fn {_name(validate_fn)}'s result")
        return {
            "succeeded": True,
            "metrics": metrics,
            "started_at": started_at,
            **where,
            "finished_at": dt.datetime.now(dt.timezone.utc),
        }
    except Exception as exc:  # noqa: BLE001 - every failure is recorded on the job
        return {
            "succeeded": False,
            "error_type": type(exc).__name__,
            "error_message": str(exc) or repr(exc),
            "error_traceback": traceback.format_exc(),
            "retryable": not isinstance(exc, _PERMANENT),
            "started_at": started_at,
            "finished_at": dt.datetime.now(dt.timezone.utc),
            **where,
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _where() -> dict[str, Any]:
    node_id = None
    try:
        import ray

        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - where it ran is informative only
        pass
    return {"node_id": node_id, "worker_pid": os.getpid()}


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
