"""Plain, typed records the Registry returns (no ORM objects leave the registry)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any


@dataclasses.dataclass(frozen=True)
class RunRecord:
    id: int
    name: str
    namespace: str
    storage_root: str
    created_at: dt.datetime
    status: str
    tags: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
    id: int
    run: str
    report_index: int
    step: int | None
    epoch: int | None
    uri: str
    size_bytes: int
    manifest_sha256: str | None
    created_at: dt.datetime
    reported_metrics: dict[str, Any]
    validated_metrics: dict[str, Any] | None
    metrics: dict[str, Any]
    validation_status: str
    deleted_at: dt.datetime | None

    def to_ray_checkpoint(self, storage_options: dict[str, Any] | None = None):
        from validation_service.storage import ray_checkpoint

        return ray_checkpoint(self.uri, storage_options)


@dataclasses.dataclass(frozen=True)
class AttemptRecord:
    attempt: int
    lease_token: int
    lease_owner: str
    status: str
    claimed_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    node_id: str | None
    worker_pid: int | None
    error_message: str | None


@dataclasses.dataclass(frozen=True)
class JobRecord:
    id: int
    run: str
    checkpoint_id: int
    report_index: int
    status: str
    attempts: int
    max_attempts: int
    priority: int
    pool: str
    resources: dict[str, Any]
    executor_kind: str
    validate_fn_name: str
    not_before: dt.datetime
    lease_owner: str | None
    lease_token: int
    lease_expires_at: dt.datetime | None
    timeout_s: float | None
    error_type: str | None
    error_message: str | None
    error_traceback: str | None
    result_metrics: dict[str, Any] | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    attempt_history: tuple[AttemptRecord, ...] = ()


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What report() asks of a validation; stored on the job row at registration."""

    executor_kind: str
    pool: str
    validate_fn_name: str
    validate_fn_ref: str | None = None
    validate_fn_pickle: bytes | None = None
    validate_config: bytes | None = None
    resources: dict[str, Any] = dataclasses.field(default_factory=dict)
    priority: int = 0
    timeout_s: float | None = None
    max_attempts: int = 3
    retry_on_timeout: bool = False
    # "latest": registering this job cancels the run's older QUEUED jobs.
    coalesce: str | None = None


@dataclasses.dataclass(frozen=True)
class Registration:
    run_id: int
    checkpoint_id: int
    job_id: int | None
    created: bool  # False when the same run + report index was registered before


@dataclasses.dataclass(frozen=True)
class ClaimedJob:
    """Everything an executor needs to run one attempt, and the token that fences it."""

    job_id: int
    lease_token: int
    attempt: int
    max_attempts: int
    run: str
    namespace: str
    checkpoint_id: int
    report_index: int
    uri: str
    storage_root: str
    manifest_sha256: str | None
    reported_metrics: dict[str, Any]
    validate_fn_ref: str | None
    validate_fn_pickle: bytes | None
    validate_config: bytes | None
    executor_kind: str
    resources: dict[str, Any]
    pool: str
    timeout_s: float | None
    lease_expires_at: dt.datetime


@dataclasses.dataclass(frozen=True)
class JobOutcome:
    """What one attempt produced, as the executor reports it."""

    succeeded: bool
    metrics: dict[str, Any] | None = None
    error_type: str | None = None
    error_message: str | None = None
    error_traceback: str | None = None
    retryable: bool = True
    timed_out: bool = False
    node_id: str | None = None
    worker_pid: int | None = None
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
