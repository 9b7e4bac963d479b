"""Swapping in ckval's report() leaves Ray Train's fault tolerance and collectives as they
were: each case is the same program run with Ray's own report and with ckval's.

- A worker fails once after its report of epoch 2 (FailureConfig(max_failures=1)): the
  restarted workers resume through ``ray.train.get_checkpoint()`` at the same epoch as
  Ray's own run, from the model files (not ckval's pointer), and end with the same
  weights; SYNC and ASYNC, ckval's ``validate_fn`` form and the drop-in's ``validation=``,
  and ckval imported by the worker before its train context (the config carries it).
- Every rank reports its own folder, then calls ``ray.train.collective.barrier()`` and
  ``broadcast_from_rank_zero``: every rank gets rank 0's value at every step.
- One rank's folder is missing at one step: its report() raises, the run goes on, and that
  step is INCOMPLETE: never validated, never the latest, never resumed from.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import cloudpickle
import pytest
import ray.cloudpickle
import torch

from trainer_integration import resolve_checkpoint
from validation_service.errors import CkvalError
from validation_service.registry.registry import Registry

pytestmark = pytest.mark.ray

cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

EPOCHS = 5
FAIL_AFTER_EPOCH = 2


def model_accuracy(checkpoint, **kwargs) -> dict:
    """The validation: the stored model's weight sum (any number would do)."""
    with checkpoint.as_directory() as directory:
        state = torch.load(os.path.join(directory, "model.pt"))
    return {"val_sum": float(sum(v.sum() for v in state["model"].values()))}


def model_accuracy_with_config(checkpoint, config) -> dict:
    return model_accuracy(checkpoint)


def train_resumable(config) -> None:
    """Ray's guides' resume pattern: load model.pt from ray.train.get_checkpoint(), train
    on from the epoch after it; rank 1 fails once, 2 s after its report of epoch 2."""
    import ray.train
    from ray.train import Checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    rank = ray.train.get_context().get_world_rank()
    marks = config["marks"]
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            files = sorted(os.listdir(checkpoint_dir))
            state = torch.load(os.path.join(checkpoint_dir, "model.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
        with open(os.path.join(marks, f"resumed-{rank}.json"), "w") as f:
            json.dump({"start": start, "files": files}, f)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator)
    for epoch in range(start, EPOCHS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        folder = tempfile.mkdtemp(dir=marks)
        checkpoint = None
        if rank == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save({**state, "epoch": epoch}, os.path.join(folder, "model.pt"))
            checkpoint = Checkpoint.from_directory(folder)
        _report(config, {"epoch": epoch, "loss": loss.item()}, checkpoint)
        failed = os.path.join(marks, "failed")
        if rank == 1 and epoch == FAIL_AFTER_EPOCH and not os.path.exists(failed):
            time.sleep(2)
            open(failed, "w").close()
            raise RuntimeError("a worker fails once")
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(marks, "final.pt"))


def _report(config, metrics, checkpoint) -> None:
    import ray.train

    mode = ray.train.CheckpointUploadMode[config["mode"]]
    if config["how"] == "ray":
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=mode)
        return
    from trainer_integration import report

    report = config.get("report", report)
    if config["how"] == "dropin":
        report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=mode, validation=True)
    else:
        validate = model_accuracy_with_config if checkpoint is not None else None
        report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=mode, validate_fn=validate)


def fit_resumable(how: str, mode: str, run: str, storage: str, marks: str):
    import ray.train
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    kwargs, config = {}, {"how": how, "mode": mode, "marks": marks}
    if how.endswith("-in-config"):
        # The config carries ckval (its report, as a user's helpers or callbacks would):
        # a worker imports trainer_integration as it unpickles the config, before Ray
        # Train gives it its train context.
        import trainer_integration

        how = how.removesuffix("-in-config")
        config.update(how=how, report=trainer_integration.report)
    if how == "dropin":
        from trainer_integration import TorchTrainer

        kwargs["validation_config"] = ray.train.ValidationConfig(model_accuracy)
    else:
        from ray.train.torch import TorchTrainer
    return TorchTrainer(
        train_resumable,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=run, storage_path=storage, failure_config=FailureConfig(max_failures=1)
        ),
        **kwargs,
    ).fit()


def _resumed(marks: str) -> dict:
    found = {}
    for rank in (0, 1):
        with open(os.path.join(marks, f"resumed-{rank}.json")) as f:
            found[rank] = json.load(f)
    return found


@pytest.fixture(scope="module")
def rays_own_runs(ray_session, session_home, tmp_path_factory):
    """Ray's own report in the same program, SYNC and ASYNC: where its restarts resume
    and the weights they end with."""
    runs = {}
    for mode in ("SYNC", "ASYNC"):
        marks = str(tmp_path_factory.mktemp(f"ray-{mode}"))
        fit_resumable("ray", mode, f"ft-ray-{mode.lower()}", str(session_home / "ray"), marks)
        runs[mode] = (_resumed(marks), torch.load(os.path.join(marks, "final.pt")))
    return runs


@pytest.mark.parametrize(
    ("how", "mode"),
    [
        ("ckval", "SYNC"),
        ("ckval", "ASYNC"),
        ("dropin", "SYNC"),
        # The drop-in's ASYNC run with ckval in the config: one run for both.
        ("dropin-in-config", "ASYNC"),
    ],
)
def test_a_restarted_worker_resumes_where_rays_own_run_resumes_from_the_model_files(
    service, rays_own_runs, session_home, tmp_path, unique_run, how, mode
):
    ray_resumed, ray_final = rays_own_runs[mode]
    assert ray_resumed[0]["start"] == ray_resumed[1]["start"] == FAIL_AFTER_EPOCH + 1

    result = fit_resumable(how, mode, unique_run, str(session_home / "ray"), str(tmp_path))

    resumed = _resumed(str(tmp_path))
    assert {rank: r["start"] for rank, r in resumed.items()} == {
        rank: r["start"] for rank, r in ray_resumed.items()
    }
    # The model files, found by name as the guides load them, not ckval's pointer.
    assert all("model.pt" in r["files"] for r in resumed.values()), resumed
    final = torch.load(os.path.join(tmp_path, "final.pt"))
    assert all(torch.equal(final[k], ray_final[k]) for k in ray_final)
    # ckval validated every reported checkpoint, across the restart.
    registry = Registry()
    registry.wait(unique_run, timeout_s=120)
    records = registry.checkpoints(unique_run)
    assert [r.reported_metrics["epoch"] for r in records] == list(range(EPOCHS))
    assert all(r.validation_status == "VALIDATED" for r in records), records
    assert "val_sum" in records[-1].metrics
    # Ray Train's result still lists them, each resolving to ckval's stored copy.
    assert resolve_checkpoint(result.checkpoint).path == records[-1].uri


def sharded_steps_with_collectives(config) -> None:
    """Every rank reports its own folder, then the ranks' own collectives; rank 1's folder
    is missing at step ``config['missing_at']`` (its report raises; the run goes on)."""
    import ray.train
    from ray.train import Checkpoint
    from ray.train.collective import barrier, broadcast_from_rank_zero

    rank = ray.train.get_context().get_world_rank()
    seen, raised = [], []
    for step in range(config["steps"]):
        folder = tempfile.mkdtemp(dir=config["scratch"])
        with open(os.path.join(folder, f"shard-{rank}.json"), "w") as f:
            json.dump({"step": step, "rank": rank}, f)
        if rank == 1 and step == config.get("missing_at"):
            folder = os.path.join(folder, "never-written")
        metrics = {"step": step}
        checkpoint = Checkpoint.from_directory(folder)
        try:
            if config["how"] == "ray":
                ray.train.report(metrics, checkpoint=checkpoint)
            else:
                from trainer_integration import report

                report(metrics, checkpoint=checkpoint, validate_fn=count_shards)
        except CkvalError as exc:
            raised.append((step, str(exc)))
        barrier()
        seen.append(broadcast_from_rank_zero({"step": step, "from": rank}))
    with open(os.path.join(config["scratch"], f"seen-{rank}.json"), "w") as f:
        json.dump({"seen": seen, "raised": raised}, f)


def count_shards(checkpoint, config) -> dict:
    with checkpoint.as_directory() as directory:
        return {"shards": float(len([n for n in os.listdir(directory) if n.startswith("shard")]))}


def fit_sharded(how: str, run: str, storage: str, scratch: str, **config):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        sharded_steps_with_collectives,
        train_loop_config={"how": how, "scratch": scratch, "steps": 4, **config},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=run, storage_path=storage),
    ).fit()


def _seen(scratch: str) -> dict:
    found = {}
    for rank in (0, 1):
        with open(os.path.join(scratch, f"seen-{rank}.json")) as f:
            found[rank] = json.load(f)
    return found


@pytest.fixture(scope="module")
def sharded_run(service, session_home, tmp_path_factory):
    """One ckval run of the sharded program with rank 1's folder missing at step 1, and
    Ray's own run of it without the missing folder (Ray Train cannot go on after a failed
    upload: its next report waits for the one that never came)."""
    storage = str(session_home / "ray")
    ray_scratch = str(tmp_path_factory.mktemp("sharded-ray"))
    fit_sharded("ray", "sharded-ray", storage, ray_scratch)
    scratch = str(tmp_path_factory.mktemp("sharded-ckval"))
    run = f"sharded-ckval-{os.getpid()}"
    result = fit_sharded("ckval", run, storage, scratch, missing_at=1)
    return run, result, _seen(scratch), _seen(ray_scratch)


def test_the_users_collectives_pair_with_each_other_as_with_rays_own_report(sharded_run):
    _, _, seen, ray_seen = sharded_run
    expected = [{"step": step, "from": 0} for step in range(4)]
    assert [ray_seen[rank]["seen"] for rank in (0, 1)] == [expected, expected]
    assert [seen[rank]["seen"] for rank in (0, 1)] == [expected, expected]


def test_a_rank_whose_part_fails_leaves_its_step_incomplete_and_the_run_goes_on(sharded_run):
    run, result, seen, _ = sharded_run
    # Rank 1's report of step 1 raised, naming the rank; nobody else's did.
    [(step, message)] = seen[1]["raised"]
    assert step == 1 and "rank 1" in message
    assert seen[0]["raised"] == []
    registry = Registry()
    registry.wait(run, timeout_s=120)
    records = registry.checkpoints(run)
    assert [r.reported_metrics["step"] for r in records] == [0, 2, 3]
    assert [r.metrics["shards"] for r in records] == [2.0, 2.0, 2.0]  # both ranks' files
    assert len(registry.validations(run)) == 3  # step 1 was never validated
    [incomplete] = registry.incomplete_checkpoints(run)
    assert incomplete.status.value == "INCOMPLETE" and "rank 1" in incomplete.detail
    assert registry.latest_checkpoint(run).path == records[-1].uri
    # Ray Train's checkpoint of step 1 resolves to the checkpoint before it: never resumed
    # from a partial one.
    by_step = {m["step"]: c for c, m in result.best_checkpoints}
    assert resolve_checkpoint(by_step[1]).path == records[0].uri
    # Its partial files are removed by retention.
    registry.apply_retention(run, metric="shards", keep_best_per_run=10, keep_latest=10)
    assert not os.path.exists(incomplete.uri)


ACCURACY_BY_EPOCH = [0.5, 0.9, 0.3, 0.8, 0.4]


def accuracy_of_epoch(checkpoint, config) -> dict:
    with checkpoint.as_directory() as directory:
        with open(os.path.join(directory, "epoch.json")) as f:
            return {"val_acc": ACCURACY_BY_EPOCH[json.load(f)["epoch"]]}


def report_every_epoch(config) -> None:
    import ray.train

    from trainer_integration import report

    for epoch in range(len(ACCURACY_BY_EPOCH)):
        folder = tempfile.mkdtemp(dir=config["scratch"])
        with open(os.path.join(folder, "epoch.json"), "w") as f:
            json.dump({"epoch": epoch}, f)
        checkpoint = ray.train.Checkpoint.from_directory(folder)
        report({"epoch": epoch}, checkpoint, validate_fn=accuracy_of_epoch)


def test_checkpoint_config_num_to_keep_keeps_the_best_by_the_validated_metric(
    service, session_home, unique_run, tmp_path
):
    """CheckpointConfig(num_to_keep=2, checkpoint_score_attribute=<a validated metric>):
    Ray Train never sees the validated metric; ckval keeps the 2 best of its copies by it
    once validated, and the latest, as Ray Train would keep them."""
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        report_every_epoch,
        train_loop_config={"scratch": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(
            name=unique_run,
            storage_path=str(session_home / "ray"),
            checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="val_acc"),
        ),
    ).fit()
    registry = Registry()
    registry.wait(unique_run, timeout_s=120)
    everything = registry.checkpoints(unique_run, include_deleted=True)
    assert all(r.validation_status == "VALIDATED" for r in everything)
    kept = [r.reported_metrics["epoch"] for r in registry.checkpoints(unique_run)]
    assert kept == [1, 3, 4]  # the two best (0.9, 0.8) and the latest
    for record in everything:
        assert os.path.exists(record.uri) == (record.reported_metrics["epoch"] in kept)


def test_ray_trains_local_mode_under_torchrun_seals_each_report_from_every_rank(
    service, ray_session, tmp_path, unique_run
):
    """Ray Train's local mode with torchrun's ranks (num_workers=0, world size 2): the
    ranks of one launch find each other and each report becomes one validated checkpoint
    of both ranks' files."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "CKVAL_RAY_ADDRESS": ray_session.get_runtime_context().gcs_address,
        "PYTHONPATH": str(root),
    }
    program = ["tests/local_mode_program.py", unique_run, str(tmp_path)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    finished = subprocess.run(
        [*torchrun, "--nproc-per-node=2", *program],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stderr[-4000:]
    for rank in (0, 1):
        with open(tmp_path / f"rank-{rank}.json") as f:
            assert json.load(f) == {"world_size": 2, "done": [0, 1, 2]}
    registry = Registry()
    registry.wait(unique_run, timeout_s=120)
    records = registry.checkpoints(unique_run)
    assert [r.reported_metrics["step"] for r in records] == [0, 1, 2]
    assert [r.metrics["shards"] for r in records] == [2.0, 2.0, 2.0]
    assert registry.incomplete_checkpoints(unique_run) == []
