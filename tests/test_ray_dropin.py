"""Ray Train's validation API on ckval's trainers and report(): how a ValidationConfig and
report(validation=...) become one ckval validation, and what is refused, with what words.

The full program on Ray and on ckval side by side is tests/test_ray_dropin_parity.py.
"""

from __future__ import annotations

import json
import os
import sys

import cloudpickle
import pytest
import ray.cloudpickle
import ray.train

import trainer_integration
from trainer_integration import Client, report
from validation_service import _ray_compat
from validation_service.errors import InvalidInput
from validation_service.registry.registry import Registry

if not _ray_compat.report_takes_validation():
    pytest.skip("this Ray has no ray.train.ValidationConfig", allow_module_level=True)

from ray.train import RunConfig, ScalingConfig, ValidationConfig, ValidationTaskConfig  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(autouse=True)
def no_local_mode_context_outlives_its_test(monkeypatch):
    """Ray Train's local mode (num_workers=0) leaves its train context set in this process
    after fit(): put it back, or later tests' report() calls would think they run inside
    Ray Train."""
    from ray.train.v2._internal.execution import train_fn_utils

    monkeypatch.setattr(train_fn_utils, "_train_fn_utils", train_fn_utils._train_fn_utils)


def kwargs_seen(checkpoint, a, b, c=None) -> dict:
    """A Ray-style validation function: returns the fn_kwargs it was called with."""
    with checkpoint.as_directory() as directory:
        step = json.load(open(os.path.join(directory, "state.json")))["step"]
    return {"a": a, "b": b, "c": -1 if c is None else c, "validated_step": step}


def checkpoint_of(directory, step: int) -> ray.train.Checkpoint:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "state.json"), "w") as f:
        json.dump({"step": step}, f)
    return ray.train.Checkpoint.from_directory(str(directory))


def report_twice(config) -> None:
    """validation=True, then a ValidationTaskConfig overriding one of the trainer's kwargs."""
    report({"step": 0}, checkpoint_of(f"{config['scratch']}/0", 0), validation=True)
    report(
        {"step": 1},
        checkpoint_of(f"{config['scratch']}/1", 1),
        validation=ValidationTaskConfig(fn_kwargs={"b": 20, "c": 30}),
    )


@pytest.mark.ray
def test_validation_config_and_task_config_become_one_ckval_job_each(service, tmp_path, unique_run):
    trainer = trainer_integration.TorchTrainer(
        report_twice,
        train_loop_config={"scratch": str(tmp_path)},
        # Local mode runs the train function here, quickly; Ray itself runs no
        # validation there, ckval does.
        scaling_config=ScalingConfig(num_workers=0),
        run_config=RunConfig(name=unique_run, storage_path=str(tmp_path / "ray_results")),
        validation_config=ValidationConfig(
            kwargs_seen,
            task_config=ValidationTaskConfig(fn_kwargs={"a": 1, "b": 2}, timeout_s=90),
            ray_remote_kwargs={
                "num_cpus": 0.5,
                "memory": 10**8,
                "max_retries": 2,
                "retry_exceptions": True,
            },
        ),
    )
    assert isinstance(trainer, ray.train.torch.TorchTrainer)
    assert trainer.validation_config is None  # Ray Train itself validates nothing
    result = trainer.fit()
    assert result.error is None
    registry = Registry()
    registry.wait(unique_run, timeout_s=60)

    first, second = registry.checkpoints(unique_run)
    # The trainer's fn_kwargs, then the report's over them (Ray's merge).
    assert first.metrics == {"step": 0, "a": 1, "b": 2, "c": -1, "validated_step": 0}
    assert second.metrics == {"step": 1, "a": 1, "b": 20, "c": 30, "validated_step": 1}
    jobs = sorted(registry.validations(unique_run), key=lambda job: job.report_index)
    # validation=True takes the trainer's timeout_s; a ValidationTaskConfig its own (None).
    assert [job.timeout_s for job in jobs] == [90, None]
    for job in jobs:
        assert job.status == "SUCCEEDED"
        assert job.resources == {"num_cpus": 0.5, "memory": 10**8}
        # max_retries=2: 3 attempts after lost workers; the fn's own retries run within one.
        assert job.max_attempts == 3
        assert job.validate_fn_name == "kwargs_seen"


def test_a_ray_remote_kwarg_ckval_cannot_apply_is_refused_when_the_trainer_is_built():
    with pytest.raises(InvalidInput, match=r"\['runtime_env'\].*use \["):
        trainer_integration.TorchTrainer(
            report_twice,
            scaling_config=ScalingConfig(num_workers=0),
            validation_config=ValidationConfig(
                kwargs_seen, ray_remote_kwargs={"runtime_env": {"pip": ["x"]}}
            ),
        )
    with pytest.raises(InvalidInput, match="no endless retries"):
        trainer_integration.TorchTrainer(
            report_twice,
            scaling_config=ScalingConfig(num_workers=0),
            validation_config=ValidationConfig(
                kwargs_seen, ray_remote_kwargs={"max_retries": -1, "retry_exceptions": True}
            ),
        )
    with pytest.raises(InvalidInput, match=r"a list of exception classes.*got \['ValueError'\]"):
        trainer_integration.TorchTrainer(
            report_twice,
            scaling_config=ScalingConfig(num_workers=0),
            validation_config=ValidationConfig(
                kwargs_seen, ray_remote_kwargs={"retry_exceptions": ["ValueError"]}
            ),
        )


@pytest.mark.parametrize(
    ("with_checkpoint", "kwargs", "message"),
    [
        (True, {"validation": True, "validate_fn": kwargs_seen}, "together with validate_fn="),
        (True, {"validation": True, "timeout_s": 5}, "together with timeout_s="),
        (True, {"validation": True, "max_attempts": 5}, "together with max_attempts="),
        (True, {"validation": True}, "needs the trainer's validation function"),
        (True, {"validation": "yes"}, "validation must be True, False or"),
        # As ray.train.report: no validation without a checkpoint, in either form.
        (False, {"validation": ValidationTaskConfig()}, "Validation requires a checkpoint"),
        (False, {"validate_fn": kwargs_seen}, "without a checkpoint"),
    ],
)
def test_validation_arguments_ckval_cannot_act_on_are_refused_before_anything_is_stored(
    tmp_path, unique_run, with_checkpoint, kwargs, message
):
    client = Client(unique_run, start_service=False)
    checkpoint = checkpoint_of(tmp_path / "c", 0) if with_checkpoint else None
    with pytest.raises(InvalidInput, match=message):
        client.report({"step": 0}, checkpoint, **kwargs)
    assert client.registry.checkpoints(unique_run) == []
    client.close()


def test_the_drop_in_trainers_are_rays_and_made_on_first_use():
    assert "TorchTrainer" in trainer_integration.__all__
    assert issubclass(trainer_integration.TorchTrainer, ray.train.torch.TorchTrainer)
    assert trainer_integration.TorchTrainer is trainer_integration.trainers.TorchTrainer
    # Picklable by reference, as Ray's own classes.
    assert cloudpickle.loads(cloudpickle.dumps(trainer_integration.TorchTrainer)) is (
        trainer_integration.TorchTrainer
    )


def test_the_tensorflow_trainer_keeps_validation_config_from_ray_too():
    pytest.importorskip("tensorflow")
    import ray.train.tensorflow

    trainer = trainer_integration.TensorflowTrainer(
        report_twice,
        scaling_config=ScalingConfig(num_workers=0),
        validation_config=ValidationConfig(kwargs_seen, ray_remote_kwargs={"num_gpus": 1}),
    )
    assert isinstance(trainer, ray.train.tensorflow.TensorflowTrainer)
    assert trainer.validation_config is None
    # The train function carries it to the workers, with the resources in ckval's terms.
    assert trainer.train_loop_per_worker.validation.resources == {"num_gpus": 1}


def test_the_fn_runs_again_only_after_an_error_that_retry_exceptions_names():
    """Ray's retry_exceptions=[...] rule, in the attempt: the errors it names run the fn
    again up to max_retries times; any other, or the last, fails the job at once, with
    the fn's own error type (tests/test_ray_dropin_parity.py runs it on both sides)."""
    from trainer_integration._ray_validation import KeywordValidateFn
    from validation_service.errors import is_not_to_be_retried

    calls = []

    def flaky(checkpoint, fail_with):
        calls.append(checkpoint)
        if len(calls) <= 2:
            raise fail_with("not yet")
        return {"calls": len(calls)}

    validate = KeywordValidateFn(flaky, (ConnectionError,), max_retries=2)
    assert validate("c", {"fail_with": ConnectionError}) == {"calls": 3}

    calls.clear()
    with pytest.raises(ValueError, match="not yet") as raised:
        validate("c", {"fail_with": ValueError})
    assert len(calls) == 1 and is_not_to_be_retried(raised.value)

    calls.clear()
    once = KeywordValidateFn(flaky, (ConnectionError,), max_retries=1)
    with pytest.raises(ConnectionError) as raised:
        once("c", {"fail_with": ConnectionError})
    assert len(calls) == 2 and is_not_to_be_retried(raised.value)
