"""ValidationRequest: what a report asked of its validation, from any front door to the queue."""

from __future__ import annotations

import dataclasses
from typing import Any

from validation_service.jobs import DEFAULT_VALIDATOR
from validation_service.validation import check_request


@dataclasses.dataclass(frozen=True)
class ValidationRequest:
    """What report() (or Client.report, the Keras callback, the Dask handler) asked of a
    validation, checked and ready to store: the job row is made from it at registration.

    ``validate_fn_ref`` is an importable ``"package.module:function"`` and
    ``validate_fn_pickle`` a cloudpickled callable (one of the two); ``validate_config`` is
    cloudpickled. The reporter signs both pickles before they are stored
    (``trainer_integration._request.signed_request``, ``validation_service.signing``):
    an attempt unpickles only what verifies. ``pool`` is the concurrency pool the job
    counts against.

    Made only with values the registry can store: the fields a report() argument sets
    (priority, timeout_s, max_attempts, resources, coalesce) are checked here, so every
    front door refuses a bad one with InvalidInput before anything is copied.
    """

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
    # The evaluation the job belongs to ("default": report()'s); revalidate() names its
    # own and queues them as background jobs, claimed after the live runs' jobs.
    validator: str = DEFAULT_VALIDATOR
    background: bool = False

    def __post_init__(self) -> None:
        check_request(self)
