"""Retry policy: after a failed attempt or a lost lease, run again at T or end with status S;
and which database errors are outages worth retrying.

Above the store: the scheduler (or the registry's JobQueue, for callers that bring none)
asks the policy and the queue records the answer. AttemptBudget is the one place that
counts a job's attempts (left, and what a user retry gives). Neither the database nor
Ray is needed here.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from validation_service.jobs import JobStatus


@dataclasses.dataclass(frozen=True)
class Decision:
    """QUEUED with the time the job is due again, or the terminal status it ends in."""

    status: JobStatus
    not_before: dt.datetime | None = None

    @property
    def requeue(self) -> bool:
        return self.status is JobStatus.QUEUED


@dataclasses.dataclass(frozen=True)
class AttemptBudget:
    """A job's attempt counters: made in all, made before the last user retry, allowed."""

    attempts: int
    attempts_before_retry: int
    max_attempts: int

    @classmethod
    def of(cls, job) -> AttemptBudget:
        """The budget of a job row or record (attempts, attempts_before_retry, max_attempts)."""
        return cls(job.attempts, job.attempts_before_retry, job.max_attempts)

    @property
    def left(self) -> int:
        return self.max_attempts - (self.attempts - self.attempts_before_retry)

    def retries_spent(self, max_retries: int | None) -> bool:
        """Whether the job made max_attempts x (1 + max_retries) attempts in all: a user
        retry limited to ``max_retries`` gives it no more (None: no limit)."""
        return max_retries is not None and self.attempts >= self.max_attempts * (1 + max_retries)


def counted_from_after_retry(
    attempts: Any, max_attempts: Any, max_retries: int | None, least: Callable = min
) -> Any:
    """The attempts_before_retry of a fresh budget: a full one from the attempts made,
    cut with ``max_retries`` to what is left of max_attempts x (1 + max_retries).

    On numbers, or on a job's columns with ``least`` the database's minimum (a user
    retry moves many jobs in one statement).
    """
    if max_retries is None:
        return attempts
    return least(attempts, max_attempts * max_retries)


class RetryPolicy:
    """Exponential backoff with jitter, while the job's attempt budget lasts."""

    def __init__(
        self,
        backoff_s: float = 1.0,
        backoff_max_s: float = 300.0,
        jitter: Callable[[], float] | None = None,
    ):
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        # Full jitter in the upper half: retries of one burst of failures spread out.
        self._jitter = jitter or (lambda: random.uniform(0.5, 1.0))

    @classmethod
    def from_settings(cls, settings) -> RetryPolicy:
        return cls(settings.retry_backoff_s, settings.retry_backoff_max_s)

    def after_failure(
        self,
        *,
        budget: AttemptBudget,
        retryable: bool,
        timed_out: bool,
        retry_on_timeout: bool,
        now: dt.datetime,
    ) -> Decision:
        """A failed (or timed-out) attempt: retry after a backoff, or FAILED / TIMED_OUT."""
        if (retry_on_timeout if timed_out else retryable) and budget.left > 0:
            delay = dt.timedelta(seconds=self.delay_s(budget.attempts))
            return Decision(JobStatus.QUEUED, now + delay)
        return Decision(JobStatus.TIMED_OUT if timed_out else JobStatus.FAILED)

    def after_lost_lease(self, *, budget: AttemptBudget, now: dt.datetime) -> Decision:
        """The service running an attempt was lost: run again at once, while attempts last."""
        if budget.left > 0:
            return Decision(JobStatus.QUEUED, now)
        return Decision(JobStatus.FAILED)

    def delay_s(self, attempts: int) -> float:
        base = self.backoff_s * 2 ** max(attempts - 1, 0)
        return min(base, self.backoff_max_s) * self._jitter()


# PostgreSQL SQLSTATEs of an outage. Rerun at once: connection exceptions (class 08), a
# serialization failure or deadlock (40001, 40P01: the transaction was rolled back), a
# server shutting down or starting (57P01-57P03), too many connections (53300).
_RERUN_SQLSTATE_CLASSES = ("08",)
_RERUN_SQLSTATES = frozenset({"40001", "40P01", "57P01", "57P02", "57P03", "53300"})
# Unusable as configured until someone acts, but no fault of the statement: a login
# refused (class 28, e.g. a password being rotated) or a missing database (3D000).
_UNREACHABLE_SQLSTATE_CLASSES = ("28", "3D")
# SQLite result codes of a file that another writer holds; its busy timeout has waited.
_SQLITE_LOCKED = frozenset({"SQLITE_BUSY", "SQLITE_LOCKED"})
# SQLite result codes of an outage: locked, or the file's storage failing.
_SQLITE_TRANSIENT = _SQLITE_LOCKED | {"SQLITE_IOERR"}


def is_transient_database_error(exc: BaseException) -> bool:
    """Whether a database error is an outage that a reconnect, a wait or a rerun may cure.

    True for lost and refused connections, a locked SQLite file, serialization failures
    and deadlocks. False for errors of the statement or its values (DataError,
    IntegrityError, ProgrammingError, a missing table): running it again gives the same
    answer, so retrying would only delay a clear error.
    """
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    state = _sqlstate(exc)
    if state is not None:
        return (
            state in _RERUN_SQLSTATES
            or state[:2] in _RERUN_SQLSTATE_CLASSES
            or state[:2] in _UNREACHABLE_SQLSTATE_CLASSES
        )
    if not isinstance(exc, (OperationalError, InterfaceError)):
        return False
    sqlite_error = _sqlite_error(exc)
    if sqlite_error is not None:
        return sqlite_error in _SQLITE_TRANSIENT
    # A driver error with no SQLSTATE: it failed to connect or lost the connection.
    return True


def should_rerun(exc: BaseException) -> bool:
    """Whether an idempotent operation should run again at once after this error.

    Yes for a lost connection (the pool reconnects), a serialization failure or a
    deadlock. No for a locked SQLite file (its busy timeout has waited already), a
    login refused, and any error of the statement itself.
    """
    if not is_transient_database_error(exc):
        return False
    assert isinstance(exc, DBAPIError)
    if exc.connection_invalidated:
        return True
    state = _sqlstate(exc)
    if state is not None:
        return state in _RERUN_SQLSTATES or state[:2] in _RERUN_SQLSTATE_CLASSES
    return _sqlite_error(exc) not in _SQLITE_LOCKED


def _sqlstate(exc: DBAPIError) -> str | None:
    """The SQLSTATE of a server error (psycopg: sqlstate, psycopg2: pgcode)."""
    state = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    return state if isinstance(state, str) else None


def _sqlite_error(exc: DBAPIError) -> str | None:
    """SQLite's primary result code (SQLITE_IOERR for SQLITE_IOERR_WRITE), if SQLite's."""
    name = getattr(exc.orig, "sqlite_errorname", None)
    if not isinstance(name, str):
        return None
    return "_".join(name.split("_", 2)[:2])
