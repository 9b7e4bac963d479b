"""Real Ray: a 2-worker TorchTrainer reporting through trainer_integration.report()."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid

import cloudpickle
import numpy as np
import pytest
import ray.cloudpickle
import torch

from trainer_integration import report, resolve_checkpoint
from validation_service.cli.demo import load_digits_split, make_model, validate_digits
from validation_service.errors import ValidationsFailedWarning
from validation_service.jobs import AssemblyStatus
from validation_service.registry.registry import Registry

pytestmark = pytest.mark.ray

# Ray workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def train_digits(config):
    import ray.train
    import ray.train.torch

    torch.manual_seed(0)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    x_train, _, y_train, _ = load_digits_split()
    x = torch.from_numpy(x_train[rank::world])
    y = torch.from_numpy(y_train[rank::world]).long()
    model = ray.train.torch.prepare_model(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(config["epochs"]):
        for start in range(0, len(x), 64):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                model(x[start : start + 64]), y[start : start + 64]
            )
            loss.backward()
            optimizer.step()
        metrics = {"epoch": epoch, "train_loss": float(loss)}
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(tmp, "model.pt"))
                report(
                    metrics,
                    checkpoint=ray.train.Checkpoint.from_directory(tmp),
                    validate_fn=config["validate_fn"],
                    validate_config={"epoch": epoch, "hold_s": config.get("hold_s", 0)},
                    validation_resources={"num_cpus": 1},
                    max_attempts=config.get("max_attempts", 3),
                )
            else:
                report(metrics, None)


EPOCHS = 5
FAILS, NOT_A_DICT = 1, 2  # the epochs whose validation raises / returns a list
VALIDATED = [e for e in range(EPOCHS) if e not in (FAILS, NOT_A_DICT)]


def validate_by_epoch(checkpoint, config):
    """Epoch FAILS raises, epoch NOT_A_DICT returns a list; the others validate, each held
    open long enough that overlap is observable on 2 cores."""
    if config["epoch"] == FAILS:
        raise ValueError(f"bad batch in epoch {config['epoch']}")
    if config["epoch"] == NOT_A_DICT:
        return [0.5]  # not a dict
    metrics = validate_digits(checkpoint, {})
    time.sleep(config["hold_s"])
    return metrics


def independent_accuracy(checkpoint_dir: str) -> float:
    """Accuracy computed without torchmetrics: argmax of logits against labels."""
    _, x_val, _, y_val = load_digits_split()
    model = make_model()
    model.load_state_dict(torch.load(os.path.join(checkpoint_dir, "model.pt")))
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_val)).argmax(dim=1).numpy()
    return float(np.mean(predicted == y_val))


def fit(run_name, session_home, **config):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_digits,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=run_name, storage_path=str(session_home / "ray_results")),
    )
    return trainer.fit()


@pytest.fixture(scope="module")
def digits_run(service, session_home):
    """One Ray Train run, read by the two tests below: every epoch's checkpoint reported,
    its validation succeeding, raising or returning a non-dict by epoch."""
    run = f"digits-{uuid.uuid4().hex[:6]}"
    result = fit(
        run, session_home, epochs=EPOCHS, validate_fn=validate_by_epoch, hold_s=1.5, max_attempts=2
    )
    assert result.error is None  # failing validations did not stop training
    failed = EPOCHS - len(VALIDATED)
    with pytest.warns(ValidationsFailedWarning, match=f"{failed} of {EPOCHS} validation"):
        Registry().wait(run, timeout_s=180)
    return run, result


def test_every_checkpoint_is_validated_and_ranked(digits_run):
    run, result = digits_run
    registry = Registry()
    records = registry.checkpoints(run)
    assert [r.report_index for r in records] == list(range(EPOCHS))
    expected = {}
    for record in records:
        assert record.metrics["train_loss"] == record.reported_metrics["train_loss"]
        if record.report_index not in VALIDATED:
            continue
        assert record.validation_status == "VALIDATED"
        assert set(record.validated_metrics) == {"accuracy", "val_loss"}
        expected[record.report_index] = independent_accuracy(record.uri)
        assert record.metrics["accuracy"] == pytest.approx(expected[record.report_index], abs=1e-6)
    ranked = sorted(expected, key=lambda i: (-expected[i], i))[:3]
    best = registry.best_checkpoints(run, metric="accuracy", mode="max", k=3)
    assert [m["epoch"] for _, m in best] == ranked
    assert best[0][0].path == records[ranked[0]].uri

    # Several validations ran at once: attempt windows recorded by the tasks overlap.
    jobs = registry.validations(run)
    windows = sorted((a.started_at, a.finished_at) for job in jobs for a in job.attempt_history)
    overlaps = sum(
        1 for (_, end), (start, _) in zip(windows, windows[1:], strict=False) if start < end
    )
    assert overlaps >= 1, windows
    assert all(a.node_id for job in jobs for a in job.attempt_history)

    # Ray's own Result lists every checkpoint; each resolves to the stored one.
    assert len(result.best_checkpoints) == EPOCHS
    latest = resolve_checkpoint(result.checkpoint)
    assert latest.path == records[-1].uri
    assert registry.latest_checkpoint(run).path == records[-1].uri


def test_failing_and_non_dict_validate_fn_fail_while_training_completes(digits_run):
    run, _ = digits_run
    registry = Registry()
    jobs = {job.report_index: job for job in registry.validations(run)}
    assert {i: j.status for i, j in jobs.items()} == {
        i: "SUCCEEDED" if i in VALIDATED else "FAILED" for i in range(EPOCHS)
    }
    raised = jobs[FAILS]
    assert (raised.error_type, raised.attempts) == ("ValueError", 2)
    assert raised.error_message == "bad batch in epoch 1"
    # The traceback names the user's function and its error. (cloudpickle 3.1.3 and later
    # file a function pickled by value as "<dynamic-code>": its source line is not shown.)
    assert "in validate_by_epoch\n" in raised.error_traceback
    assert raised.error_traceback.endswith("ValueError: bad batch in epoch 1\n")
    non_dict = jobs[NOT_A_DICT]
    assert non_dict.attempts == 1  # returning a non-dict is not retried
    assert "returned list" in non_dict.error_message and "must return a dict" in (
        non_dict.error_message
    )
    statuses = [c.validation_status for c in registry.checkpoints(run)]
    assert statuses == ["VALIDATED" if i in VALIDATED else "FAILED" for i in range(EPOCHS)]
    assert len(registry.best_checkpoints(run, "accuracy", k=10)) == len(VALIDATED)


def report_a_missing_then_a_real_checkpoint(config):
    import ray.train

    import trainer_integration
    from validation_service.errors import CheckpointNotFound

    context = ray.train.get_context()
    run = context.get_experiment_name()
    if context.get_world_rank() != 0:
        report({}, None)
        report({}, None)
        return
    # Importing trainer_integration set rank 0's reporter up on a thread, writing nothing.
    deadline = time.monotonic() + 60
    while run not in trainer_integration._client._reporters and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run in trainer_integration._client._reporters
    missing = ray.train.Checkpoint.from_directory(os.path.join(config["home"], "no-such-dir"))
    try:
        report({"step": 0}, missing, validate_fn=validate_digits)
    except CheckpointNotFound:
        pass
    else:
        raise AssertionError("a missing checkpoint folder was reported without an error")
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(make_model().state_dict(), os.path.join(tmp, "model.pt"))
        report({"step": 1}, ray.train.Checkpoint.from_directory(tmp), validate_fn=validate_digits)


def test_a_checkpoint_that_cannot_be_stored_raises_on_rank_0_and_training_goes_on(
    service, session_home, unique_run
):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    result = TorchTrainer(
        report_a_missing_then_a_real_checkpoint,
        train_loop_config={"home": str(session_home)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=unique_run, storage_path=str(session_home / "ray_results")),
    ).fit()
    assert result.error is None  # rank 1 was not left waiting in the failed report
    registry = Registry()
    registry.wait(unique_run, timeout_s=120)
    records = registry.checkpoints(unique_run)
    # The refused report is its step left INCOMPLETE (rank 0's part failed, naming it), never
    # listed nor validated; the next report is the run's one checkpoint.
    [refused] = registry.incomplete_checkpoints(unique_run)
    assert refused.status is AssemblyStatus.INCOMPLETE and "rank 0" in refused.detail
    assert [(r.report_index, r.reported_metrics["step"]) for r in records] == [(1, 1)]
    assert refused.report_index == 0
    assert records[0].validation_status == "VALIDATED"
    assert [m["step"] for _, m in result.best_checkpoints] == [1]


def test_ray_train_local_mode_gets_the_stored_checkpoint(
    service, session_home, unique_run, monkeypatch
):
    """num_workers=0 runs the loop in this process, and Ray Train copies nothing."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.execution import train_fn_utils

    # Local mode leaves its train context set in this process after fit(); put it back
    # afterwards, or later report() calls here would think they run inside Ray Train.
    monkeypatch.setattr(train_fn_utils, "_train_fn_utils", train_fn_utils._train_fn_utils)

    def one_report():
        import ray.train

        with tempfile.TemporaryDirectory() as tmp:
            torch.save(make_model().state_dict(), os.path.join(tmp, "model.pt"))
            report(
                {"step": 0}, ray.train.Checkpoint.from_directory(tmp), validate_fn=validate_digits
            )

    result = TorchTrainer(
        one_report,
        scaling_config=ScalingConfig(num_workers=0),
        run_config=RunConfig(name=unique_run, storage_path=str(session_home / "ray_results")),
    ).fit()
    registry = Registry()
    registry.wait(unique_run, timeout_s=120)
    [record] = registry.checkpoints(unique_run)
    assert record.validation_status == "VALIDATED"
    assert result.checkpoint.path == record.uri  # the stored files, still there
    assert os.path.exists(os.path.join(result.checkpoint.path, "model.pt"))
    assert resolve_checkpoint(result.checkpoint).path == record.uri
