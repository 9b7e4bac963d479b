"""What training code imports: report() with a validate_fn, should_stop(), runs outside
Ray Train (start_run, Client), and Ray Train's trainers keeping validation_config.

This module hands names on; each lives in the room named for it: ``_front.py``
(report), ``_client.py`` (runs and their reporters), ``_ray_train.py`` (the hand-off to
Ray Train), ``_resume.py`` (Ray Train's checkpoints followed to the stored ones),
``_stopping.py`` (should_stop).
"""

from __future__ import annotations

from trainer_integration._client import Client, start_run
from trainer_integration._delivery import ReportNotDelivered
from trainer_integration._front import report, set_up_ray_train_worker
from trainer_integration._request import CheckpointUploadMode
from trainer_integration._request import upload_mode as upload_mode  # the callbacks' use
from trainer_integration._resume import ray_results_path, resolve_checkpoint
from trainer_integration._stopping import should_stop

__all__ = [
    "CheckpointUploadMode",
    "Client",
    "ReportNotDelivered",
    "RunStatusCallback",
    "TensorflowTrainer",
    "TorchTrainer",
    "ray_results_path",
    "report",
    "resolve_checkpoint",
    "should_stop",
    "start_run",
]

# Made on first use: RunStatusCallback subclasses a Ray Train class, and the trainers are
# Ray's (TensorflowTrainer imports TensorFlow); training code that only reports need not
# pay for them.
_LAZY = {
    "RunStatusCallback": "trainer_integration.run_status",
    "TorchTrainer": "trainer_integration.trainers",
    "TensorflowTrainer": "trainer_integration.trainers",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


set_up_ray_train_worker()
