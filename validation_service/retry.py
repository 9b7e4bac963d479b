"""Retry policy: after a failed attempt or a lost lease, run again at T or end with status S.

Above the store: the scheduler (or the Registry, for callers that bring none) asks the
policy and the queue records the answer. Neither the database nor Ray is needed here.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
from collections.abc import Callable

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

    @property
    def left(self) -> int:
        return self.max_attempts - (self.attempts - self.attempts_before_retry)


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
