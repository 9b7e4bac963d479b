"""The scheduler's queue operations: what is due, claims, leases, outcomes and lost
leases; and the operators' cancel and retry. Each opens its one transaction here and
runs the queue's statements (queue.py), the catalog's metric merge and the transitions
in it. ``JobQueue`` is what a service replica opens (composition.open_service_parts);
the users' ``Registry.job_queue`` is the same.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections.abc import Iterable
from typing import Any

from sqlalchemy.engine import Row
from sqlalchemy.exc import IntegrityError

from validation_service.errors import InvalidInput, RegistryRejected, RetryLimitReached
from validation_service.jobs import DEFAULT_VALIDATOR, JobStatus
from validation_service.metrics import normalize_metrics
from validation_service.registry import evaluations, job_warnings, queue, transitions
from validation_service.registry.catalog import Catalog
from validation_service.registry.database import Database, retry_on_disconnect
from validation_service.registry.housekeeping import Housekeeping, to_do_after
from validation_service.registry.models import utcnow
from validation_service.registry.records import ClaimedJob, JobOutcome, JobRecord
from validation_service.retry import AttemptBudget, RetryPolicy

logger = logging.getLogger(__name__)


class JobQueue:
    """Claims due jobs under leases and records what their attempts led to."""

    def __init__(
        self,
        db: Database,
        catalog: Catalog,
        housekeeping: Housekeeping,
        retry_policy: RetryPolicy,
    ):
        self.db = db
        self.catalog = catalog
        self.housekeeping = housekeeping
        # Decides what a failure leads to when the caller (the scheduler) brings no policy.
        self.retry_policy = retry_policy

    @retry_on_disconnect
    def due_pools(self, now: dt.datetime | None = None) -> list[str]:
        """Pools that have at least one QUEUED job whose not_before has passed."""
        with self.db.read() as session:
            return queue.due_pools(session, now or utcnow())

    @retry_on_disconnect
    def running_per_pool(self) -> dict[str, int]:
        """RUNNING jobs per pool, whoever holds them (replicas share the pools' caps)."""
        with self.db.read() as session:
            return queue.running_per_pool(session)

    @retry_on_disconnect
    def claim_due_jobs(
        self,
        owner: str,
        pool_limits: dict[str, int],
        *,
        lease_s: float,
        default_limit: int = 4,
        max_jobs: int = 64,
    ) -> list[ClaimedJob]:
        """Claims due QUEUED jobs, at most each pool's limit minus its RUNNING jobs.

        Each claimed job moves to RUNNING with a new fencing token and a lease of
        ``lease_s`` seconds; an attempt row is opened for it.
        """
        now = utcnow()
        expires = now + dt.timedelta(seconds=lease_s)
        claimed: list[ClaimedJob] = []
        with self.db.write() as conn:
            for pool in queue.due_pools(conn, now):
                # The cap is the cluster's: replicas claiming the same pool take turns.
                queue.lock_pool(conn, pool)
                running = queue.running_in_pool(conn, pool)
                limit = pool_limits.get(pool, default_limit)
                free = min(limit - running, max_jobs - len(claimed))
                if free <= 0:
                    continue
                background = queue.background_slots(limit, running)
                ids = queue.lock_due_job_ids(conn, pool, now, free, background)
                if ids:
                    rows = transitions.claim(conn, ids, owner=owner, expires=expires, now=now)
                    claimed.extend(queue.claimed_job(row, expires) for row in rows)
        return claimed

    @retry_on_disconnect
    def heartbeat(
        self, owner: str, leases: Iterable[tuple[int, int]], *, lease_s: float
    ) -> set[int]:
        """Extends the leases this owner still holds; returns the ids of those jobs.

        A job missing from the result was cancelled or taken over: its attempt must stop.
        """
        leases = list(leases)
        if not leases:
            return set()
        expires = utcnow() + dt.timedelta(seconds=lease_s)
        with self.db.write() as conn:
            return transitions.extend_leases(conn, owner, leases, expires)

    @retry_on_disconnect
    def wait_for_resources(
        self, owner: str, waits: Iterable[tuple[int, int, dict[str, Any]]]
    ) -> list[int]:
        """The (job id, lease token, what it waits for) attempts whose Ray task waits for
        resources become WAITING_FOR_RESOURCES; returns the ids that did."""
        waits = list(waits)
        if not waits:
            return []
        with self.db.write() as conn:
            return transitions.wait_for_resources(conn, owner, waits, utcnow())

    @retry_on_disconnect
    def start_running(self, owner: str, leases: Iterable[tuple[int, int]]) -> list[int]:
        """The (job id, lease token) attempts whose Ray task began to run after waiting
        for resources are RUNNING again; returns the ids that were."""
        leases = list(leases)
        if not leases:
            return []
        with self.db.write() as conn:
            return transitions.start_running(conn, owner, leases, utcnow())

    @retry_on_disconnect
    def record_usage(self, job_id: int, lease_token: int, usage: JobOutcome) -> bool:
        """What an attempt held (``usage``: its node, start, accelerator type and count),
        for an attempt the service stopped after its lease was lost (cancelled, taken
        over): its running time is counted up to now."""
        with self.db.write() as conn:
            return transitions.record_usage(conn, job_id, lease_token, usage, utcnow())

    @retry_on_disconnect
    def job_and_run_tags(
        self, job_id: int, run: str, namespace: str
    ) -> tuple[JobRecord, dict[str, Any]]:
        """A job's record and its run's tags (the sinks log its metrics with them)."""
        with self.db.read() as session:
            return queue.get_job(session, job_id), self.catalog.run_tags(session, run, namespace)

    @retry_on_disconnect
    def finish_job(
        self,
        job_id: int,
        lease_token: int,
        outcome: JobOutcome,
        *,
        policy: RetryPolicy | None = None,
    ) -> bool:
        """Records one attempt's outcome; only the current lease token may do so.

        Success merges the validated metrics into the checkpoint, then moves tracked
        aliases and applies retention (housekeeping). A failure goes where the retry
        policy says (``policy``, else this queue's): QUEUED again after a backoff, or
        FAILED / TIMED_OUT. Returns False, changing nothing, when the token is stale: a
        newer attempt owns the job.
        """
        metrics, outcome = _checked_metrics(outcome)
        try:
            finished = self._finish_job(job_id, lease_token, outcome, metrics, policy)
        except IntegrityError as exc:  # no unique key is written here: a rule of the database
            raise RegistryRejected(self.db.display_url, exc) from exc
        if finished is None:
            return False
        run_id, status, validator, todo = finished
        if validator != DEFAULT_VALIDATOR:
            return True  # a named evaluation over history: no run stops or moves for it
        if metrics is not None:
            # Merged metrics may stop the run, move tracked aliases and let retention delete.
            self.housekeeping.after_validation(run_id, todo)
        elif status in (JobStatus.FAILED, JobStatus.TIMED_OUT) and todo and todo.judged:
            # The checkpoints after this one waited for its outcome to be judged.
            self.housekeeping.judge_stop_policy(run_id)
        return True

    def _finish_job(
        self, job_id, lease_token, outcome, metrics, policy
    ) -> tuple[int, JobStatus, str, Row | None] | None:
        """The job's run id, new status and validator once its outcome is recorded, and
        what follows it (housekeeping.to_do_after); None for a stale token."""
        now = utcnow()
        with self.db.write() as conn:
            job = transitions.running_job(conn, job_id, lease_token)
            if job is None and metrics is not None:
                # A retry after a lost connection: the first try may have committed.
                done = transitions.succeeded_job(conn, job_id, lease_token)
                if done is not None:
                    todo = to_do_after(conn, done.run_id)
                    return done.run_id, JobStatus.SUCCEEDED, done.validator, todo
            if job is None:
                logger.warning(
                    "discarding the result of job %s with stale lease token %s",
                    job_id,
                    lease_token,
                )
                return None
            if metrics is not None:
                merged = None
                if job.validator == DEFAULT_VALIDATOR:
                    merged = self.catalog.merge_validated(conn, job, metrics)
                else:
                    evaluations.store_results(conn, job, metrics)
                status = JobStatus.SUCCEEDED
                transitions.finish(
                    conn,
                    job,
                    outcome,
                    status,
                    now,
                    result_metrics=metrics,
                    checkpoint_columns=merged,
                )
            else:
                decision = (policy or self.retry_policy).after_failure(
                    budget=AttemptBudget.of(job),
                    retryable=outcome.retryable,
                    timed_out=outcome.timed_out,
                    retry_on_timeout=job.retry_on_timeout,
                    now=now,
                )
                status = JobStatus(decision.status)
                transitions.finish(
                    conn, job, outcome, decision.status, now, not_before=decision.not_before
                )
            # What follows it (usually nothing), read here: no transaction of its own.
            todo = to_do_after(conn, job.run_id) if job.validator == DEFAULT_VALIDATOR else None
        return job.run_id, status, job.validator, todo

    @retry_on_disconnect
    def add_warnings(self, job_id: int, messages: list[str]) -> bool:
        """Stores warnings with a job (a sink that logged elsewhere than the run recorded);
        one already stored is not added again. False when there is no such job."""
        with self.db.write() as conn:
            return job_warnings.add_warnings(conn, job_id, messages)

    # ------------------------------------------------------- operators' commands
    def cancel(self, job_ids: list[int] | None, run: str | None, reason: str) -> list[int]:
        """Cancels the QUEUED and RUNNING jobs among ``job_ids`` (or of the run's latest
        attempt); a RUNNING one loses its lease at once. Returns the ids cancelled. The
        runs' stop policies are judged again afterwards: their later results wait no more
        for the cancelled ones."""
        with self.db.write() as conn:
            run_id = None if run is None else self.catalog.require_run_id(conn, run)
            jobs = queue.select_jobs(conn, transitions.FROM_STATES["cancel"], job_ids, run_id)
            cancelled = transitions.cancel(
                conn,
                jobs,
                error_type="Cancelled",
                message=reason or "cancelled by the user",
                now=utcnow(),
            )
        self._judge_stop_policies({job.run_id for job in jobs if job.id in cancelled})
        return cancelled

    def retry(
        self,
        job_ids: list[int] | None,
        run: str | None,
        statuses: list[JobStatus],
        max_retries: int | None,
    ) -> list[int]:
        """Requeues the jobs in ``statuses`` among ``job_ids`` (or of the run's latest
        attempt) with a fresh attempt budget, within ``max_retries`` (see
        Registry.retry_jobs)."""
        with self.db.write() as conn:
            run_id = None if run is None else self.catalog.require_run_id(conn, run)
            jobs = queue.select_jobs(conn, statuses, job_ids, run_id)
            if max_retries is not None:
                spent = [j.id for j in jobs if AttemptBudget.of(j).retries_spent(max_retries)]
                if spent and (job_ids is not None or len(spent) == len(jobs)):
                    raise RetryLimitReached(spent, max_retries)
                jobs = [job for job in jobs if job.id not in spent]
            return transitions.retry(conn, jobs, utcnow(), max_retries=max_retries)

    @retry_on_disconnect
    def requeue_expired(
        self, now: dt.datetime | None = None, *, policy: RetryPolicy | None = None
    ) -> list[int]:
        """RUNNING jobs whose lease ran out go back to QUEUED (or FAILED when out of attempts)."""
        now = now or utcnow()
        ended: set[int] = set()
        with self.db.write() as conn:
            jobs = queue.expired(conn, now)
            requeued = self._lost_leases(conn, jobs, policy, now, "expired at {expires}", ended)
        self._judge_stop_policies(ended)
        return requeued

    @retry_on_disconnect
    def release_leases(
        self, owner_prefix: str, *, keep_owner: str, policy: RetryPolicy | None = None
    ) -> list[int]:
        """Requeues RUNNING jobs leased by earlier incarnations of a restarted service.

        Owners are named ``<service name>/<incarnation>``: a restarted service knows
        its predecessor is dead, so its jobs need not wait for their leases to run out.
        """
        now = utcnow()
        ended: set[int] = set()
        with self.db.write() as conn:
            jobs = queue.leased_by_others(conn, owner_prefix, keep_owner)
            what = "released by its restarted service"
            requeued = self._lost_leases(conn, jobs, policy, now, what, ended)
        self._judge_stop_policies(ended)
        return requeued

    @retry_on_disconnect
    def release_unlaunched(
        self, owner: str, launched: Iterable[int], *, policy: RetryPolicy | None = None
    ) -> list[int]:
        """Requeues RUNNING jobs leased by ``owner`` that it is not running: a claim that
        committed while its answer was lost (the connection dropped at COMMIT), so the
        scheduler never launched them. Called from the owner's own loop, between claims."""
        launched = set(launched)
        # A read first: as a rule there is nothing to release.
        with self.db.read() as session:
            if not queue.leased_by(session, owner, exclude=launched):
                return []
        now = utcnow()
        ended: set[int] = set()
        with self.db.write() as conn:
            jobs = queue.leased_by(conn, owner, exclude=launched)
            what = "claimed, but its claim's answer was lost"
            requeued = self._lost_leases(conn, jobs, policy, now, what, ended)
        self._judge_stop_policies(ended)
        return requeued

    def _judge_stop_policies(self, run_ids: set[int]) -> None:
        """Runs whose validation ended FAILED on a lost lease: their later results no
        longer wait for it."""
        for run_id in sorted(run_ids):
            self.housekeeping.judge_stop_policy(run_id)

    def _lost_leases(
        self, conn, jobs, policy: RetryPolicy | None, now, what: str, ended: set[int]
    ) -> list[int]:
        """Requeues or ends each job; adds the run ids of those that ended to ``ended``."""
        requeued = []
        for job in jobs:
            message = (
                f"lease held by {job.lease_owner} "
                f"{what.format(expires=job.lease_expires_at)}; "
                "the service or node running it was lost"
            )
            decision = (policy or self.retry_policy).after_lost_lease(
                budget=AttemptBudget.of(job),
                now=min(now, utcnow()),  # a scan "as of" a later time still requeues for now
            )
            status, not_before = decision.status, decision.not_before
            if transitions.expire(conn, job, status, message, now, not_before=not_before):
                if decision.requeue:
                    requeued.append(job.id)
                else:
                    ended.add(job.run_id)
        return requeued


def _checked_metrics(outcome: JobOutcome) -> tuple[dict[str, Any] | None, JobOutcome]:
    """A success's metrics, normalized; metrics that cannot be stored fail the attempt."""
    if not outcome.succeeded:
        return None, outcome
    try:
        return normalize_metrics(outcome.metrics, what="validate_fn's return value"), outcome
    except InvalidInput as exc:
        failed = dataclasses.replace(
            outcome,
            succeeded=False,
            metrics=None,
            error_type="InvalidInput",
            error_message=str(exc),
            error_traceback=None,
            retryable=False,
            timed_out=False,
        )
        return None, failed
