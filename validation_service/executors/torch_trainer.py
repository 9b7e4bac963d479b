"""The import path of TorchTrainerValidator named by the design (it lives in validators/)."""

from validation_service.validators.torch_trainer import (
    EvalRunFailed,
    ExactSplitDataConfig,
    TorchTrainerValidator,
    validation_run_name,
)

__all__ = [
    "EvalRunFailed",
    "ExactSplitDataConfig",
    "TorchTrainerValidator",
    "validation_run_name",
]
