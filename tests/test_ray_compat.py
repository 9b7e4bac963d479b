"""The contract with Ray's internals (validation_service/_ray_compat.py), and the report
path without them. That no other module names them is a code rule (tests/test_code_rules.py).

An incompatible Ray release fails here, in one clear test naming what changed, rather
than in a training run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
import ray.cloudpickle
import ray.train

from trainer_integration import CheckpointUploadMode, report, resolve_checkpoint
from validation_service import _ray_compat
from validation_service.registry.registry import Registry

cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROOT = Path(__file__).resolve().parent.parent


def test_every_ray_internal_ckval_names_exists_in_this_ray():
    missing = _ray_compat.missing_internals()
    assert missing == [], "this Ray release lacks what ckval uses: " + "; ".join(
        f"{m.module}.{m.name} (ckval knows it in {m.releases}; without it: {m.missing})"
        for m in missing
    )


@pytest.mark.ray
def test_the_head_node_has_the_resource_that_pins_the_first_replica(ray_session):
    assert _ray_compat.HEAD_NODE_RESOURCE in ray_session.cluster_resources()
    (head,) = ray_session.nodes()
    assert _ray_compat.HEAD_NODE_RESOURCE in head["Resources"]


def test_the_internals_switch_turns_the_workers_internals_off(monkeypatch):
    monkeypatch.setenv(_ray_compat.INTERNALS_VAR, "0")
    assert not _ray_compat.internals_enabled()
    assert _ray_compat.run_checkpoint_config() is None
    monkeypatch.setenv(_ray_compat.INTERNALS_VAR, "1")
    assert _ray_compat.internals_enabled()
    assert _ray_compat.worker_train_context() is None  # not in a Ray Train worker
    assert _ray_compat.run_checkpoint_config() is None


def look_at_the_worker_internals(config) -> None:
    """What ckval reads of a Ray Train worker: its RunConfig's CheckpointConfig, and the
    checkpoint ray.train.get_checkpoint() gives once followed (however it was imported)."""
    from ray.train import get_checkpoint  # bound before ckval follows it

    checkpoint_config = _ray_compat.run_checkpoint_config()
    _ray_compat.follow_resume_checkpoint(lambda held: {"followed": held is None})
    _ray_compat.follow_resume_checkpoint(lambda held: {"followed": "again"})  # replaces it
    seen = {
        "num_to_keep": checkpoint_config.num_to_keep,
        "attribute": checkpoint_config.checkpoint_score_attribute,
        "public": ray.train.get_checkpoint(),
        "imported": get_checkpoint(),
    }
    with open(os.path.join(config["scratch"], "seen.json"), "w") as f:
        json.dump(seen, f)


@pytest.mark.ray
def test_a_workers_checkpoint_config_is_read_and_its_get_checkpoint_followed(
    ray_session, session_home, unique_run, tmp_path
):
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    DataParallelTrainer(
        look_at_the_worker_internals,
        train_loop_config={"scratch": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(
            name=unique_run,
            storage_path=str(session_home / "ray_results"),
            checkpoint_config=CheckpointConfig(num_to_keep=3, checkpoint_score_attribute="acc"),
        ),
    ).fit()
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {
        "num_to_keep": 3,
        "attribute": "acc",
        "public": {"followed": "again"},
        "imported": {"followed": "again"},
    }


# ----------------------------------------------------------- without the internals
def _write_checkpoint(scratch: str, step: int) -> str:
    import tempfile

    directory = tempfile.mkdtemp(prefix=f"step-{step}-", dir=scratch)
    with open(os.path.join(directory, "state.json"), "w") as f:
        json.dump({"step": step}, f)
    return directory


def report_without_internals(config) -> None:
    """Every report through Ray Train's public API only; returns right after the last."""
    import threading

    import trainer_integration

    os.environ[_ray_compat.INTERNALS_VAR] = "0"
    assert _ray_compat.run_checkpoint_config() is None  # the public fallbacks only
    context = ray.train.get_context()
    rank = context.get_world_rank()
    for step, mode in enumerate(config["modes"]):
        mode = CheckpointUploadMode[mode]
        if rank == 0:
            directory = _write_checkpoint(config["scratch"], step)
            copy_may_start = threading.Event()
            failing = step == config.get("fail_at")
            if failing:  # the copy starts once a file report() listed is gone: it fails
                reporter = trainer_integration._client._reporters[context.get_experiment_name()]
                reporter._thread("store").submit(copy_may_start.wait, 120)
            report({"step": step}, ray.train.Checkpoint.from_directory(directory), **_opts(mode))
            if failing:
                os.remove(os.path.join(directory, "state.json"))
                copy_may_start.set()
        else:
            report({"step": step}, None, checkpoint_upload_mode=mode)


def _opts(mode: CheckpointUploadMode) -> dict:
    return {"checkpoint_upload_mode": mode, "validate_fn": "json:dumps"}


def _fit_without_internals(run: str, session_home, scratch, workers: int = 2, **config):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    return DataParallelTrainer(
        report_without_internals,
        train_loop_config={"scratch": str(scratch), **config},
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(name=run, storage_path=str(session_home / "ray_results")),
    ).fit()


@pytest.mark.ray
def test_without_ray_internals_reports_arrive_in_order_and_none_is_lost(
    ray_session, session_home, unique_run, tmp_path
):
    modes = ["SYNC", "ASYNC", "SYNC", "ASYNC", "ASYNC"]
    result = _fit_without_internals(unique_run, session_home, tmp_path, modes=modes)
    records = Registry().checkpoints(unique_run)
    assert [(r.report_index, r.reported_metrics["step"]) for r in records] == [
        (i, i) for i in range(len(modes))
    ]
    assert [m["step"] for _, m in result.best_checkpoints] == list(range(len(modes)))
    for record, (pointer, _) in zip(records, result.best_checkpoints, strict=True):
        assert resolve_checkpoint(pointer).path == record.uri


@pytest.mark.ray
def test_without_ray_internals_a_failed_copy_fails_the_run(
    ray_session, session_home, unique_run, tmp_path
):
    # One worker: an ASYNC report must return before its copy for the copy to be made to
    # fail.
    with pytest.raises(ray.train.TrainingFailedError, match="No such file.*state.json"):
        _fit_without_internals(
            unique_run, session_home, tmp_path, workers=1, modes=["SYNC", "ASYNC"], fail_at=1
        )
    assert [r.report_index for r in Registry().checkpoints(unique_run)] == [0]


def test_ckval_imports_with_ray_train_internals_missing(tmp_path):
    """A Ray without Ray Train's internals: importing and reporting outside Ray Train still
    work; RunStatusCallback says what is missing."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.startswith('ray.train.v2._internal'):\n"
        "            raise ImportError(f'blocked {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    code = (
        "import trainer_integration\n"
        "from validation_service import _ray_compat\n"
        "assert _ray_compat.worker_train_context() is None\n"
        "assert _ray_compat.run_checkpoint_config() is None\n"
        "try:\n"
        "    trainer_integration.RunStatusCallback\n"
        "except ImportError as exc:\n"
        "    print('refused:', exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "refused: trainer_integration.RunStatusCallback needs Ray Train's" in out


def _keyword_metrics(checkpoint, scale: int = 1, offset: int = 0) -> dict:
    return {"checkpoint": checkpoint, "value": scale * 10 + offset}


def test_native_validation_is_spelled_as_this_rays_report_and_trainer_take_it():
    import inspect

    from ray.train.torch import TorchTrainer

    native = _ray_compat.native_validation(_keyword_metrics, {"scale": 2}, {"num_cpus": 1})
    report_parameters = inspect.signature(ray.train.report).parameters
    trainer_parameters = inspect.signature(TorchTrainer.__init__).parameters
    assert set(native.report_kwargs) <= set(report_parameters)
    assert set(native.trainer_kwargs) <= set(trainer_parameters)
    if _ray_compat.report_takes_validation():  # Ray 2.54+
        assert native.report_kwargs == {"validation": True}
        config = native.trainer_kwargs["validation_config"]
        assert config.task_config.fn_kwargs == {"scale": 2}
        assert config.ray_remote_kwargs == {"num_cpus": 1}
    else:  # Ray 2.51-2.53: fn(checkpoint, config) calls fn(checkpoint, **fn_kwargs)
        assert native.trainer_kwargs == {}
        validate_fn = ray.cloudpickle.loads(
            ray.cloudpickle.dumps(native.report_kwargs["validate_fn"])
        )
        config = native.report_kwargs["validate_config"]
        assert validate_fn("ckpt", config) == {"checkpoint": "ckpt", "value": 20}


def test_logging_config_is_given_only_where_run_config_takes_it():
    import inspect

    kwargs = _ray_compat.logging_config_kwargs("WARNING")
    takes = "logging_config" in inspect.signature(ray.train.RunConfig.__init__).parameters
    assert set(kwargs) == ({"logging_config"} if takes else set())
    run_config = ray.train.RunConfig(name="logging", **kwargs)
    if takes:
        assert run_config.logging_config.log_level == "WARNING"


def test_data_execution_options_are_a_copy_with_the_users_limits_kept():
    from ray.data import ExecutionOptions, ExecutionResources

    from validation_service.validators.torch_trainer import ExactSplitDataConfig

    default = _ray_compat.data_execution_options(ExactSplitDataConfig(), "eval")
    assert isinstance(default, ExecutionOptions)
    users = ExecutionOptions(resource_limits=ExecutionResources(cpu=3))
    resolved = _ray_compat.data_execution_options(
        ExactSplitDataConfig(execution_options=users), "eval"
    )
    assert resolved is not users
    assert resolved.resource_limits.cpu == 3
    resolved.resource_limits = ExecutionResources(cpu=1)  # the caller's to change
    assert users.resource_limits.cpu == 3


@pytest.mark.ray
def test_a_cluster_without_an_autoscaler_is_told_from_one_with_it(ray_session):
    """The session's Ray has no autoscaling config: its monitor only mirrors the nodes
    (node types named node_<id>), and no autoscaler reported a cluster config. The
    fake autoscaler's "v1" is checked in tests/test_clusters.py."""
    import time

    deadline = time.monotonic() + 60
    while (kind := _ray_compat.autoscaler_kind()) is None and time.monotonic() < deadline:
        time.sleep(0.5)  # the monitor's first report comes within seconds of the start
    assert kind == "none"
    assert _ray_compat.autoscaler_node_types() is None
