"""The Registry's calls about validation jobs: a run's validations and waiting for them,
the queue's listings and counts, and the operators' cancel and retry. ``RegistryJobs`` is
a base of ``Registry`` (registry.py), which gives it its database, catalog, namespace and
job queue; each call opens its one transaction (cancel and retry: the job queue's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from validation_service import validation
from validation_service.errors import InvalidInput
from validation_service.jobs import JobStatus
from validation_service.progress import ProgressRenderer
from validation_service.registry import costs, queue, transitions, waiting
from validation_service.registry.catalog import Catalog
from validation_service.registry.database import Database, retry_on_disconnect
from validation_service.registry.jobs import JobQueue
from validation_service.registry.records import JobRecord, ValidationCost

RETRYABLE_STATUSES = (JobStatus.FAILED, JobStatus.TIMED_OUT, JobStatus.CANCELLED)


class RegistryJobs:
    """Validation jobs, as users and operators see them (see Registry)."""

    db: Database
    catalog: Catalog
    namespace: str
    job_queue: JobQueue

    @retry_on_disconnect
    def validations(self, run: str) -> list[JobRecord]:
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
            return queue.validations(session, run_id, run)

    @retry_on_disconnect
    def list_jobs(
        self,
        run: str | None = None,
        *,
        statuses: Iterable[JobStatus | str] | None = None,
        pool: str | None = None,
        limit: int | None = None,
    ) -> list[JobRecord]:
        """Validation jobs of the whole queue (of this namespace), or of one run.

        ``statuses`` and ``pool`` filter; ``limit`` keeps the newest jobs. In id order.
        """
        wanted = None if statuses is None else [validation.job_status(s).value for s in statuses]
        if limit is not None and limit < 1:
            raise InvalidInput(f"limit must be at least 1, got {limit}")
        with self.db.read() as session:
            run_id = None if run is None else self.catalog.require_run_id(session, run)
            return queue.list_jobs(
                session, self.namespace, run_id=run_id, statuses=wanted, pool=pool, limit=limit
            )

    @retry_on_disconnect
    def validation_costs(self, run: str) -> dict[int, ValidationCost]:
        """Report index -> what the validations of that checkpoint of the run's latest
        attempt held (accelerator-seconds by validator, pool and accelerator type); a
        checkpoint none of whose attempts was seen running is left out."""
        with self.db.read() as session:
            run_id = self.catalog.require_run_id(session, run)
            return costs.cost_by_checkpoint(session, run_id)

    @retry_on_disconnect
    def get_job(self, job_id: int, *, namespace: str | None = None) -> JobRecord:
        """The job with this id; with ``namespace``, a job of another namespace is
        JobNotFound too (the HTTP API passes its own)."""
        job_id = validation.check_job_id(job_id)
        with self.db.read() as session:
            return queue.get_job(session, job_id, namespace)

    @retry_on_disconnect
    def job_counts(self, run: str | None = None) -> dict[str, int]:
        with self.db.read() as session:
            run_id = None if run is None else self.catalog.require_run_id(session, run)
            return queue.job_counts(session, run_id)

    def wait(
        self,
        run: str,
        timeout_s: float = 300.0,
        poll_s: float = 0.05,
        *,
        progress: bool | ProgressRenderer = False,
        raise_on_failure: bool = False,
    ) -> None:
        """Returns when no job of the run is QUEUED or RUNNING; raises TimeoutError otherwise.

        ``progress=True`` shows a live line of the run's counts on standard error (or pass
        a ProgressRenderer). Validations that ended FAILED or TIMED_OUT are named in a
        ValidationsFailedWarning, or raised as ValidationsFailed with ``raise_on_failure``.
        """
        waiting.wait_for_run(self, run, timeout_s, poll_s, progress, raise_on_failure)

    def cancel_jobs(
        self, job_ids: Sequence[int] | None = None, *, run: str | None = None, reason: str = ""
    ) -> list[int]:
        """Cancels QUEUED and RUNNING jobs; a RUNNING one loses its lease at once."""
        if job_ids is None and run is None:
            raise InvalidInput("cancel needs job ids or a run name")
        return self.job_queue.cancel(validation.existing_job_ids(job_ids), run, reason)

    def retry_jobs(
        self,
        job_ids: Sequence[int] | None = None,
        *,
        run: str | None = None,
        statuses: Iterable[JobStatus] = RETRYABLE_STATUSES,
        max_retries: int | None = None,
    ) -> list[int]:
        """Requeues FAILED, TIMED_OUT and CANCELLED jobs (or only ``statuses`` of those)
        with a fresh attempt budget.

        With ``max_retries``, a job makes at most max_attempts x (1 + max_retries) attempts
        in all: one that made them is not retried, and the last budget is cut to what is
        left. A named job id that made them raises RetryLimitReached and nothing is
        retried; a run's such jobs are left as they are (RetryLimitReached when that is
        all of them).
        """
        if job_ids is None and run is None:
            raise InvalidInput("retry needs job ids or a run name")
        statuses = [JobStatus(s) for s in statuses]
        if not set(statuses) <= transitions.FROM_STATES["retry"]:
            raise InvalidInput(f"only {[s.value for s in RETRYABLE_STATUSES]} jobs are retried")
        return self.job_queue.retry(
            validation.existing_job_ids(job_ids), run, statuses, max_retries
        )
