"""ckval's service side: the checkpoint registry, the scheduler service and their errors.

The public names load on first use (PEP 562), so that `import validation_service` and the
`ckval` command line start without Ray, SQLAlchemy or Alembic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from validation_service.logs import configure_logging

# Quiet by default in every process (CKVAL_LOG_LEVEL turns it up), set before anything
# imports Alembic, which logs at INFO as it loads its plugins.
configure_logging()

# Public name -> the module that defines it.
_EXPORTS = {
    "Settings": "validation_service.config",
    "CheckpointCorrupt": "validation_service.errors",
    "CheckpointNotFound": "validation_service.errors",
    "CkvalError": "validation_service.errors",
    "InvalidInput": "validation_service.errors",
    "JobNotFound": "validation_service.errors",
    "PermanentValidationError": "validation_service.errors",
    "RegistryUnavailable": "validation_service.errors",
    "RunNotFound": "validation_service.errors",
    "UnknownMetric": "validation_service.errors",
    "ValidationFnError": "validation_service.errors",
    "JobStatus": "validation_service.jobs",
    "ValidationStatus": "validation_service.jobs",
    "Registry": "validation_service.registry.registry",
    "ValidationRequest": "validation_service.request",
    "ServiceHandle": "validation_service.service",
    "ValidationService": "validation_service.service",
    "StopPolicy": "validation_service.stopping",
}

__all__ = [
    "CheckpointCorrupt",
    "CheckpointNotFound",
    "CkvalError",
    "InvalidInput",
    "JobNotFound",
    "JobStatus",
    "PermanentValidationError",
    "Registry",
    "RegistryUnavailable",
    "RunNotFound",
    "ServiceHandle",
    "Settings",
    "StopPolicy",
    "UnknownMetric",
    "ValidationFnError",
    "ValidationRequest",
    "ValidationService",
    "ValidationStatus",
]

if TYPE_CHECKING:
    from validation_service.config import Settings
    from validation_service.errors import (
        CheckpointCorrupt,
        CheckpointNotFound,
        CkvalError,
        InvalidInput,
        JobNotFound,
        PermanentValidationError,
        RegistryUnavailable,
        RunNotFound,
        UnknownMetric,
        ValidationFnError,
    )
    from validation_service.jobs import JobStatus, ValidationStatus
    from validation_service.registry.registry import Registry
    from validation_service.request import ValidationRequest
    from validation_service.service import ServiceHandle, ValidationService
    from validation_service.stopping import StopPolicy


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
