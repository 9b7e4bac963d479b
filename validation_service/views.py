"""What the CLI and the HTTP API share: records as JSON, and waking the running service."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from validation_service.config import Settings
from validation_service.jobs import JobStatus
from validation_service.registry.records import (
    AttemptRecord,
    CheckpointRecord,
    JobRecord,
    RunSummary,
)

logger = logging.getLogger(__name__)


def tell_service(settings: Settings, what: str, *, connect: bool = False) -> None:
    """Wakes the running scheduler: a requeued job starts now, a cancelled one stops now.

    ``what`` is "nudge" or "check_leases". Best effort: the scheduler also polls the queue
    and heartbeats its leases. Without Ray in this process nothing happens, unless
    ``connect`` and a cluster address is configured (CKVAL_RAY_ADDRESS): a command line
    may connect, an HTTP request never starts Ray.
    """
    import ray

    if not ray.is_initialized() and not (connect and settings.ray_address):
        return
    from validation_service.service import ValidationService

    try:
        handle = ValidationService.get(settings)
        if handle is not None:
            getattr(handle, what)()
    except Exception:  # noqa: BLE001 - the registry change is what counts
        logger.warning("could not reach the ckval service (%s)", what, exc_info=True)


def iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def run_json(summary: RunSummary) -> dict[str, Any]:
    run, counts = summary.run, summary.job_counts
    return {
        "id": run.id,
        "name": run.name,
        "namespace": run.namespace,
        "status": run.status,
        "created_at": iso(run.created_at),
        "storage_root": run.storage_root,
        "tags": run.tags,
        "checkpoints": summary.checkpoints,
        "jobs": {status.value: counts.get(status.value, 0) for status in JobStatus},
    }


def checkpoint_json(record: CheckpointRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "run": record.run,
        "report_index": record.report_index,
        "step": record.step,
        "epoch": record.epoch,
        "uri": record.uri,
        "size_bytes": record.size_bytes,
        "manifest_sha256": record.manifest_sha256,
        "validation_status": record.validation_status,
        "metrics": record.metrics,
        "reported_metrics": record.reported_metrics,
        "validated_metrics": record.validated_metrics,
        "created_at": iso(record.created_at),
    }


def attempt_json(attempt: AttemptRecord) -> dict[str, Any]:
    return {
        "attempt": attempt.attempt,
        "status": attempt.status,
        "lease_owner": attempt.lease_owner,
        "node_id": attempt.node_id,
        "worker_pid": attempt.worker_pid,
        "claimed_at": iso(attempt.claimed_at),
        "started_at": iso(attempt.started_at),
        "finished_at": iso(attempt.finished_at),
        "error": attempt.error_message,
    }


def job_json(job: JobRecord) -> dict[str, Any]:
    return {
        "id": job.id,
        "run": job.run,
        "checkpoint_id": job.checkpoint_id,
        "report_index": job.report_index,
        "status": job.status,
        "attempt_count": job.attempts,
        "max_attempts": job.max_attempts,
        "priority": job.priority,
        "pool": job.pool,
        "resources": job.resources,
        "executor_kind": job.executor_kind,
        "validate_fn_name": job.validate_fn_name,
        "timeout_s": job.timeout_s,
        "not_before": iso(job.not_before),
        "lease_owner": job.lease_owner,
        "lease_expires_at": iso(job.lease_expires_at),
        "result_metrics": job.result_metrics,
        "error_type": job.error_type,
        "error_message": job.error_message,
        "error_traceback": job.error_traceback,
        "created_at": iso(job.created_at),
        "started_at": iso(job.started_at),
        "finished_at": iso(job.finished_at),
        "attempts": [attempt_json(attempt) for attempt in job.attempt_history],
    }
