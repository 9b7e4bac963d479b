"""ckval's service side: the checkpoint registry, the scheduler service and their errors."""

from validation_service.logs import configure_logging

# Quiet by default in every process (CKVAL_LOG_LEVEL turns it up), set before anything
# imports Alembic, which logs at INFO as it loads its plugins.
configure_logging()

from validation_service.config import Settings  # noqa: E402
from validation_service.errors import (  # noqa: E402
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
from validation_service.jobs import JobStatus, ValidationStatus  # noqa: E402
from validation_service.registry import Registry  # noqa: E402
from validation_service.request import ValidationRequest  # noqa: E402
from validation_service.service import ServiceHandle, ValidationService  # noqa: E402

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
    "UnknownMetric",
    "ValidationFnError",
    "ValidationRequest",
    "ValidationService",
    "ValidationStatus",
]
