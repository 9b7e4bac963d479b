"""A small Ray Train program in the form of Ray's async-validation guide, on Ray's API.

tests/test_ray_dropin_parity.py runs it as it is, and again with only its two marked
imports changed to ckval's. Two workers train a tiny torch model and report 6 times:
``validation=True``, a ValidationTaskConfig whose fn_kwargs override the trainer's, one
whose validation raises an error that ``retry_exceptions`` does not name, one that outlives
its ``timeout_s``, one whose first call raises an error it names (run again, validated),
and one whose every call raises that error, so that only its retries outlive ``timeout_s``.
Rank 1 reports its metrics without a checkpoint and without validation arguments
(ray.train.report refuses validation= without a checkpoint). Each call of the validation
function leaves a file in ``calls_dir``, so that a test can count them.
"""

# ruff: noqa: I001 - the two drop-in imports stay on lines of their own
import os
import tempfile
import time

import ray.train
import torch
from ray.train import RunConfig, ScalingConfig, ValidationConfig, ValidationTaskConfig

from ray.train import report  # drop-in: from trainer_integration import report
from ray.train.torch import TorchTrainer  # drop-in: from trainer_integration import TorchTrainer

REPORTS = 6
TIMEOUT_S = 1.0
# Each call of step 5 takes 0.7 s: one call is within TIMEOUT_S, its retries are not.
RETRIED_CALL_S = 0.7


def validate(checkpoint, calls_dir, step, scale=1.0, fail=False, sleep_s=0.0, flaky_calls=0):
    with open(os.path.join(calls_dir, f"step-{step}-pid-{os.getpid()}-{time.time_ns()}"), "w"):
        pass
    if fail:
        raise ValueError(f"validation of step {step} fails on purpose")
    time.sleep(sleep_s)
    calls = sum(name.startswith(f"step-{step}-") for name in os.listdir(calls_dir))
    if calls <= flaky_calls:
        raise ConnectionError(f"call {calls} of step {step}'s validation fails on purpose")
    model = torch.nn.Linear(2, 1)
    with checkpoint.as_directory() as directory:
        model.load_state_dict(torch.load(os.path.join(directory, "model.pt")))
    with torch.no_grad():
        val_loss = float(((model(torch.full((8, 2), 0.5)) - 1.0) ** 2).mean())
    return {"val_loss": val_loss * scale, "scale": scale}


def validation_of(step):
    """What report() asks for at each step."""
    return [
        True,
        ValidationTaskConfig(fn_kwargs={"step": 1, "scale": 2.0}),
        ValidationTaskConfig(fn_kwargs={"step": 2, "fail": True}),
        ValidationTaskConfig(fn_kwargs={"step": 3, "sleep_s": 60.0}, timeout_s=TIMEOUT_S),
        ValidationTaskConfig(fn_kwargs={"step": 4, "flaky_calls": 1}),
        ValidationTaskConfig(
            fn_kwargs={"step": 5, "sleep_s": RETRIED_CALL_S, "flaky_calls": 10},
            timeout_s=TIMEOUT_S,
        ),
    ][step]


def train_fn(config):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = ray.train.get_context().get_world_rank()
    for step in range(REPORTS):
        loss = ((model(torch.ones(4, 2)) - 1.0) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        metrics = {"step": step, "loss": round(float(loss), 6)}
        if rank != 0:
            report(metrics, checkpoint=None)
            continue
        with tempfile.TemporaryDirectory() as directory:
            torch.save(model.state_dict(), os.path.join(directory, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(directory)
            report(metrics, checkpoint=checkpoint, validation=validation_of(step))
    if rank == 0:
        # What Ray Train says of each reported checkpoint once its validations ended.
        reported = ray.train.get_all_reported_checkpoints()
        return [(c.metrics["step"], c.status.value) for c in reported]
    return None


def main(name, storage_path, calls_dir):
    trainer = TorchTrainer(
        train_fn,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=storage_path),
        validation_config=ValidationConfig(
            validate,
            task_config=ValidationTaskConfig(fn_kwargs={"calls_dir": calls_dir, "step": 0}),
            ray_remote_kwargs={
                "num_cpus": 1,
                "max_retries": 2,
                "retry_exceptions": [ConnectionError],
            },
        ),
    )
    return trainer.fit()
