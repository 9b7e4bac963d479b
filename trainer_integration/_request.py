"""Building and signing what one report asks for: every argument checked up front.

``ReportOptions`` is the one object that travels from every front door (report(),
Client.report(), the framework callbacks) to the reporter; ``prepare_report`` checks it
into plain metrics and a ``ValidationRequest`` before anything is copied or written;
``signed_request`` signs the request's pickles just before it is registered.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from trainer_integration._ray_validation import resolve_validation
from validation_service.errors import InvalidInput
from validation_service.metrics import normalize_metrics, to_plain
from validation_service.payloads import validation_request
from validation_service.request import ValidationRequest
from validation_service.validate_fn import takes_config_as_keywords
from validation_service.validation import check_checkpoint, check_step_and_epoch


class CheckpointUploadMode(enum.Enum):
    """How report() persists the checkpoint, as in ray.train.CheckpointUploadMode.

    SYNC: upload before report() returns. ASYNC: upload in the background; the
    validation is enqueued once the upload is complete. NO_UPLOAD: the checkpoint is
    already in ckval's storage (e.g. distributed checkpoint shards); register it there.
    """

    SYNC = "SYNC"
    ASYNC = "ASYNC"
    NO_UPLOAD = "NO_UPLOAD"


@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """report()'s keyword arguments, as every front door passes them on."""

    validate_fn: Callable[..., dict] | str | None = None
    validate_config: dict | None = None
    checkpoint_upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC
    validation_resources: dict | None = None
    priority: int = 0
    timeout_s: float | None = None
    max_attempts: int = 3
    retry_on_timeout: bool = False
    coalesce: str | None = None
    delete_local_checkpoint_after_upload: bool | None = None
    validation: Any = False  # Ray's form: True or a ray.train.ValidationTaskConfig

    def without_validation(self) -> ReportOptions:
        """These options with no validation asked for, in either form (a Ray Train rank's
        report without a checkpoint: it validates nothing, as Ray Train's own does not)."""
        return dataclasses.replace(
            self,
            validate_fn=None,
            validate_config=None,
            validation_resources=None,
            priority=0,
            timeout_s=None,
            max_attempts=3,
            retry_on_timeout=False,
            coalesce=None,
            validation=False,
        )

    @classmethod
    def of(cls, arguments: dict[str, Any]) -> ReportOptions:
        """The options among a front door's arguments (its ``locals()``)."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in arguments.items() if name in names})


@dataclasses.dataclass(frozen=True)
class PreparedReport:
    """One report, checked: what the reporter stores and registers."""

    metrics: dict[str, Any]
    job: ValidationRequest | None
    mode: CheckpointUploadMode
    delete_local: bool


def prepare_report(metrics, checkpoint, options: ReportOptions) -> PreparedReport:
    """Checks every report() argument before anything is stored.

    Returns the plain metrics and the one ValidationRequest (or None) that goes from
    the front door to the registry. Raises InvalidInput naming the bad argument.
    """
    if not isinstance(metrics, dict):
        raise InvalidInput(f"metrics must be a dict, got {type(metrics).__name__}")
    check_checkpoint(checkpoint)
    mode = upload_mode(options.checkpoint_upload_mode)
    # Ray's validation= becomes the validate_fn form; without a checkpoint either form is
    # refused, as ray.train.report refuses validation= ("Validation requires a checkpoint").
    options = resolve_validation(options, checkpoint is not None)
    if options.validate_fn is not None and checkpoint is None:
        raise InvalidInput(
            "validate_fn was given without a checkpoint to validate: pass it only with a "
            "checkpoint (on the rank that reports one), as ray.train.report(validation=...)."
        )
    job = None
    if options.validate_fn is not None:
        job = validation_request(
            options.validate_fn,
            options.validate_config,
            options.validation_resources,
            priority=options.priority,
            timeout_s=options.timeout_s,
            max_attempts=options.max_attempts,
            retry_on_timeout=options.retry_on_timeout,
            coalesce=options.coalesce,
        )
        if callable(options.validate_fn):  # a function neither form of call binds: refused
            takes_config_as_keywords(options.validate_fn, options.validate_config or {})
    delete_local = _delete_local(mode, options.delete_local_checkpoint_after_upload)
    return PreparedReport(plain_metrics(metrics), job, mode, delete_local)


def upload_mode(mode) -> CheckpointUploadMode:
    """ckval's CheckpointUploadMode for ``mode``: ckval's, or Ray Train's of the same name
    (``ray.train.CheckpointUploadMode.ASYNC``, as Ray's guides write it)."""
    if isinstance(mode, CheckpointUploadMode):
        return mode
    if type(mode).__name__ == "CheckpointUploadMode" and getattr(mode, "value", None) in (
        CheckpointUploadMode._value2member_map_
    ):
        return CheckpointUploadMode(mode.value)
    raise InvalidInput(
        "checkpoint_upload_mode must be a CheckpointUploadMode (ckval's or Ray Train's: "
        f"SYNC, ASYNC, NO_UPLOAD), got {mode!r}"
    )


def _delete_local(mode: CheckpointUploadMode, delete: bool | None) -> bool:
    """Whether the reported folder goes once copied: Ray Train's default for the mode."""
    if delete is None:
        return mode is CheckpointUploadMode.ASYNC
    if not isinstance(delete, bool):
        raise InvalidInput(
            f"delete_local_checkpoint_after_upload must be True, False or None, got {delete!r}"
        )
    return delete


def plain_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Reported metrics as stored; raises InvalidInput (before any copy) for a value the
    registry cannot hold, such as a "step" beyond 64 bits."""
    plain = normalize_metrics({k: to_plain(v) for k, v in metrics.items()}, what="metrics")
    check_step_and_epoch(plain)
    return plain
