"""Ray Train's trainers, taking Ray's ``validation_config`` and running each validation in
ckval instead of in Ray Train: ``from trainer_integration import TorchTrainer, report``.

``TorchTrainer(train_fn, validation_config=ray.train.ValidationConfig(fn, ...))`` is Ray's
``TorchTrainer`` (``fit()`` returns Ray's ``Result``) whose train function carries the
ValidationConfig to every worker, where ``trainer_integration.report(...,
validation=True | ValidationTaskConfig(...))`` hands it to ckval. Ray Train itself never
sees the ValidationConfig, so no validation runs twice. Each class is made on first use:
``TensorflowTrainer`` imports TensorFlow, as Ray's does.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from trainer_integration._ray_validation import RayValidation, WithValidation

# The drop-in trainers: the Ray Train module that has each.
RAY_TRAINERS = {
    "TorchTrainer": "ray.train.torch",
    "TensorflowTrainer": "ray.train.tensorflow",
}

__all__ = sorted(RAY_TRAINERS)

_made_lock = threading.Lock()


def __getattr__(name: str) -> type:
    module = RAY_TRAINERS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _made_lock:
        made = globals().get(name)
        if made is None:
            made = globals()[name] = _drop_in(name, module)
        return made


def _drop_in(name: str, module: str) -> type:
    """A subclass of Ray's trainer ``name`` that keeps ``validation_config`` from Ray."""
    from validation_service._ray_compat import report_takes_validation

    if not report_takes_validation():
        import ray

        raise ImportError(
            f"trainer_integration.{name} takes Ray Train's validation_config, which Ray "
            f"{ray.__version__} lacks (ray.train.ValidationConfig came in Ray 2.54). Use "
            f"{module}.{name} with trainer_integration.report(..., validate_fn=fn, "
            "validate_config={...}), or upgrade Ray."
        )
    base = getattr(importlib.import_module(module), name)

    def __init__(self, train_loop_per_worker, *args: Any, validation_config=None, **kwargs: Any):
        if validation_config is not None:
            # Checked here, on the driver: a ray_remote_kwargs ckval cannot apply fails
            # before any worker starts.
            validation = RayValidation.of(validation_config)
            train_loop_per_worker = WithValidation(train_loop_per_worker, validation)
        base.__init__(self, train_loop_per_worker, *args, **kwargs)

    __init__.__doc__ = (
        f"Ray's {name}; ``validation_config`` (a ray.train.ValidationConfig) is run by "
        "ckval for each report(..., validation=...) of trainer_integration."
    )
    return type(
        name,
        (base,),
        {"__init__": __init__, "__module__": __name__, "__qualname__": name, "__doc__": __doc__},
    )
