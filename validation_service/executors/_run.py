"""The body of one validation attempt, wherever it runs: load, verify, call, check."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile
import traceback
from typing import Any

from validation_service.context import ValidationContext, current_validation, validation_context
from validation_service.errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    InvalidInput,
    PayloadSignatureError,
    PermanentValidationError,
    ValidationTimedOut,
    is_not_to_be_retried,
)
from validation_service.metrics import normalize_metrics
from validation_service.registry.records import ClaimedJob
from validation_service.signing import PayloadTrust, job_binding
from validation_service.storage import CheckpointStorage
from validation_service.validate_fn import (
    call_validate_fn,
    load_job_payloads,
    load_validate_fn,
)
from validation_service.validation import capped_text

# Also importable from here, where they were first defined.
__all__ = [
    "ValidationContext",
    "current_validation",
    "load_validate_fn",
    "run_attempt",
]


# How much of an attempt's kept output (a CommandValidator's program's) is stored.
MAX_LOG_CHARS = 64 * 1024

# Errors that cannot go away by running the same attempt again.
_PERMANENT = (
    CheckpointNotFound,
    CheckpointCorrupt,
    PermanentValidationError,
    InvalidInput,
    PayloadSignatureError,
)


def run_attempt(
    job: ClaimedJob,
    storage_root: str,
    storage_options: dict,
    trust: PayloadTrust | None = None,
) -> dict[str, Any]:
    """Runs one attempt and returns a plain outcome dict (errors are values, not raises).

    The job's payloads are verified with ``trust`` (the service's keys and allowed
    modules; default: this process's settings) before anything is unpickled or imported.
    """
    started_at = dt.datetime.now(dt.timezone.utc)
    where = _where()
    workdir = tempfile.mkdtemp(prefix=f"ckval-job{job.job_id}-")
    kept: list[str] = []
    try:
        metrics = _validate(job, storage_root, storage_options, trust, workdir, kept)
        return {
            "succeeded": True,
            "metrics": metrics,
            "started_at": started_at,
            **where,
            "finished_at": dt.datetime.now(dt.timezone.utc),
            "log": _log(kept),
        }
    except Exception as exc:  # noqa: BLE001 - every failure is recorded on the job
        return {
            "succeeded": False,
            "error_type": type(exc).__name__,
            "error_message": storable_text(capped_text(str(exc) or repr(exc))),
            "error_traceback": storable_text(capped_text(traceback.format_exc())),
            "retryable": not (isinstance(exc, _PERMANENT) or is_not_to_be_retried(exc)),
            "timed_out": isinstance(exc, ValidationTimedOut),
            "started_at": started_at,
            "finished_at": dt.datetime.now(dt.timezone.utc),
            **where,
            "log": _log(kept),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _log(kept: list[str]) -> str | None:
    """The output the validator kept, its last MAX_LOG_CHARS characters."""
    if not kept:
        return None
    text = "".join(kept)
    if len(text) > MAX_LOG_CHARS:
        text = f"[{len(text) - MAX_LOG_CHARS} earlier characters cut]\n" + text[-MAX_LOG_CHARS:]
    return storable_text(text)


def _validate(
    job: ClaimedJob,
    storage_root: str,
    storage_options: dict,
    trust: PayloadTrust | None,
    workdir: str,
    kept: list[str],
) -> dict[str, Any]:
    """Verifies the payloads, materializes the checkpoint into ``workdir`` and calls the
    validate_fn in its context; returns its metrics, normalized."""
    from ray.train import Checkpoint

    if trust is None:
        from validation_service.config import get_settings

        trust = PayloadTrust.from_settings(get_settings())
    storage = CheckpointStorage(storage_root, storage_options)
    validate_fn, config = _payloads(job, trust)
    local_dir = storage.materialize(job.uri, job.manifest_sha256, workdir)
    context = ValidationContext(
        job.run,
        job.namespace,
        job.report_index,
        job.job_id,
        job.attempt,
        job.uri,
        storage_options,
        kept,
    )
    with validation_context(context):
        result = call_validate_fn(validate_fn, Checkpoint.from_directory(local_dir), config)
    if not isinstance(result, dict):
        raise InvalidInput(
            f"validate_fn {_name(validate_fn)} returned {type(result).__name__} "
            f"({_preview(result)}); it must return a dict of metric name -> value, "
            "e.g. {'accuracy': 0.93}."
        )
    return normalize_metrics(result, what=f"validate_fn {_name(validate_fn)}'s result")


def _payloads(job: ClaimedJob, trust: PayloadTrust) -> tuple[Any, dict[str, Any]]:
    """The job's validate_fn and validate_config, each verified for this very job (a
    payload copied from another job's row never verifies, nor a reference the reporter
    did not sign) before anything is unpickled or imported."""
    return load_job_payloads(
        job.validate_fn_ref,
        job.validate_fn_pickle,
        job.validate_config,
        trust=trust,
        bound_to=job_binding(
            job.namespace,
            job.run,
            job.report_index,
            job.uri,
            validator=job.validator,
            job_key=job.idempotency_key,
        ),
        job_id=job.job_id,
    )


def storable_text(text: str) -> str:
    """``text`` as every registry stores it: lone surrogates and NUL characters (which
    neither SQLite's UTF-8 nor PostgreSQL's text takes) shown as escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


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
