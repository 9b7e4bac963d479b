"""The bounds a report's values must meet to be stored, checked before anything is copied.

Each check raises InvalidInput naming the argument, what it must be and what it was, so a
bad value fails the report() call instead of the database statement after the copy. The
limits mirror the columns in registry/models.py (tests/test_bad_input.py compares them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from validation_service.errors import InvalidInput, JobNotFound
from validation_service.jobs import DEFAULT_VALIDATOR, JobStatus
from validation_service.names import check_name

# Column sizes: Integer is 32 bits on PostgreSQL, BigInteger 64 bits (SQLite stores both
# in 64 bits).
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# validation_jobs.pool: the accelerator type names the pool.
MAX_POOL_NAME = 128
# Attempts per job (and per user retry); more would only hide a validate_fn that fails.
MAX_ATTEMPTS = 1_000
# best_checkpoints(k=...): what one query returns (the HTTP API's bound too).
MAX_BEST_K = 10_000
# Ids are stored in integer columns: anything outside is no id.
# Ids are 32-bit columns (PostgreSQL's integer): a larger id names no row.
MAX_ID = INT32_MAX
# Every text a job stores (an error message, a traceback, an attempt's log), in
# characters: a longer one keeps its head and tail (capped_text).
MAX_STORED_TEXT = 64 * 1024

RESOURCE_KEYS = frozenset({"num_cpus", "num_gpus", "memory", "resources", "accelerator_type"})
_NUMERIC_RESOURCES = ("num_cpus", "num_gpus", "memory")
# Ray refuses these as custom resources: they have keyword arguments of their own.
_RESERVED_CUSTOM_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


def capped_text(text: str | None) -> str | None:
    """``text`` as a job stores it: at most MAX_STORED_TEXT characters, its head and tail
    kept around a line that says how much was left out."""
    if text is None or len(text) <= MAX_STORED_TEXT:
        return text
    keep = (MAX_STORED_TEXT - 80) // 2  # 80: room for the line between them
    left_out = len(text) - 2 * keep
    return f"{text[:keep]}\n[... {left_out} characters left out ...]\n{text[-keep:]}"


def check_int(value: Any, what: str, low: int, high: int) -> int:
    """An int (not a bool) within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{what} must be an int, got {_preview(value)}")
    if not low <= value <= high:
        raise InvalidInput(f"{what} must be an int from {low} to {high}, got {_preview(value)}")
    return value


def check_report_index(index: Any) -> int:
    return check_int(index, "report index", 0, INT32_MAX)


def check_priority(priority: Any) -> int:
    return check_int(priority, "priority", INT32_MIN, INT32_MAX)


def check_max_attempts(max_attempts: Any) -> int:
    if (
        isinstance(max_attempts, bool)
        or not isinstance(max_attempts, int)
        or not 1 <= max_attempts <= MAX_ATTEMPTS
    ):
        raise InvalidInput(
            f"max_attempts must be an int >= 1 (at most {MAX_ATTEMPTS}), "
            f"got {_preview(max_attempts)}"
        )
    return max_attempts


def check_timeout_s(timeout_s: Any, what: str = "timeout_s") -> float | None:
    """None, or a positive finite number of seconds (``what`` names it in the error)."""
    if timeout_s is None:
        return None
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not _finite(timeout_s)
        or timeout_s <= 0
    ):
        raise InvalidInput(
            f"{what} must be a positive number of seconds or None, got {_preview(timeout_s)}"
        )
    return float(timeout_s)


def check_resources(resources: Any) -> dict[str, Any]:
    """validation_resources: known keys, non-negative finite numbers, a short accelerator
    type, and custom resources as a dict of name -> non-negative finite number."""
    if not isinstance(resources, dict):
        raise InvalidInput(
            f"validation_resources must be a dict such as {{'num_gpus': 1, "
            f"'accelerator_type': 'A10G'}}, got {_preview(resources)}"
        )
    unknown = set(resources) - RESOURCE_KEYS
    if unknown:
        raise InvalidInput(
            f"validation_resources has unknown keys {sorted(map(str, unknown))}; "
            f"use {sorted(RESOURCE_KEYS)}."
        )
    for key in _NUMERIC_RESOURCES:
        value = resources.get(key)
        if value is not None and not _non_negative_number(value):
            raise InvalidInput(
                f"validation_resources[{key!r}] must be a number >= 0 (finite), "
                f"got {_preview(value)}"
            )
    accelerator = resources.get("accelerator_type")
    if accelerator is not None and (
        not isinstance(accelerator, str) or not accelerator or len(accelerator) > MAX_POOL_NAME
    ):
        raise InvalidInput(
            "validation_resources['accelerator_type'] must be a non-empty str of at most "
            f"{MAX_POOL_NAME} characters such as 'A10G', got {_preview(accelerator)}"
            + (f" ({len(accelerator)} characters)" if isinstance(accelerator, str) else "")
        )
    _check_custom_resources(resources.get("resources"))
    return resources


def _check_custom_resources(custom: Any) -> None:
    if custom is None:
        return
    if not isinstance(custom, dict):
        raise InvalidInput(
            "validation_resources['resources'] must be a dict of resource name -> number "
            f">= 0, such as {{'TPU': 1}}, got {_preview(custom)}"
        )
    for name, amount in custom.items():
        if not isinstance(name, str) or not name:
            raise InvalidInput(
                f"validation_resources['resources'] has a name {_preview(name)}; "
                "resource names are non-empty str."
            )
        if name in _RESERVED_CUSTOM_RESOURCES:
            raise InvalidInput(
                f"validation_resources['resources'] names {name!r}; use "
                "num_cpus, num_gpus or memory for it instead."
            )
        if not _non_negative_number(amount):
            raise InvalidInput(
                f"validation_resources['resources'][{name!r}] must be a number >= 0 "
                f"(finite), got {_preview(amount)}"
            )


def check_request(request: Any) -> None:
    """Every field of a ValidationRequest that a report() argument sets."""
    check_priority(request.priority)
    check_timeout_s(request.timeout_s)
    check_max_attempts(request.max_attempts)
    check_resources(request.resources)
    check_flag("retry_on_timeout", request.retry_on_timeout)
    if not isinstance(request.pool, str) or len(request.pool) > MAX_POOL_NAME:
        raise InvalidInput(
            f"the validation's pool name must be a str of at most {MAX_POOL_NAME} characters, "
            f"got {_preview(request.pool)}"
        )
    if request.coalesce not in (None, "latest"):
        raise InvalidInput(f"coalesce must be None or 'latest', got {request.coalesce!r}")
    check_name("validator name", request.validator)
    check_flag("background", request.background)
    if request.background:  # an evaluation over history (revalidate)
        check_evaluation_name(request.validator)


def check_evaluation_name(validator: Any) -> str:
    """The name of an evaluation over history: a safe name, and never "default", which
    is report()'s own validation: its results merge into the checkpoint's metrics, move
    tracked aliases, drive stop policies and retention. A named evaluation feeds none
    of them."""
    check_name("validator name", validator)
    if validator == DEFAULT_VALIDATOR:
        raise InvalidInput(
            f"validator {DEFAULT_VALIDATOR!r} is report()'s own validation, whose results "
            "merge into the checkpoint's metrics and move aliases, stop policies and "
            "retention: give this evaluation a name of its own, e.g. 'v2' or 'heldout'. "
            "Nothing was queued."
        )
    return validator


def check_checkpoint(checkpoint: Any) -> None:
    """None, or a ray.train.Checkpoint (anything with its path, filesystem and
    to_directory()): a path string or a dict is refused, naming what to pass."""
    if checkpoint is None or all(
        hasattr(checkpoint, name) for name in ("path", "filesystem", "to_directory")
    ):
        return
    raise InvalidInput(
        "checkpoint must be a ray.train.Checkpoint or None, got "
        f"{type(checkpoint).__name__} {_preview(checkpoint)}; for a folder pass "
        "ray.train.Checkpoint.from_directory(path)."
    )


def check_flag(name: str, value: Any) -> bool:
    """True or False, nothing that merely reads as one ("no" is not False)."""
    if not isinstance(value, bool):
        raise InvalidInput(f"{name} must be True or False, got {_preview(value)}")
    return value


def check_step_and_epoch(metrics: dict[str, Any]) -> None:
    """Reported metrics "step" and "epoch", which are also stored as integer columns."""
    check_step(stored_int(metrics.get("step")), what="metrics['step']")
    check_epoch(stored_int(metrics.get("epoch")), what="metrics['epoch']")


def check_step(step: int | None, *, what: str = "step") -> None:
    if step is not None:
        check_int(step, what, INT64_MIN, INT64_MAX)


def check_epoch(epoch: int | None, *, what: str = "epoch") -> None:
    if epoch is not None:
        check_int(epoch, what, INT32_MIN, INT32_MAX)


def stored_int(value: Any) -> int | None:
    """The integer a reported "step" or "epoch" is stored as; None when it is no integer."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def check_k(k: Any) -> int:
    return check_int(k, "k", 1, MAX_BEST_K)


def check_job_id(job_id: Any) -> int:
    """A job id; one outside the ids' column range is a job that does not exist."""
    if isinstance(job_id, bool) or not isinstance(job_id, int):
        raise InvalidInput(f"a job id must be an int, got {_preview(job_id)}")
    if not 1 <= job_id <= MAX_ID:
        raise JobNotFound(job_id)
    return job_id


def _non_negative_number(value: Any) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and _finite(value)
        and value >= 0
    )


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _preview(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        bits = value.bit_length()
        return f"{'-' if value < 0 else ''}2**{bits - 1} or more (an int of {bits} bits)"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def existing_job_ids(job_ids: Sequence[int] | None) -> list[int] | None:
    """Job ids that can exist: ids out of the column's range name no job, as unknown ids."""
    if job_ids is None:
        return None
    existing = []
    for job_id in job_ids:
        try:
            existing.append(check_job_id(job_id))
        except JobNotFound:
            continue
    return existing


def job_status(status: JobStatus | str) -> JobStatus:
    try:
        return JobStatus(str(getattr(status, "value", status)).upper())
    except ValueError:
        names = ", ".join(s.value for s in JobStatus)
        raise InvalidInput(f"unknown job status {status!r}: use one of {names}") from None
