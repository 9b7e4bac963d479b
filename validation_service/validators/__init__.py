"""Validators: ready-made validate_fns for the patterns in the Ray docs (a Ray Data
``map_batches`` job, an eval-only ``TorchTrainer``), for Hugging Face checkpoints, and an
outside program with a file contract (``CommandValidator``); ``hf.load_model`` loads any
Hugging Face or DCP folder, ``lm_eval.LMEvalValidator`` runs lm-evaluation-harness (both
imported from their modules: they need the extras). They
run inside an attempt; how an attempt runs is the executors' business."""

from validation_service.validators.command import CommandValidator
from validation_service.validators.map_batches import MapBatchesValidator
from validation_service.validators.torch_trainer import TorchTrainerValidator
from validation_service.validators.transformers import TransformersValidator

__all__ = [
    "CommandValidator",
    "MapBatchesValidator",
    "TorchTrainerValidator",
    "TransformersValidator",
]
