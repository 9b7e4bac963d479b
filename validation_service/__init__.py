"""ckval's service side: the checkpoint registry, the scheduler service and their errors."""

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
from validation_service.registry import Registry
from validation_service.request import ValidationRequest
from validation_service.service import ServiceHandle, ValidationService

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
