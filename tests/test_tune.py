"""Ray Tune on validated metrics: trainer_integration.tune.TuneReportCallback.

One ASHA search (4 trials: two learning rates that learn, two that stay at chance; 1 Ray
Train worker each, epochs of ~2 s, validations of 0.5 s) is run once and checked for
several things: the poor trials are stopped while they train, on their validated
accuracy; Tune's rows carry exactly the registry's validated values, in epoch order; the
stopped trials leave no Ray Train controller and no job RUNNING, and their checkpoints
keep their validations; the runs carry their trial as run tags. MedianStoppingRule and
HyperBand each get a smaller search. The callback's own rules (report order, what is
held back, one warning per trial) are checked without Ray.
"""

from __future__ import annotations

import json
import uuid

import pytest
from ray.tune.schedulers import ASHAScheduler, HyperBandScheduler, MedianStoppingRule

from tests.tune_search import GOOD_LRS, POOR_LRS, run_search
from validation_service.registry.registry import Registry

EPOCHS = 8


def _controllers_alive() -> set[str]:
    """The ids of the Ray Train controllers alive in the cluster."""
    from ray._private import state  # tests may read Ray's state; product code may not

    return {
        actor_id
        for actor_id, actor in state.actors().items()
        if actor.get("ActorClassName") == "TrainController" and actor.get("State") == "ALIVE"
    }


def _trial_runs(registry: Registry, experiment: str) -> dict[str, str]:
    """trial id -> ckval run name, for the runs tagged with the experiment."""
    return {
        run.tags["tune_trial_id"]: run.name
        for run in registry.runs()
        if run.tags.get("tune_experiment") == experiment
    }


@pytest.fixture(scope="module")
def asha_search(service, tmp_path_factory):
    name = f"asha-{uuid.uuid4().hex[:6]}"
    scheduler = ASHAScheduler(
        time_attr="epoch", metric="val_acc", mode="max", grace_period=2, max_t=EPOCHS
    )
    storage = str(tmp_path_factory.mktemp("tune"))
    # Controllers of the session's earlier runs (their driver may still hold a handle) are
    # not this search's.
    earlier = _controllers_alive()
    # Two at a time, the good learning rates first: ASHA promotes whichever trial reaches
    # a rung first, so a poor trial ahead of every good one would never be judged.
    grid = run_search(
        scheduler,
        name=name,
        storage_path=storage,
        lrs=GOOD_LRS + POOR_LRS,
        epochs=EPOCHS,
        max_concurrent_trials=2,
    )
    return name, grid, earlier


def test_asha_stops_the_poor_trials_on_their_validated_accuracy(asha_search):
    _, grid, _ = asha_search
    assert not grid.errors
    last_epoch = {r.config["lr"]: int(r.metrics_dataframe["epoch"].max()) for r in grid}
    for lr in POOR_LRS:  # stopped while they still trained
        assert last_epoch[lr] < EPOCHS - 1, last_epoch
    assert max(last_epoch[lr] for lr in GOOD_LRS) == EPOCHS - 1, last_epoch
    best = grid.get_best_result(metric="val_acc", mode="max")
    assert best.config["lr"] in GOOD_LRS
    assert best.metrics["val_acc"] > 0.9


def test_tunes_rows_are_the_registrys_validated_values_in_epoch_order(asha_search):
    name, grid, _ = asha_search
    registry = Registry()
    runs = _trial_runs(registry, name)
    assert len(runs) == 4
    for result in grid:
        frame = result.metrics_dataframe
        assert list(frame["epoch"]) == sorted(frame["epoch"])
        assert set(frame["ckval_validation_status"]) == {"VALIDATED"}
        records = registry.checkpoints(runs[result.metrics["trial_id"]])
        validated = {r.epoch: r.validated_metrics["val_acc"] for r in records}
        assert list(frame["val_acc"]) == [validated[e] for e in frame["epoch"]]
        by_index = {r.report_index: r.uri for r in records}
        assert list(frame["checkpoint_path"]) == [by_index[i] for i in frame["ckval_report_index"]]
        assert {"loss", "epoch"} <= set(frame.columns)  # the report's own metrics too


def test_stopped_trials_leave_no_controller_and_keep_their_validations(asha_search):
    name, _, earlier = asha_search
    assert _controllers_alive() - earlier == set()
    registry = Registry()
    for run in _trial_runs(registry, name).values():
        registry.wait(run, timeout_s=120)
        statuses = {r.validation_status for r in registry.checkpoints(run)}
        assert statuses == {"VALIDATED"}, (run, statuses)
        assert not registry.incomplete_checkpoints(run)


def test_the_search_ranks_across_its_trials_by_run_tags(asha_search):
    name, grid, _ = asha_search
    registry = Registry()
    best = registry.best_checkpoint_records(None, "val_acc", k=3, tags={"tune_experiment": name})
    assert len(best) == 3
    runs = _trial_runs(registry, name)
    good_runs = {runs[r.metrics["trial_id"]] for r in grid if r.config["lr"] in GOOD_LRS}
    assert best[0].run in good_runs and best[0].metrics["val_acc"] > 0.9
    pairs = registry.best_checkpoints(None, "val_acc", k=3, tags={"tune_experiment": name})
    assert [metrics for _, metrics in pairs] == [record.metrics for record in best]
    assert registry.best_checkpoints(None, "val_acc", tags={"tune_experiment": "other"}) == []


def test_median_stopping_rule_on_validated_accuracy(service, tmp_path):
    scheduler = MedianStoppingRule(
        time_attr="epoch", metric="val_acc", mode="max", grace_period=1, min_samples_required=1
    )
    grid = run_search(
        scheduler,
        name=f"median-{uuid.uuid4().hex[:6]}",
        storage_path=str(tmp_path),
        lrs=(GOOD_LRS[0], POOR_LRS[0]),
        epochs=8,
        epoch_s=0.75,
        # The good trial first, to its end: the poor one is then judged against its
        # validated accuracies at every epoch, however late validations land on a loaded
        # machine (side by side, the rule only judges a trial that is not ahead).
        max_concurrent_trials=1,
    )
    assert not grid.errors
    last = {r.config["lr"]: int(r.metrics_dataframe["epoch"].max()) for r in grid}
    # The poor trial is stopped while it trains, on its validated accuracy; the good one
    # trained to its end.
    assert last[POOR_LRS[0]] < 7 and last[GOOD_LRS[0]] == 7, last


def test_hyperband_on_validated_accuracy(service, tmp_path):
    scheduler = HyperBandScheduler(
        time_attr="epoch", metric="val_acc", mode="max", max_t=4, reduction_factor=2
    )
    grid = run_search(
        scheduler,
        name=f"hyperband-{uuid.uuid4().hex[:6]}",
        storage_path=str(tmp_path),
        lrs=(GOOD_LRS[0], POOR_LRS[0]),
        epochs=4,
        epoch_s=1.0,
    )
    assert not grid.errors
    best = grid.get_best_result(metric="val_acc", mode="max")
    assert best.config["lr"] == GOOD_LRS[0]
    for result in grid:
        assert set(result.metrics_dataframe["ckval_validation_status"]) == {"VALIDATED"}


def test_outside_a_tune_session_it_raises_as_rays_does():
    from trainer_integration.tune import TuneReportCallback

    with pytest.raises(RuntimeError, match="must be used in a Tune session"):
        TuneReportCallback()


@pytest.mark.parametrize(
    "options, named",
    [({"validated_only": "yes"}, "validated_only"), ({"poll_interval_s": 0}, "poll_interval_s")],
)
def test_bad_options_are_refused_naming_them(options, named):
    from trainer_integration.tune import TuneReportCallback
    from validation_service.errors import InvalidInput

    with pytest.raises(InvalidInput, match=named):
        TuneReportCallback(**options)


@pytest.mark.parametrize("strict", [True, False])
def test_a_metric_tune_checks_and_no_result_has_is_named_once_per_trial(strict, caplog):
    from trainer_integration._tune_results import TrialLink, TuneResults

    sent: list[dict] = []
    trial = TrialLink("t_00000", "search", checked=("val_acc",), strict=strict)
    results = TuneResults("r", trial, None, sent.append, validated_only=True, poll_interval_s=1)
    base = {"ckval_report_index": 0, "ckval_validation_status": "VALIDATED", "loss": 0.1}
    with caplog.at_level("WARNING", logger="trainer_integration._tune_results"):
        for index in range(3):
            assert results._deliver({**base, "ckval_report_index": index, "acc": 0.9})
        results._deliver({**base, "val_acc": 0.9})
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "'val_acc'" in warnings[0] and "t_00000" in warnings[0]
    # Held back under Tune's strict check (which would end the search); else handed over.
    assert len(sent) == (1 if strict else 4)
    assert sent[-1]["val_acc"] == 0.9


def test_a_tag_filter_matches_a_checkpoints_run_tags(registry):
    ledger = registry.ledger
    for name, search, val_acc in [("a", "s1", 0.7), ("b", "s1", 0.9), ("c", "s2", 0.99)]:
        run_id = ledger.ensure_run(name, storage_root="/tmp/ckval-tags")
        ledger.tag_run(run_id, {"tune_experiment": search, "tune_trial_id": f"{name}_0"})
        ledger.register_checkpoint(
            run_id,
            ledger.reserve_report_index(run_id),
            uri=f"/tmp/ckval-tags/{name}/checkpoint_000000",
            size_bytes=1,
            manifest_sha256=None,
            reported_metrics={"val_acc": val_acc},
        )
    registry.tag("a", 0, "split", "val")  # a checkpoint's own tag still counts
    ranked = registry.best_checkpoint_records(None, "val_acc", k=5, tags={"tune_experiment": "s1"})
    assert [record.run for record in ranked] == ["b", "a"]
    both = {"tune_experiment": "s1", "split": "val"}
    assert [r.run for r in registry.best_checkpoint_records(None, "val_acc", tags=both)] == ["a"]
    assert [r.report_index for r in registry.checkpoints("b", tags={"tune_trial_id": "b_0"})] == [0]
    assert registry.checkpoints("b", tags={"tune_trial_id": "a_0"}) == []


def test_rays_trial_run_names_are_run_names():
    from validation_service.errors import InvalidInput
    from validation_service.names import check_name

    assert check_name("run name", "train-trial_id=3f2a1_00000") == "train-trial_id=3f2a1_00000"
    with pytest.raises(InvalidInput, match="not starting with"):
        check_name("run name", "=x")


def test_the_metrics_tune_checks_are_read_from_the_stored_tuner(tmp_path):
    import types

    import pyarrow.fs
    import ray.tune
    from ray.tune.schedulers import ASHAScheduler

    from validation_service import _ray_compat

    ray.tune.Tuner(
        lambda config: None,
        tune_config=ray.tune.TuneConfig(
            metric="loss", mode="min", scheduler=ASHAScheduler(time_attr="epoch")
        ),
        run_config=ray.tune.RunConfig(name="search", storage_path=str(tmp_path)),
    )
    storage = types.SimpleNamespace(
        experiment_fs_path=str(tmp_path / "search"), storage_filesystem=pyarrow.fs.LocalFileSystem()
    )
    assert _ray_compat.tune_checked_metrics(storage) == ("loss",)
    storage.experiment_fs_path = str(tmp_path / "elsewhere")
    assert _ray_compat.tune_checked_metrics(storage) is None


def _pointer_to(tmp_path, index: int):
    """A checkpoint as Ray Train holds one of ckval's: a pointer to report ``index``."""
    import json

    from ray.train import Checkpoint

    from trainer_integration._ray_train import POINTER_FILE

    folder = tmp_path / f"ray-checkpoint-{index}"
    folder.mkdir()
    pointer = {"run": "r", "report_index": index, "uri": str(folder), "complete": True}
    (folder / POINTER_FILE).write_text(json.dumps(pointer))
    return Checkpoint.from_directory(str(folder))


@pytest.mark.parametrize("validated_only", [True, False])
def test_results_go_to_tune_in_report_order_and_an_ended_validation_releases_the_line(
    tmp_path, validated_only
):
    """Without Ray: a real registry, its jobs finished as the scheduler finishes them."""
    import time

    from tests.registry_world import report as register_reports
    from trainer_integration._tune_results import TrialLink, TuneResults
    from validation_service.config import Settings
    from validation_service.registry.records import JobOutcome
    from validation_service.storage import CheckpointStorage

    settings = Settings(
        home=tmp_path / "home",
        database_url=f"sqlite:///{tmp_path / 'registry.db'}",
        storage=str(tmp_path / "store"),
    )
    registry = Registry(settings=settings)
    storage = CheckpointStorage(settings.storage)
    register_reports(
        registry,
        storage,
        "r",
        [{"epoch": e, "loss": 1.0 - e / 10} for e in range(3)],
        validate=True,
        workdir=tmp_path,
    )
    sent: list[dict] = []
    trial = TrialLink("t_00000", "search", checked=None, strict=True)
    results = TuneResults(
        "r", trial, settings, sent.append, validated_only=validated_only, poll_interval_s=0.05
    )
    results.add({"epoch": 0, "loss": 1.0}, _pointer_to(tmp_path, 0))
    results.add({"epoch": 0, "loss": 1.0, "note": "no checkpoint"}, None)
    results.add({"epoch": 1, "loss": 0.9}, _pointer_to(tmp_path, 1))
    results.add({"epoch": 2, "loss": 0.8}, _pointer_to(tmp_path, 2))
    jobs = {
        job.report_index: job
        for job in registry.job_queue.claim_due_jobs("test-owner", {"CPU": 100}, lease_s=60)
    }

    def finish(index: int, outcome: JobOutcome) -> None:
        assert registry.job_queue.finish_job(jobs[index].job_id, jobs[index].lease_token, outcome)

    # The last checkpoint is validated first: it waits for the earlier ones.
    finish(2, JobOutcome(succeeded=True, metrics={"val_acc": 0.9}))
    time.sleep(0.5)
    assert sent == []
    # The first one's validation fails for good: it releases the line, with its status.
    finish(0, JobOutcome(succeeded=False, error_type="E", error_message="no", retryable=False))
    deadline = time.monotonic() + 30
    while len(sent) < (1 if validated_only else 2):
        assert time.monotonic() < deadline, sent
        time.sleep(0.05)
    time.sleep(0.3)
    first = sent[0]
    assert first["ckval_report_index"] == 0 and first["ckval_validation_status"] == "FAILED"
    assert "val_acc" not in first and first["checkpoint_path"].startswith(str(storage.root_uri))
    if not validated_only:  # the report without a checkpoint, as Ray's callback hands it on
        assert sent[1] == {"epoch": 0, "loss": 1.0, "note": "no checkpoint"}
    # Report 1 has not ended: report 2 (validated long ago) still waits behind it.
    assert [r.get("ckval_report_index") for r in sent if "ckval_report_index" in r] == [0]
    finish(1, JobOutcome(succeeded=False, timed_out=True, retryable=False, error_type="T"))
    results.finish(warn_every_s=30)
    indexed = [r for r in sent if "ckval_report_index" in r]
    assert [(r["ckval_report_index"], r["ckval_validation_status"]) for r in indexed] == [
        (0, "FAILED"),
        (1, "TIMED_OUT"),
        (2, "VALIDATED"),
    ]
    assert indexed[2]["val_acc"] == 0.9 and indexed[2]["epoch"] == 2  # merged with the report
    assert len(sent) == (3 if validated_only else 4)
    registry.close()


def test_ckval_runs_shows_one_searchs_trials_side_by_side(tmp_path):
    from click.testing import CliRunner

    from validation_service.cli import main

    url = f"sqlite:///{tmp_path / 'registry.db'}"
    registry = Registry(url)
    for name, search in [("trial-a", "s1"), ("trial-b", "s1"), ("other", "s2")]:
        run_id = registry.ledger.ensure_run(name, storage_root=str(tmp_path / "store"))
        registry.ledger.tag_run(run_id, {"tune_experiment": search, "tune_trial_id": name})
    registry.close()
    env = {"CKVAL_HOME": str(tmp_path / "home")}
    shown = CliRunner().invoke(
        main, ["--database-url", url, "runs", "--tag", "tune_experiment=s1"], env=env
    )
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert "tags" in lines[0]
    assert [line.split()[0] for line in lines[2:]] == ["trial-a", "trial-b"]
    assert "tune_trial_id=trial-b" in lines[-1]
    both = ["runs", "--tag", "tune_experiment=s1", "--tag", "tune_trial_id=trial-a", "--json"]
    as_json = CliRunner().invoke(main, ["--database-url", url, *both], env=env)
    assert [run["name"] for run in json.loads(as_json.output)] == ["trial-a"]
    bad = CliRunner().invoke(
        main, ["--database-url", url, "runs", "--tag", "tune_experiment"], env=env
    )
    assert bad.exit_code == 2 and "is no KEY=VALUE" in bad.output
