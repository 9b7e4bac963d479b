"""validate_fn references: an importable "package.module:function", or a pickled callable.

Used where a report is checked (a reference that does not import fails at report time)
and where an attempt runs (the function is loaded there).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import cloudpickle

from validation_service.errors import InvalidInput


def load_validate_fn(ref: str | None, pickled: bytes | None) -> Callable[..., Any]:
    if pickled is not None:
        return cloudpickle.loads(pickled)
    if not ref:
        raise InvalidInput("the job has no validate_fn")
    return import_validate_fn(ref)


def import_validate_fn(ref: str) -> Callable[..., Any]:
    """Imports "package.module:function" (dots after the colon walk attributes)."""
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise InvalidInput(
            f"validate_fn reference {ref!r} is not of the form 'package.module:function'."
        )
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
