"""Ray Train's own validation API on ckval: a trainer's ``ValidationConfig`` and
``report(validation=True | ValidationTaskConfig(...))`` become one ckval validation.

The drop-in trainers (``trainer_integration.trainers``) keep the ``ValidationConfig``
from Ray and hand it to their workers inside the train function (``WithValidation``);
there ``report()`` turns ``validation=`` into ckval's ``validate_fn`` form with Ray's
rules: ``fn(checkpoint, **fn_kwargs)``, the trainer's ``fn_kwargs`` then the report's,
the report's ``timeout_s`` (or the trainer's for ``validation=True``), and
``ray_remote_kwargs`` as resources and retries. As in Ray, the fn's exceptions are
retried only with ``retry_exceptions`` (``True``: any; a list: those), up to
``max_retries`` times, and ``timeout_s`` covers the validation with its retries: they run
within one ckval attempt. The job's own attempts stand for Ray's retries after a system
failure (a lost worker or node), which Ray makes up to ``max_retries`` times whatever
``retry_exceptions`` says. Nothing here imports Ray.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from validation_service.errors import InvalidInput, not_to_be_retried

logger = logging.getLogger(__name__)

# ray_remote_kwargs that are resources of the validation task, under ckval's own names.
RESOURCE_KWARGS = ("num_cpus", "num_gpus", "memory", "accelerator_type", "resources")
# ray_remote_kwargs that decide how often a validation runs again.
RETRY_KWARGS = ("max_retries", "retry_exceptions")
# What Ray retries a task on by default (system failures only: retry_exceptions=False).
RAY_DEFAULT_MAX_RETRIES = 3


class KeywordValidateFn:
    """A Ray ``ValidationFn`` as ckval calls a validate_fn: ``fn(checkpoint, fn_kwargs)``
    becomes ``fn(checkpoint, **fn_kwargs)``, run again after an exception that Ray's
    ``retry_exceptions`` names, up to ``max_retries`` times.

    The second parameter is positional-only, so that ckval never mistakes a fn_kwargs
    entry named ``config`` for the keyword form of the call. The job's validate_fn name
    (``__qualname__``) is the user's function's. An exception that is not retried, or the
    last one, fails the job at once: the job's attempts are for system failures.
    """

    def __init__(
        self,
        fn: Callable[..., dict],
        retry_on: tuple[type[BaseException], ...] = (),
        max_retries: int = 0,
    ):
        self.fn = fn
        self.retry_on = retry_on
        self.max_retries = max_retries
        self.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)

    def __call__(self, checkpoint: Any, fn_kwargs: dict | None, /) -> dict:
        retries_left = self.max_retries
        while True:
            try:
                return self.fn(checkpoint, **(fn_kwargs or {}))
            except Exception as exc:
                if retries_left <= 0 or not isinstance(exc, self.retry_on):
                    marked = not_to_be_retried(exc)
                    if marked is exc:
                        raise
                    raise marked from exc
                retries_left -= 1
                logger.warning(
                    "%s raised %s: running it again (%d of max_retries=%d left)",
                    self.__qualname__,
                    type(exc).__name__,
                    retries_left,
                    self.max_retries,
                )


@dataclasses.dataclass(frozen=True)
class RayValidation:
    """A trainer's ``ValidationConfig``, checked once and kept in ckval's terms."""

    validate_fn: KeywordValidateFn
    fn_kwargs: dict[str, Any]
    timeout_s: float | None
    resources: dict[str, Any]
    max_attempts: int

    @classmethod
    def of(cls, config: Any) -> RayValidation:
        """Checks a ``ray.train.ValidationConfig``; raises InvalidInput naming what ckval
        cannot do with it."""
        fn = getattr(config, "fn", None)
        task_config = getattr(config, "task_config", None)
        remote = getattr(config, "ray_remote_kwargs", None) or {}
        if not callable(fn) or task_config is None:
            raise InvalidInput(
                "validation_config must be a ray.train.ValidationConfig(fn, task_config=..., "
                f"ray_remote_kwargs=...), got {type(config).__name__}."
            )
        if not isinstance(remote, dict):
            raise InvalidInput(
                "ValidationConfig(ray_remote_kwargs=...) must be a dict such as "
                f"{{'num_gpus': 1}}, got {type(remote).__name__}."
            )
        unknown = sorted(set(remote) - set(RESOURCE_KWARGS) - set(RETRY_KWARGS))
        if unknown:
            raise InvalidInput(
                f"ValidationConfig(ray_remote_kwargs=...) has {unknown}, which ckval does not "
                f"apply to its validations: use {sorted(RESOURCE_KWARGS + RETRY_KWARGS)} "
                "(a runtime_env belongs to the ckval service's Ray job)."
            )
        resources = {key: remote[key] for key in RESOURCE_KWARGS if key in remote}
        max_retries = _max_retries(remote)
        return cls(
            validate_fn=KeywordValidateFn(fn, _retry_on(remote), max_retries),
            fn_kwargs=_fn_kwargs(task_config, "ValidationConfig(task_config=...)"),
            timeout_s=getattr(task_config, "timeout_s", None),
            resources=resources or {"num_cpus": 1},  # Ray's default for a task
            max_attempts=max_retries + 1,
        )

    def report_options(self, validation: Any) -> dict[str, Any]:
        """ckval's report options for ``report(validation=...)``: Ray's merge of fn_kwargs
        and choice of timeout (``ValidationManager`` and ``run_validation_fn``)."""
        if validation is True:
            fn_kwargs, timeout_s = self.fn_kwargs, self.timeout_s
        else:
            given = _fn_kwargs(validation, "ValidationTaskConfig(fn_kwargs=...)")
            fn_kwargs = {**self.fn_kwargs, **given}
            # As Ray: a ValidationTaskConfig's timeout_s is the one, even None.
            timeout_s = getattr(validation, "timeout_s", None)
        return {
            "validate_fn": self.validate_fn,
            "validate_config": fn_kwargs,
            "timeout_s": timeout_s,
            "validation_resources": dict(self.resources),
            "max_attempts": self.max_attempts,
        }


def _fn_kwargs(task_config: Any, what: str) -> dict[str, Any]:
    fn_kwargs = getattr(task_config, "fn_kwargs", None)
    if fn_kwargs is None:
        return {}
    if not isinstance(fn_kwargs, dict):
        raise InvalidInput(f"{what} must be a dict, got {type(fn_kwargs).__name__}.")
    return dict(fn_kwargs)


def _max_retries(remote: dict[str, Any]) -> int:
    """Ray's ``max_retries`` of a task (default 3); ckval has no endless retries."""
    retries = remote.get("max_retries", RAY_DEFAULT_MAX_RETRIES)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise InvalidInput(
            "ValidationConfig(ray_remote_kwargs={'max_retries': ...}) must be an int >= 0 "
            f"for ckval (it has no endless retries), got {retries!r}."
        )
    return retries


def _retry_on(remote: dict[str, Any]) -> tuple[type[BaseException], ...]:
    """The exceptions of the fn that run it again: Ray's ``retry_exceptions``, False (none,
    the default), True (any) or a list of exception classes."""
    given = remote.get("retry_exceptions", False)
    if given is False:
        return ()
    if given is True:
        return (Exception,)
    if isinstance(given, (list, tuple)) and all(
        isinstance(kind, type) and issubclass(kind, BaseException) for kind in given
    ):
        return tuple(given)
    raise InvalidInput(
        "ValidationConfig(ray_remote_kwargs={'retry_exceptions': ...}) must be True, False "
        f"or a list of exception classes such as [ConnectionError], got {given!r}."
    )


# The validation of the trainer whose train function runs in this process (a Ray Train
# worker runs one train function at a time).
_active: RayValidation | None = None
_active_lock = threading.Lock()


def active() -> RayValidation | None:
    return _active


class WithValidation:
    """A train function that makes its trainer's validation known to report() in the
    worker while it runs. Ray Train sees the user's own signature (``__wrapped__``)."""

    def __init__(self, train_fn: Callable[..., Any], validation: RayValidation):
        functools.update_wrapper(self, train_fn)
        self.train_fn = train_fn
        self.validation = validation

    def __call__(self, *args: Any) -> Any:
        global _active
        with _active_lock:
            previous, _active = _active, self.validation
        try:
            return self.train_fn(*args)
        finally:
            with _active_lock:
                _active = previous


def is_task_config(validation: Any) -> bool:
    """Whether ``validation`` is a ``ray.train.ValidationTaskConfig`` (by its fields,
    without importing Ray)."""
    return type(validation).__name__ == "ValidationTaskConfig" and hasattr(validation, "fn_kwargs")


def resolve_validation(options: Any, has_checkpoint: bool) -> Any:
    """``options`` (ReportOptions) with ``validation=`` turned into ckval's validate_fn
    form; raises InvalidInput where ``ray.train.report`` raises its ValueError."""
    validation = options.validation
    if validation is False or validation is None:
        return options
    if validation is not True and not is_task_config(validation):
        raise InvalidInput(
            "validation must be True, False or a ray.train.ValidationTaskConfig(fn_kwargs=..., "
            f"timeout_s=...), got {validation!r}."
        )
    if not has_checkpoint:
        # ray.train.report's first check, on every rank: the common "only rank 0 passes
        # a checkpoint" loop passes validation= on rank 0 only.
        raise InvalidInput(
            "Validation requires a checkpoint to be provided (as in ray.train.report): pass "
            "validation= only with a checkpoint, on the rank that reports one."
        )
    _refuse_mixed_forms(options)
    ray_validation = active()
    if ray_validation is None:
        raise InvalidInput(
            "report(validation=...) needs the trainer's validation function: build the "
            "trainer with trainer_integration's TorchTrainer or TensorflowTrainer and "
            "validation_config=ray.train.ValidationConfig(fn), or pass "
            "validate_fn=fn to report() instead."
        )
    return dataclasses.replace(
        options, validation=False, **ray_validation.report_options(validation)
    )


def _refuse_mixed_forms(options: Any) -> None:
    defaults = {field.name: field.default for field in dataclasses.fields(options)}
    mixed = [
        name
        for name, given in (
            ("validate_fn", options.validate_fn is not None),
            ("validate_config", options.validate_config is not None),
            ("validation_resources", options.validation_resources is not None),
            ("timeout_s", options.timeout_s is not None),
            ("max_attempts", options.max_attempts != defaults["max_attempts"]),
        )
        if given
    ]
    if mixed:
        raise InvalidInput(
            f"report() got validation= together with {', '.join(mixed)}=: use one form. "
            "Ray's form takes the function, its resources, retries and fn_kwargs from the "
            "trainer's ValidationConfig and the timeout from ValidationTaskConfig(timeout_s=...); "
            "ckval's form is validate_fn=fn, validate_config={...}."
        )
