"""What a validation asks of its job, as stored: the validate_fn's payload (an import
reference or a cloudpickled callable), its validate_config, resources and pool, checked
up front and signed for the one job it belongs to.

Every front door builds its ValidationRequest here: report() and the framework callbacks
(through trainer_integration._request), and Registry.revalidate over stored checkpoints.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
from collections.abc import Callable
from typing import Any

import cloudpickle

from validation_service.errors import InvalidInput
from validation_service.jobs import DEFAULT_VALIDATOR, ExecutorKind
from validation_service.request import ValidationRequest
from validation_service.signing import VALIDATE_CONFIG, VALIDATE_FN, PayloadTrust, form_binding
from validation_service.validate_fn import import_validate_fn
from validation_service.validation import check_resources


def pool_for(resources: dict[str, Any]) -> str:
    """The concurrency pool a job counts against: its accelerator type, GPU, or CPU."""
    if resources.get("accelerator_type"):
        return str(resources["accelerator_type"])
    return "GPU" if resources.get("num_gpus") else "CPU"


# validation_request()'s arguments that ValidationRequest takes under the same names, as
# they are (it checks them itself).
_STORED_AS_GIVEN = (
    "priority",
    "timeout_s",
    "max_attempts",
    "retry_on_timeout",
    "coalesce",
    "validator",
    "background",
)


def validation_request(
    validate_fn: Callable[..., dict] | str,
    validate_config: dict | None,
    validation_resources: dict | None,
    priority: int,
    timeout_s: float | None,
    max_attempts: int,
    retry_on_timeout: bool = False,
    coalesce: str | None = None,
    *,
    validator: str = DEFAULT_VALIDATOR,
    background: bool = False,
) -> ValidationRequest:
    """The ValidationRequest that a report() (or a revalidate() under ``validator``) asks
    for, every argument checked up front.

    Raises InvalidInput naming the bad argument, before anything is stored.
    """
    arguments = locals()
    fn_ref, fn_pickle, fn_name = _validate_fn_payload(validate_fn)
    config_bytes = _config_payload(validate_config)
    resources = _checked_resources(validate_fn, validation_resources)
    # ValidationRequest checks priority, timeout_s, max_attempts, resources and coalesce.
    return ValidationRequest(
        executor_kind=ExecutorKind.RAY_TASK.value,
        pool=pool_for(resources),
        validate_fn_name=fn_name,
        validate_fn_ref=fn_ref,
        validate_fn_pickle=fn_pickle,
        validate_config=config_bytes,
        resources=resources,
        **{name: arguments[name] for name in _STORED_AS_GIVEN},
    )


def _validate_fn_payload(validate_fn) -> tuple[str | None, bytes | None, str]:
    """(import reference, pickled callable, name) of a validate_fn; one of the first two."""
    if isinstance(validate_fn, str):
        # A reference outside CKVAL_ALLOWED_MODULES is refused before it is imported; one
        # that does not import fails here, now.
        from validation_service.config import get_settings  # pydantic: on first use

        import_validate_fn(validate_fn, get_settings().allowed_modules)
        return validate_fn, None, validate_fn
    if not callable(validate_fn):
        raise InvalidInput(
            f"validate_fn must be a callable (checkpoint, config) -> dict or a "
            f"'package.module:function' string, got {type(validate_fn).__name__}."
        )
    try:
        pickled = _pickled(validate_fn)
    except Exception as exc:  # noqa: BLE001 - any pickling error is the user's to fix
        raise InvalidInput(
            f"validate_fn {validate_fn!r} cannot be pickled ({exc}). Define it at module "
            "level or pass its reference as 'package.module:function'."
        ) from None
    return None, pickled, getattr(validate_fn, "__qualname__", type(validate_fn).__name__)


def _config_payload(validate_config: dict | None) -> bytes:
    if validate_config is not None and not isinstance(validate_config, dict):
        raise InvalidInput(f"validate_config must be a dict, got {type(validate_config).__name__}.")
    try:
        return cloudpickle.dumps(validate_config or {})
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise InvalidInput(
            f"validate_config cannot be pickled ({exc}); it is stored until the validation "
            "runs. Pass plain values, paths or URIs instead of open handles or locks."
        ) from None


def _checked_resources(validate_fn, validation_resources: dict | None) -> dict[str, Any]:
    # Validators that launch Ray work of their own (MapBatchesValidator,
    # TorchTrainerValidator) recommend num_cpus=0 for the task that drives them.
    default = getattr(validate_fn, "recommended_resources", None) or {"num_cpus": 1}
    if validation_resources is None or (
        isinstance(validation_resources, dict) and not validation_resources
    ):
        return dict(default)
    return dict(check_resources(validation_resources))


def signed_request(job: ValidationRequest | None, trust: PayloadTrust, bound_to=None):
    """The request as it is stored: its pickled validate_fn and validate_config signed
    with the reporter's key for the job ``bound_to`` names (signing.job_binding); the
    validate_config's signature also covers the validate_fn's reference, if it is one
    (signing.form_binding).

    Raises ModuleNotAllowed for a reference outside the reporter's allowed modules,
    before anything is stored (all it does without ``bound_to``). Signing a signed
    request changes nothing.
    """
    if job is None:
        return None
    if job.validate_fn_ref:
        import_validate_fn(job.validate_fn_ref, trust.allowed_modules)  # the whole reference
    if bound_to is None:
        return job
    fn, config = job.validate_fn_pickle, job.validate_config
    if config is None:  # every job signs one: it binds the validate_fn's form
        config = cloudpickle.dumps({})
    signed_fn = trust.sign(VALIDATE_FN, fn, bound_to=bound_to)
    form = form_binding(bound_to, job.validate_fn_ref if fn is None else None)
    signed_config = trust.sign(VALIDATE_CONFIG, config, bound_to=form)
    if signed_fn is fn and signed_config is job.validate_config:
        return job
    return dataclasses.replace(job, validate_fn_pickle=signed_fn, validate_config=signed_config)


# Each validate_fn is pickled once per process, as Ray pickles ValidationConfig(fn) once
# per trainer; what changes from report to report belongs in validate_config.
_PICKLED_MAX = 32
_pickled_fns: dict[int, tuple[Callable[..., Any], bytes]] = {}
_pickled_lock = threading.Lock()


def _pickled(fn: Callable[..., Any]) -> bytes:
    with _pickled_lock:
        cached = _pickled_fns.get(id(fn))
        if cached is not None and cached[0] is fn:
            return cached[1]
    data = cloudpickle.dumps(fn)
    with _pickled_lock:
        if len(_pickled_fns) >= _PICKLED_MAX:
            _pickled_fns.pop(next(iter(_pickled_fns)))
        _pickled_fns[id(fn)] = (fn, data)  # holds fn: its id is not reused meanwhile
    return data
