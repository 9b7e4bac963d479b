"""What one re-validation may cost when the HTTP API asks for it: a token holder may queue
only bounded work (SECURITY.md, "Cost of one request").

``Registry.revalidate`` and ``ckval revalidate`` are the database's users and are not
capped; ``POST /runs/{run}/revalidate`` passes ``RevalidationCaps.for_http(settings)``
to ``evaluations.revalidate``, which applies them in its write transaction, before
anything is queued.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from validation_service.errors import InvalidInput
from validation_service.jobs import ACTIVE_JOB_STATUSES
from validation_service.registry.models import Run, ValidationJob
from validation_service.request import ValidationRequest

_jobs = ValidationJob.__table__

# Jobs one request may queue.
HTTP_MAX_JOBS = 1_000
# A job's stored validate_config (a command's argv, env and timeout_s included), pickled:
# every job of the request stores its own copy.
HTTP_MAX_CONFIG_BYTES = 16 * 1024


@dataclasses.dataclass(frozen=True)
class RevalidationCaps:
    """The bounds of one re-validation: jobs it queues (``max_jobs``), evaluations over
    history QUEUED or RUNNING in the namespace once it is queued (``max_queued``), jobs
    of one validator per checkpoint in all, forced or after failures
    (``jobs_per_evaluation``), and the bytes of the stored validate_config
    (``max_config_bytes``)."""

    max_jobs: int
    max_queued: int
    jobs_per_evaluation: int
    max_config_bytes: int

    @classmethod
    def for_http(cls, settings: Any) -> RevalidationCaps:
        """The HTTP API's caps: a job of one validator gets as many fresh starts per
        checkpoint as a job gets retries through the API (CKVAL_MAX_MANUAL_RETRIES)."""
        return cls(
            max_jobs=HTTP_MAX_JOBS,
            max_queued=settings.max_queued_evaluations,
            jobs_per_evaluation=1 + settings.max_manual_retries,
            max_config_bytes=HTTP_MAX_CONFIG_BYTES,
        )

    def check_request(self, request: ValidationRequest) -> None:
        """InvalidInput when the request's stored validate_config is over the cap."""
        size = len(request.validate_config or b"")
        if size > self.max_config_bytes:
            raise InvalidInput(
                f"validate_config (a command's argv and env included) is {size} bytes as "
                f"stored, over the {self.max_config_bytes} bytes the HTTP API stores per "
                "job: pass paths or names instead of data. Nothing was queued."
            )

    def spent_ids(self, conn: Connection, validator: str, todo: Sequence[Any]) -> set[int]:
        """The checkpoint ids among ``todo`` (evaluations.Target) whose jobs of
        ``validator`` have used up ``jobs_per_evaluation``."""
        ids = [target.checkpoint_id for target in todo]
        if not ids:
            return set()
        counted = (
            select(_jobs.c.checkpoint_id)
            .where(_jobs.c.validator == validator, _jobs.c.checkpoint_id.in_(ids))
            .group_by(_jobs.c.checkpoint_id)
            .having(func.count(_jobs.c.id) >= self.jobs_per_evaluation)
        )
        return set(conn.execute(counted).scalars())

    def check_room(self, conn: Connection, namespace: str, adding: int) -> None:
        """InvalidInput when ``adding`` jobs are more than one request queues, or more
        than the namespace's queue of evaluations over history has room for."""
        if adding > self.max_jobs:
            raise InvalidInput(
                f"this re-validation would queue {adding} jobs; the HTTP API queues at most "
                f"{self.max_jobs} per request: ask for fewer checkpoints (reports=[...]) "
                "or use `ckval revalidate`. Nothing was queued."
            )
        active = sorted(status.value for status in ACTIVE_JOB_STATUSES)
        queued = conn.execute(
            select(func.count(_jobs.c.id))
            .join(Run, Run.id == _jobs.c.run_id)
            .where(Run.namespace == namespace, _jobs.c.background, _jobs.c.status.in_(active))
        ).scalar_one()
        if queued + adding > self.max_queued:
            raise InvalidInput(
                f"namespace {namespace!r} has {queued} evaluations over history queued or "
                f"running, and this request would add {adding}: the HTTP API keeps at most "
                f"{self.max_queued} (CKVAL_MAX_QUEUED_EVALUATIONS). Wait for them, cancel "
                "some, or use `ckval revalidate`. Nothing was queued."
            )
