"""report() inside Ray Train never waits for Ray Train's result queue, and loses nothing."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import pytest
import ray.cloudpickle
import ray.train

from trainer_integration import CheckpointUploadMode, report, resolve_checkpoint
from validation_service.registry.registry import Registry

pytestmark = pytest.mark.ray

cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# How many Ray Train runs the flush test starts side by side, SYNC and ASYNC in turn:
# CKVAL_FLUSH_TEST_RUNS=50 for the full check. The suite's check is the program-order test
# below (its train function returns right after a last report of ckval's, in both modes).
FLUSH_TEST_RUNS = int(os.environ.get("CKVAL_FLUSH_TEST_RUNS", "0"))


def write_checkpoint(step: int, scratch: str | None = None) -> str:
    directory = tempfile.mkdtemp(prefix=f"step-{step}-", dir=scratch)
    with open(os.path.join(directory, "state.json"), "w") as f:
        json.dump({"step": step, "pad": "x" * 1000}, f)
    return directory


def read_step(checkpoint, config) -> dict:
    with checkpoint.as_directory() as directory:
        with open(os.path.join(directory, "state.json")) as f:
            return {"validated_step": json.load(f)["step"] * config["scale"]}


def report_and_return(config) -> None:
    """Reports and returns at once after the last report, as many train functions do."""
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    mode = CheckpointUploadMode[config["mode"]]
    for step in range(config["reports"]):
        if rank == 0:
            directory = write_checkpoint(step, config.get("scratch"))
            report(
                {"step": step},
                ray.train.Checkpoint.from_directory(directory),
                checkpoint_upload_mode=mode,
                validate_fn=config.get("validate_fn"),
                validate_config={"scale": 10},
            )
            if mode is CheckpointUploadMode.SYNC:
                # SYNC: ckval's copy is done, so the folder may go at once.
                assert os.path.exists(directory)
        else:
            # The same validation arguments on the rank without a checkpoint: ignored
            # there (no error, no job), as every rank may pass them.
            report(
                {"step": step},
                None,
                checkpoint_upload_mode=mode,
                validate_fn=config.get("validate_fn"),
                validate_config={"scale": 10},
            )


def trainer(run: str, storage: str, **config):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    return DataParallelTrainer(
        report_and_return,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=run, storage_path=storage),
    )


@pytest.mark.skipif(
    FLUSH_TEST_RUNS == 0,
    reason="the many-runs form of the flush check: set CKVAL_FLUSH_TEST_RUNS (e.g. 50); "
    "test_ckvals_reports_and_direct_ray_train_reports_keep_program_order checks one run a mode",
)
@pytest.mark.timeout(max(600, 40 * FLUSH_TEST_RUNS))
def test_no_report_is_lost_when_the_train_function_returns_right_after_it(
    ray_session, session_home, unique_run, monkeypatch
):
    """Ray Train finishes a run as soon as its controller sees the workers done; the last
    registrations are flushed before that, whatever the mode."""
    # The controller looks at the workers every 0.1 s instead of 2 s: the window between
    # the last report and the workers' end is as short as Ray Train allows.
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    storage = str(session_home / "ray_results")
    modes = ["SYNC", "ASYNC"]

    def one(i: int) -> tuple[str, str]:
        run = f"{unique_run}-{i}"
        result = trainer(run, storage, reports=2, mode=modes[i % 2]).fit()
        return run, result

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(FLUSH_TEST_RUNS)))
    registry = Registry()
    lost = []
    for run, result in results:
        records = registry.checkpoints(run)
        if [(r.report_index, r.reported_metrics["step"]) for r in records] != [(0, 0), (1, 1)]:
            lost.append((run, [(r.report_index, r.reported_metrics) for r in records]))
        assert len(result.best_checkpoints) == 2  # Ray Train got its pointers too
    assert lost == [], f"{len(lost)} of {FLUSH_TEST_RUNS} runs lost registrations: {lost}"


def test_async_reports_in_ray_train_are_validated_in_order_and_resolve(
    service, session_home, unique_run, tmp_path
):
    """ASYNC: Ray Train lists every pointer in report order, each resolves to ckval's
    stored copy, every checkpoint is validated, and the folders go once copied."""
    storage = str(session_home / "ray_results")
    result = trainer(
        unique_run,
        storage,
        reports=4,
        mode="ASYNC",
        validate_fn=read_step,
        scratch=str(tmp_path),
    ).fit()
    registry = Registry()
    registry.wait(unique_run, timeout_s=180)
    records = registry.checkpoints(unique_run)
    assert [r.report_index for r in records] == [0, 1, 2, 3]
    assert [r.metrics["validated_step"] for r in records] == [0, 10, 20, 30]
    # One job a checkpoint: rank 1's validate_fn without a checkpoint made none.
    assert [job.report_index for job in registry.validations(unique_run)] == [0, 1, 2, 3]
    assert [metrics["step"] for _, metrics in result.best_checkpoints] == [0, 1, 2, 3]
    for record, (pointer, _) in zip(records, result.best_checkpoints, strict=True):
        resolved = resolve_checkpoint(pointer)
        assert resolved.path == record.uri
        with resolved.as_directory() as directory:
            with open(os.path.join(directory, "state.json")) as f:
                assert json.load(f)["step"] == record.report_index
    # Every reported folder was deleted once copied, as Ray Train does in ASYNC mode.
    assert os.listdir(tmp_path) == []


def file_gone_at_step_one(config) -> None:
    import threading

    import ray.train

    import trainer_integration

    context = ray.train.get_context()
    rank = context.get_world_rank()
    for step in range(3):
        if rank == 0:
            directory = write_checkpoint(step)
            copy_may_start = threading.Event()
            if step == 1:
                # The copy of step 1 starts only once a file that report() listed is
                # gone: the copy fails, as a folder changed under an ASYNC upload does.
                reporter = trainer_integration._client._reporters[context.get_experiment_name()]
                reporter._thread("store").submit(copy_may_start.wait, 120)
            report(
                {"step": step},
                ray.train.Checkpoint.from_directory(directory),
                checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
            )
            if step == 1:
                os.remove(os.path.join(directory, "state.json"))
                copy_may_start.set()
        else:
            report({"step": step}, None, checkpoint_upload_mode=CheckpointUploadMode.ASYNC)


def test_an_async_copy_that_fails_fails_the_run_as_ray_trains_own_upload_does(
    ray_session, session_home, unique_run
):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    with pytest.raises(ray.train.TrainingFailedError, match="No such file.*state.json"):
        DataParallelTrainer(
            file_gone_at_step_one,
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name=unique_run, storage_path=str(session_home / "ray_results")),
        ).fit()
    records = {r.report_index: r for r in Registry().checkpoints(unique_run)}
    assert records[0].reported_metrics["step"] == 0  # acknowledged before: kept
    assert 1 not in records  # never stored, never registered


def report_in_storage(config) -> None:
    """NO_UPLOAD: the checkpoint is written straight into ckval's storage."""
    import ray.train

    from validation_service.config import get_settings

    rank = ray.train.get_context().get_world_rank()
    root = os.path.join(get_settings().resolved_storage(), "default", config["run"])
    for step in range(2):
        if rank == 0:
            directory = os.path.join(root, f"written-in-place-{step}")
            os.makedirs(directory)
            with open(os.path.join(directory, "state.json"), "w") as f:
                json.dump({"step": step}, f)
            report(
                {"step": step},
                ray.train.Checkpoint.from_directory(directory),
                checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
                validate_fn=read_step,
                validate_config={"scale": 10},
            )
        else:
            report({"step": step}, None)


def test_no_upload_reports_in_ray_train_are_registered_where_they_are(
    service, session_home, unique_run
):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    result = DataParallelTrainer(
        report_in_storage,
        train_loop_config={"run": unique_run},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=unique_run, storage_path=str(session_home / "ray_results")),
    ).fit()
    registry = Registry()
    registry.wait(unique_run, timeout_s=120)
    records = registry.checkpoints(unique_run)
    assert [r.uri.rsplit("/", 1)[-1] for r in records] == [
        "written-in-place-0",
        "written-in-place-1",
    ]
    assert [r.metrics["validated_step"] for r in records] == [0, 10]
    resolved = [resolve_checkpoint(c).path for c, _ in result.best_checkpoints]
    assert resolved == [r.uri for r in records]


def ckval_and_direct_reports(config) -> None:
    """Each rank mixes ckval's report() with direct ray.train.report() calls, which reach
    Ray Train in program order (ckval's is the same ray.train.report call, on the
    training thread); then one more report of ckval's, and the function returns at once
    (Ray Train ends the run as soon as its controller sees the workers done)."""
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    mode = CheckpointUploadMode[config["mode"]]
    for step in range(3):
        if rank == 0:
            report(
                {"step": step, "by": "ckval"},
                ray.train.Checkpoint.from_directory(write_checkpoint(step)),
                checkpoint_upload_mode=mode,
            )
            direct = write_checkpoint(100 + step)
            ray.train.report(
                {"step": step, "by": "direct"}, ray.train.Checkpoint.from_directory(direct)
            )
        else:
            report({"step": step, "by": "ckval"}, None)
            ray.train.report({"step": step, "by": "direct"})
    last = {"step": 3, "by": "ckval"}
    if rank == 0:
        report(
            last,
            ray.train.Checkpoint.from_directory(write_checkpoint(3)),
            checkpoint_upload_mode=mode,
        )
    else:
        # The validation arguments on the rank without a checkpoint: ignored there (no
        # error, no job), as every rank may pass them.
        report(last, None, checkpoint_upload_mode=mode, validate_fn=read_step)


@pytest.mark.parametrize("mode", ["SYNC", "ASYNC"])
def test_ckvals_reports_and_direct_ray_train_reports_keep_program_order(
    ray_session, session_home, unique_run, tmp_path, mode
):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    run = f"{unique_run}-{mode.lower()}"
    result = DataParallelTrainer(
        ckval_and_direct_reports,
        train_loop_config={"scratch": str(tmp_path), "mode": mode},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=run, storage_path=str(session_home / "ray_results")),
    ).fit()
    reported = [(m["step"], m["by"]) for _, m in result.best_checkpoints]
    assert reported == [(s, by) for s in range(3) for by in ("ckval", "direct")] + [(3, "ckval")]
    # No registration was lost, the last one included: each is flushed before the
    # function's return lets Ray Train end the run.
    records = Registry().checkpoints(run)
    assert [(r.report_index, r.reported_metrics["step"]) for r in records] == [
        (i, i) for i in range(4)
    ]
    assert result.metrics == {"step": 3, "by": "ckval"}
