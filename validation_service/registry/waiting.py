"""Waiting for validations: a run's (Registry.wait) or a set of jobs' (revalidate --wait)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Sequence

from sqlalchemy import func, select

from validation_service.errors import (
    ValidationsFailed,
    ValidationsFailedWarning,
    failed_validations_message,
)
from validation_service.jobs import ACTIVE_JOB_STATUSES, JobStatus
from validation_service.progress import ProgressRenderer
from validation_service.registry import queue
from validation_service.registry.limits import IDS_PER_IN_LIST
from validation_service.registry.models import ValidationJob
from validation_service.registry.records import JobRecord

# What wait() reports as failed validations (a CANCELLED job was stopped on purpose).
FAILED_STATUSES = (JobStatus.FAILED, JobStatus.TIMED_OUT)


def wait_for_run(registry, run: str, timeout_s, poll_s, progress, raise_on_failure) -> None:
    """Registry.wait: until no job of the run is QUEUED or RUNNING."""
    with registry.db.read() as session:
        run_id = registry.catalog.require_run_id(session, run)

    def counts() -> dict[str, int]:
        with registry.db.read() as session:
            return queue.job_counts(session, run_id)

    found = _poll(counts, run, f"validation(s) of run {run!r}", timeout_s, poll_s, progress)
    if any(found.get(s.value, 0) for s in FAILED_STATUSES):
        _report_failures(run, registry.validations(run), found, raise_on_failure)


def wait_for_jobs(registry, job_ids: Sequence[int], label: str, timeout_s, poll_s, progress):
    """Until none of ``job_ids`` is QUEUED or RUNNING; returns their counts by status."""
    ids = list(job_ids)

    def counts() -> dict[str, int]:
        found: dict[str, int] = {}
        with registry.db.read() as session:
            for start in range(0, len(ids), IDS_PER_IN_LIST):
                query = (
                    select(ValidationJob.status, func.count(ValidationJob.id))
                    .where(ValidationJob.id.in_(ids[start : start + IDS_PER_IN_LIST]))
                    .group_by(ValidationJob.status)
                )
                for status, count in session.execute(query):
                    found[status] = found.get(status, 0) + count
        return found

    return _poll(counts, label, f"validation(s) of {label}", timeout_s, poll_s, progress)


def _poll(counts: Callable[[], dict[str, int]], label, what, timeout_s, poll_s, progress):
    deadline = time.monotonic() + timeout_s
    renderer = ProgressRenderer() if progress is True else progress or None
    try:
        while True:
            found = counts()
            if renderer is not None:
                renderer.update(label, found)
            active = sum(found.get(s.value, 0) for s in ACTIVE_JOB_STATUSES)
            if not active:
                return found
            if time.monotonic() >= deadline:
                waiting = found.get(JobStatus.WAITING_FOR_RESOURCES.value, 0)
                why = (
                    f"{waiting} of them WAITING_FOR_RESOURCES: their Ray task waits for a "
                    "node or GPUs (`ckval jobs` says what for, `ray status` what is pending)"
                    if waiting
                    else "Is the service running? (`ckval status`)"
                )
                raise TimeoutError(
                    f"{active} {what} still QUEUED or RUNNING after {timeout_s:g}s. {why}"
                )
            time.sleep(poll_s)
    finally:
        if renderer is not None:
            renderer.close()


def _report_failures(run, jobs: Iterable[JobRecord], counts, raise_on_failure) -> None:
    failed = failed_jobs(jobs)
    if raise_on_failure:
        raise ValidationsFailed(run, failed, sum(counts.values()))
    warnings.warn(
        ValidationsFailedWarning(failed_validations_message(run, failed, sum(counts.values()))),
        stacklevel=4,
    )


def failed_jobs(jobs: Iterable[JobRecord]) -> dict[int, str]:
    """Job id -> "STATUS: error" for the jobs that ended FAILED or TIMED_OUT."""
    failed = {}
    for job in jobs:
        if job.status in {s.value for s in FAILED_STATUSES}:
            error = f"{job.error_type or 'error'}: {job.error_message or 'no message'}"
            first_line = error.strip().splitlines()[0]
            reason = f"report {job.report_index}, {job.status}, {first_line}"
            failed[job.id] = reason if len(reason) <= 160 else reason[:157] + "..."
    return failed
