"""validate_fn references: an importable "package.module:function", or a pickled callable.

Used where a report is checked (a reference that does not import, or names a module
outside CKVAL_ALLOWED_MODULES, fails at report time) and where an attempt runs (the
function and its config are loaded there, signatures verified before unpickling).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import cloudpickle

from validation_service.errors import InvalidInput, ModuleNotAllowed
from validation_service.signing import VALIDATE_CONFIG, VALIDATE_FN, PayloadTrust


def load_validate_fn(
    ref: str | None, pickled: bytes | None, *, trust: PayloadTrust, job_id: int | None = None
) -> Callable[..., Any]:
    """The job's validate_fn: its pickle once the signature verifies, or its reference
    once the module is allowed. Raises before anything untrusted is unpickled or imported."""
    if pickled is not None:
        return cloudpickle.loads(trust.verify(VALIDATE_FN, pickled, job_id=job_id))
    if not ref:
        raise InvalidInput("the job has no validate_fn")
    return import_validate_fn(ref, trust.allowed_modules)


def load_validate_config(
    stored: bytes | None, *, trust: PayloadTrust, job_id: int | None = None
) -> dict[str, Any]:
    """The job's validate_config, unpickled once its signature verifies ({} if none)."""
    if stored is None:
        return {}
    return cloudpickle.loads(trust.verify(VALIDATE_CONFIG, stored, job_id=job_id))


def check_module_allowed(ref: str, allowed_modules: tuple[str, ...] | list[str] | None) -> None:
    """Raises ModuleNotAllowed unless the reference's module is one of ``allowed_modules``
    or inside one of them ("pkg" allows "pkg" and "pkg.sub", not "pkgother")."""
    if not allowed_modules:
        return
    module_name = ref.partition(":")[0].strip()
    for prefix in allowed_modules:
        prefix = prefix.strip()
        if prefix.endswith("."):
            if module_name.startswith(prefix):
                return
        elif module_name == prefix or module_name.startswith(prefix + "."):
            return
    raise ModuleNotAllowed(ref, list(allowed_modules))


def import_validate_fn(
    ref: str, allowed_modules: tuple[str, ...] | list[str] | None = None
) -> Callable[..., Any]:
    """Imports "package.module:function" (dots after the colon walk attributes), only from
    ``allowed_modules`` when given."""
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise InvalidInput(
            f"validate_fn reference {ref!r} is not of the form 'package.module:function'."
        )
    check_module_allowed(ref, allowed_modules)
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInput(
            f"validate_fn reference {ref!r}: module {module_name!r} does not import ({exc}). "
            "Install the package that defines it on the cluster, or pass the function itself."
        ) from None
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InvalidInput(
                f"validate_fn reference {ref!r}: {module_name!r} has no attribute {attr_path!r}."
            ) from None
    if not callable(target):
        raise InvalidInput(f"validate_fn reference {ref!r} names a {type(target).__name__}.")
    return target
