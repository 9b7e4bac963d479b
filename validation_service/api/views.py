"""What the CLI, the HTTP API and the dashboard share: records as JSON (one view of each
record, the API's documented field names), and waking the running service."""

from __future__ import annotations

import datetime as dt
import logging
from typing import TYPE_CHECKING, Any

from validation_service.jobs import JobStatus
from validation_service.secrets import mask_url, mask_value

if TYPE_CHECKING:
    from validation_service.config import Settings
    from validation_service.registry import records
    from validation_service.stopping import StopPolicy

logger = logging.getLogger(__name__)


def tell_service(settings: Settings, what: str, *, connect: bool = False) -> str | None:
    """Wakes the running scheduler: a requeued job starts now, a cancelled one stops now.

    ``what`` is "nudge" or "check_leases". Best effort: the scheduler also polls the queue
    and heartbeats its leases. Without Ray in this process nothing happens, unless
    ``connect`` and a cluster address is configured (CKVAL_RAY_ADDRESS): a command line
    may connect (to a cluster that answers within seconds; it never starts one), an HTTP
    request never starts Ray. Returns why the service could not be told, else None.
    """
    import ray

    if not ray.is_initialized() and not (connect and settings.ray_address):
        return None
    from validation_service.service import ValidationService

    try:
        if not ray.is_initialized():
            from validation_service._ray_cluster import connect_existing_ray

            connect_existing_ray(settings)  # RayClusterNotFound, at once, if none answers
        handle = ValidationService.get(settings)
        if handle is None:
            return f"no service {settings.service_name!r} runs on the Ray cluster"
        getattr(handle, what)()
    except Exception as exc:  # noqa: BLE001 - the registry change is what counts
        logger.info("could not reach the ckval service (%s)", what, exc_info=True)
        return f"{type(exc).__name__}: {exc}"
    return None


def iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _pick(record: Any, fields: str, **renamed: str) -> dict[str, Any]:
    """The named fields of a record (``renamed``: JSON key -> field), times in ISO 8601."""
    picked = {}
    for key in fields.split():
        value = getattr(record, renamed.get(key, key))
        picked[key] = iso(value) if isinstance(value, dt.datetime) else value
    return picked


def run_record_json(run: records.RunRecord) -> dict[str, Any]:
    return {
        **_pick(run, "id name namespace status created_at"),
        # A tag recorded by an older ckval may hold a tracker's credentials: never served.
        "storage_root": mask_url(run.storage_root),
        "tags": mask_value(run.tags),
    }


def run_json(summary: records.RunSummary) -> dict[str, Any]:
    counts = summary.job_counts
    return {
        **run_record_json(summary.run),
        "checkpoints": summary.checkpoints,
        "jobs": {status.value: counts.get(status.value, 0) for status in JobStatus},
        "stop_decision": stop_decision_json(summary.stop),
        "cost": cost_json(summary.cost),
    }


def cost_json(cost: records.ValidationCost) -> dict[str, Any]:
    """What validations held: accelerator-seconds (accelerators x running time of every
    attempt, retries included) in all, by validator, by pool and by accelerator type."""
    return {
        "accelerator_seconds": cost.accelerator_s,
        "accelerator_hours": cost.accelerator_s / 3600.0,
        "running_seconds": cost.running_s,
        "by_validator": cost.by("validator"),
        "by_pool": cost.by("pool"),
        "by_accelerator_type": cost.by("accelerator_type"),
    }


def stop_policy_json(policy: StopPolicy | None) -> dict[str, Any] | None:
    """A StopPolicy's fields, and the one line that describes it."""
    if policy is None:
        return None
    return {**policy.to_dict(), "description": policy.describe()}


def stop_decision_json(decision: records.StopDecision | None) -> dict[str, Any] | None:
    """A stop decision: the rule, the checkpoint and values that decided, the policy of
    the moment, the checkpoints passed over, and the override (``stopped`` false)."""
    if decision is None:
        return None
    return {
        **_pick(
            decision,
            "run attempt round rule reason report_index reference decided_at overridden_at "
            "resumed_after_index stopped",
        ),
        "values": [{"report_index": i, "value": value} for i, value in decision.values],
        "skipped": [{"report_index": i, "why": why} for i, why in decision.skipped],
        "policy": stop_policy_json(decision.policy),
    }


def checkpoint_json(record: records.CheckpointRecord) -> dict[str, Any]:
    """The checkpoint; with ``evaluations`` (validator -> metrics) where they were read."""
    found = _pick(
        record,
        "id run report_index step epoch uri size_bytes manifest_sha256 validation_status "
        "metrics reported_metrics validated_metrics created_at",
    )
    if record.evaluations:
        found["evaluations"] = record.evaluations
    return found


def labelled_checkpoint_json(record: records.CheckpointRecord) -> dict[str, Any]:
    """``checkpoint_json`` with the checkpoint's aliases and tags, and when it was deleted:
    the registry commands, the registry routes and the dashboard show these."""
    return {
        **checkpoint_json(record),
        "aliases": list(record.aliases),
        "tags": record.tags,
        "deleted_at": iso(record.deleted_at),
    }


def attempt_json(attempt: records.AttemptRecord) -> dict[str, Any]:
    return _pick(
        attempt,
        "attempt status lease_owner node_id worker_pid claimed_at started_at finished_at error log "
        "accelerator_type accelerators running_s accelerator_seconds",
        error="error_message",
        accelerator_seconds="accelerator_s",
    )


def job_json(job: records.JobRecord) -> dict[str, Any]:
    return {
        **_pick(
            job,
            "id run checkpoint_id report_index validator status attempt_count max_attempts "
            "priority pool "
            "resources executor_kind validate_fn_name timeout_s not_before lease_owner "
            "lease_expires_at result_metrics error_type error_message error_traceback "
            "created_at started_at finished_at waiting_since waiting_for",
            attempt_count="attempts",
        ),
        "attempts": [attempt_json(attempt) for attempt in job.attempt_history],
        "warnings": list(job.warnings),
    }
