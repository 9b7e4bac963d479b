"""Validated metrics reach MLflow and Weights & Biases; a failing sink never fails a job.

The validations run as real Ray tasks (the session's Ray) under a scheduler of this process,
with a real MLflow tracking store on SQLite (no server) and W&B in offline mode.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import threading
import time
import uuid
from pathlib import Path

import pytest
from ray.train import Checkpoint

from trainer_integration import Client
from validation_service.config import Settings
from validation_service.errors import InvalidInput, InvalidSettings
from validation_service.registry.registry import Registry
from validation_service.service.scheduler import Scheduler
from validation_service.sinks import parse_sinks

mlflow = pytest.importorskip("mlflow")
wandb = pytest.importorskip("wandb")


def accuracy_of(checkpoint, config):
    """Reads the reported model file back: the validation sees the stored checkpoint."""
    with checkpoint.as_directory() as directory:
        return {"accuracy": json.loads((Path(directory) / "model.json").read_text())["accuracy"]}


# ------------------------------------------------------------- configuration
def test_sinks_by_kind_names():
    settings = Settings(sinks="mlflow, wandb")
    assert settings.sinks == [{"kind": "mlflow"}, {"kind": "wandb"}]
    assert Settings().sinks == []


def test_sinks_from_the_environment_as_json(monkeypatch):
    monkeypatch.setenv(
        "CKVAL_SINKS", '[{"kind": "mlflow", "tracking_uri": "sqlite:///m.db", "prefix": "val/"}]'
    )
    settings = Settings()
    [sink] = settings.sinks
    assert sink == {"kind": "mlflow", "tracking_uri": "sqlite:///m.db", "prefix": "val/"}
    # The service actor gets its settings as JSON: the sinks survive the trip.
    assert Settings.model_validate_json(settings.model_dump_json()).sinks == settings.sinks


def test_unknown_sink_kind_is_refused():
    with pytest.raises(InvalidSettings, match="CKVAL_SINKS.* unknown sink kind 'tensorboard'"):
        Settings(sinks="mlflow,tensorboard")


def test_unknown_sink_option_is_refused():
    with pytest.raises(InvalidInput, match=r"sink 'wandb' has unknown options \['tracking_uri'\]"):
        parse_sinks([{"kind": "wandb", "tracking_uri": "x"}])


def test_sinks_json_that_does_not_parse_is_refused(monkeypatch):
    monkeypatch.setenv("CKVAL_SINKS", '[{"kind": "mlflow",]')
    with pytest.raises(InvalidSettings, match="CKVAL_SINKS is not valid JSON"):
        Settings()


def test_a_sink_without_a_kind_is_refused():
    with pytest.raises(InvalidInput, match="an object with a 'kind'"):
        parse_sinks([{"tracking_uri": "sqlite:///m.db"}])


# ------------------------------------------------------------ with validations
@pytest.fixture
def home(tmp_path) -> Path:
    return tmp_path


def settings_for(home: Path, sinks: list[dict], **overrides) -> Settings:
    values = dict(
        database_url=f"sqlite:///{home / 'registry.db'}",
        storage=str(home / "checkpoints"),
        service_name=f"sinks-{uuid.uuid4().hex[:8]}",
        poll_interval_s=0.05,
        sinks=sinks,
        sink_attempts=2,
        sink_backoff_s=0.05,
    )
    values.update(overrides)
    return Settings(**values)


def report_checkpoints(settings: Settings, run: str, home: Path, steps: dict[int, float]) -> Client:
    """Reports one checkpoint per step (its model file holds the accuracy to validate)."""
    client = Client(run, settings=settings, start_service=False)
    for step, accuracy in steps.items():
        folder = home / f"model-{run}-{step}"
        folder.mkdir()
        (folder / "model.json").write_text(json.dumps({"accuracy": accuracy}))
        client.report(
            {"step": step, "loss": 1.0 - accuracy},
            Checkpoint.from_directory(str(folder)),
            validate_fn="tests.test_sinks:accuracy_of",
            max_attempts=1,
        )
    return client


def validate_all(settings: Settings, run: str) -> Scheduler:
    """Runs the run's validations (Ray tasks) and waits until the sinks are done."""
    registry = Registry(settings=settings)
    scheduler = Scheduler(registry, settings)
    thread = threading.Thread(target=scheduler.run_forever, daemon=True)
    thread.start()
    try:
        registry.wait(run, timeout_s=180)
        assert scheduler.sinks.wait_idle(120), scheduler.stats
    finally:
        scheduler.stop()
        thread.join(60)
    return scheduler


@pytest.fixture
def mlflow_uri(home):
    uri = f"sqlite:///{home / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(None)


@pytest.mark.ray
def test_mlflow_gets_validated_metrics_in_the_trainings_run(ray_session, home, mlflow_uri):
    # The training's run is in MLflow's default experiment, which the settings allow.
    settings = settings_for(home, [{"kind": "mlflow"}], mlflow_allowed_experiments=["Default"])
    run = f"mlflow-active-{uuid.uuid4().hex[:6]}"
    with mlflow.start_run() as training:
        mlflow.log_metric("loss", 0.5, step=10)
        report_checkpoints(settings, run, home, {10: 0.75, 20: 0.875})
    scheduler = validate_all(settings, run)
    history = mlflow.MlflowClient(mlflow_uri).get_metric_history(training.info.run_id, "accuracy")
    assert sorted((m.step, m.value) for m in history) == [(10, 0.75), (20, 0.875)]
    assert scheduler.stats["sink_deliveries"] == 2 and scheduler.stats["sink_failures"] == 0
    tags = Registry(settings=settings).ledger.run_tags(run)["trackers"]["mlflow"]
    assert tags == {
        "run_id": training.info.run_id,
        "experiment_id": training.info.experiment_id,
        "tracking_uri": mlflow_uri,
    }


@pytest.mark.ray
def test_mlflow_run_named_after_the_ckval_run_without_an_active_one(ray_session, home):
    uri = f"sqlite:///{home / 'tracking.db'}"
    settings = settings_for(home, [{"kind": "mlflow", "tracking_uri": uri, "experiment": "val"}])
    run = f"mlflow-named-{uuid.uuid4().hex[:6]}"
    report_checkpoints(settings, run, home, {3: 0.5})
    validate_all(settings, run)
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("val")
    [named] = client.search_runs([experiment.experiment_id])
    assert named.info.run_name == run and named.data.tags["ckval.run"] == run
    [metric] = client.get_metric_history(named.info.run_id, "accuracy")
    assert (metric.step, metric.value) == (3, 0.5)


def wandb_history(wandb_dir: Path, run_id: str) -> list[dict]:
    """The history rows of every offline W&B run with this id, read from its .wandb files.

    A .wandb file is a LevelDB-style log (a 7-byte header, then 32 KiB blocks of records
    with a 7-byte header each: checksum, length, type) of wandb's protobuf Records.
    """
    from wandb.proto import wandb_internal_pb2

    rows = []
    # A run resumed within the second it started in gets the folder name with "-1" added.
    folder = re.compile(rf"offline-run-.*-{re.escape(run_id)}(-\d+)?")
    found = wandb_dir.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb")
    for path in sorted(p for p in found if folder.fullmatch(p.parent.name)):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        position, pieces = 7, b""
        while position + 7 <= len(data):
            block_left = 32768 - position % 32768
            if block_left < 7:
                position += block_left  # the block's zero-filled tail
                continue
            _, length, kind = struct.unpack("<IHB", data[position : position + 7])
            position += 7
            pieces += data[position : position + length]
            position += length
            if kind in (1, 4):  # a full record, or the last piece of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pieces)
                pieces = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append(
                        {
                            item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item
                        }
                    )
    return rows


def validated_rows(wandb_dir: Path, run_id: str) -> list[dict]:
    return [row for row in wandb_history(wandb_dir, run_id) if "accuracy" in row]


@pytest.mark.ray
def test_wandb_offline_run_resumed_with_the_validated_metrics(ray_session, home):
    wandb_dir = home / "wandb-files"
    wandb_dir.mkdir()
    # An offline run has no entity: "" allows W&B's default one.
    settings = settings_for(
        home,
        [{"kind": "wandb", "mode": "offline", "dir": str(wandb_dir)}],
        wandb_allowed_entities=[""],
    )
    run = f"wandb-{uuid.uuid4().hex[:6]}"
    training = wandb.init(project="digits", mode="offline", dir=str(wandb_dir))
    try:
        training.log({"loss": 0.5})
        report_checkpoints(settings, run, home, {4: 0.625, 8: 0.75})
    finally:
        training.finish()
    validate_all(settings, run)
    # wandb's own service process writes the file; finish() may return before it has.
    deadline = time.monotonic() + 60
    while len(rows := validated_rows(wandb_dir, training.id)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted((row["ckval/step"], row["accuracy"]) for row in rows) == [(4, 0.625), (8, 0.75)]
    tags = Registry(settings=settings).ledger.run_tags(run)["trackers"]["wandb"]
    assert tags["id"] == training.id and tags["project"] == "digits"


@pytest.mark.ray
def test_a_failing_sink_is_retried_and_reported_and_the_job_succeeds(ray_session, home, caplog):
    not_a_folder = home / "not-a-folder"
    not_a_folder.write_text("a file where the tracking database's folder should be")
    uri = f"sqlite:///{not_a_folder / 'mlflow.db'}"
    settings = settings_for(home, [{"kind": "mlflow", "tracking_uri": uri}])
    run = f"sink-fails-{uuid.uuid4().hex[:6]}"
    report_checkpoints(settings, run, home, {1: 0.25})
    with caplog.at_level(logging.WARNING, logger="validation_service.sinks"):
        scheduler = validate_all(settings, run)
    [job] = Registry(settings=settings).validations(run)
    assert job.status == "SUCCEEDED" and job.result_metrics == {"accuracy": 0.25}
    [checkpoint] = Registry(settings=settings).checkpoints(run)
    assert checkpoint.metrics["accuracy"] == 0.25
    assert scheduler.stats["sink_failures"] == 1 and scheduler.stats["sink_deliveries"] == 0
    [(job_id, kind, error)] = scheduler.sinks.failures
    assert (job_id, kind) == (job.id, "mlflow") and error
    [warning] = [r for r in caplog.records if r.name == "validation_service.sinks"]
    assert f"validation job {job.id}" in warning.getMessage()
    assert "after 2 attempts" in warning.getMessage()


@pytest.mark.ray
def test_the_service_logs_validated_metrics_to_mlflow(ray_session, home, mlflow_uri):
    from validation_service.service import ValidationService

    # The service's own tracking URI is its default: the training's server is one its
    # settings must allow.
    settings = settings_for(
        home,
        [{"kind": "mlflow"}],
        mlflow_allowed_uris=[mlflow_uri],
        mlflow_allowed_experiments=["Default"],
    )
    service = ValidationService.start(settings=settings)
    try:
        run = f"mlflow-service-{uuid.uuid4().hex[:6]}"
        with mlflow.start_run() as training:
            client = Client(run, settings=settings)
            folder = home / "model"
            folder.mkdir()
            (folder / "model.json").write_text(json.dumps({"accuracy": 0.5}))
            client.report(
                {"epoch": 2},
                Checkpoint.from_directory(str(folder)),
                validate_fn="tests.test_sinks:accuracy_of",
            )
        client.wait(timeout_s=180)
        deadline = time.monotonic() + 120
        while service.status()["sink_deliveries"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert service.status()["sink_failures"] == 0
    finally:
        service.stop()
    tracking = mlflow.MlflowClient(mlflow_uri)
    [metric] = tracking.get_metric_history(training.info.run_id, "accuracy")
    assert (metric.step, metric.value) == (2, 0.5)  # the checkpoint's epoch, as no step


# ----------------------------------------------------- tracker credentials
def test_the_tracking_uri_is_recorded_and_served_without_credentials(home, mlflow_uri):
    from fastapi.testclient import TestClient

    from validation_service.api import create_app

    settings = settings_for(home, [])
    run = f"mlflow-credentials-{uuid.uuid4().hex[:6]}"
    with mlflow.start_run():
        mlflow.set_tracking_uri("https://alice:S3CRET@mlflow.example:5000/?token=T0KEN&x=1")
        try:
            report_checkpoints(settings, run, home, {1: 0.5})
        finally:
            mlflow.set_tracking_uri(mlflow_uri)  # the run ends on its own server
    recorded = Registry(settings=settings).ledger.run_tags(run)["trackers"]["mlflow"]
    assert recorded["tracking_uri"] == "https://mlflow.example:5000/?x=1"
    with TestClient(create_app(settings), base_url="http://localhost") as api:
        for path in ("/runs", f"/ui/api/runs/{run}", f"/ui/runs/{run}"):
            answer = api.get(path)
            assert answer.status_code == 200, answer.text
            assert "S3CRET" not in answer.text and "T0KEN" not in answer.text
            assert "alice" not in answer.text


class _TrackingServer:
    """An HTTP server in this process that a run's recorded tracking URI names: it
    records every request (and its Authorization header) and refuses it."""

    def __init__(self):
        import http.server

        self.requests: list[tuple[str, str | None]] = []
        seen = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def _refuse(self):
                seen.append((self.path, self.headers.get("Authorization")))
                self.send_response(400)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = _refuse

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.ray
def test_the_service_never_logs_to_a_tracking_server_its_settings_do_not_allow(
    ray_session, home, mlflow_uri, monkeypatch, caplog
):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "the-services-token")
    elsewhere = _TrackingServer()
    try:
        settings = settings_for(home, [{"kind": "mlflow"}])
        run = f"mlflow-elsewhere-{uuid.uuid4().hex[:6]}"
        client = report_checkpoints(settings, run, home, {7: 0.25})
        # What a reporter may record for its run: a tracker run on a server of its choice.
        client.registry.ledger.tag_run(
            client._reporter.run_id,
            {"trackers": {"mlflow": {"run_id": "0" * 32, "tracking_uri": elsewhere.uri}}},
        )
        with caplog.at_level(logging.WARNING, logger="validation_service.sinks"):
            scheduler = validate_all(settings, run)
    finally:
        elsewhere.close()
    assert elsewhere.requests == []
    [job] = Registry(settings=settings).validations(run)
    [warning] = [r.getMessage() for r in caplog.records if "not logged to" in r.getMessage()]
    assert f"validation job {job.id}" in warning and elsewhere.uri in warning
    assert scheduler.stats["sink_deliveries"] == 1 and scheduler.stats["sink_failures"] == 0
    # Logged to the service's own server instead, in a run named after ckval's run.
    own = mlflow.MlflowClient(mlflow_uri)
    [named] = own.search_runs([own.get_experiment_by_name("ckval").experiment_id])
    assert named.info.run_name == run
    [metric] = own.get_metric_history(named.info.run_id, "accuracy")
    assert (metric.step, metric.value) == (7, 0.25)


@pytest.mark.ray
def test_a_recorded_tracking_server_that_the_settings_allow_gets_the_metrics(
    ray_session, home, mlflow_uri
):
    """CKVAL_MLFLOW_ALLOWED_URIS: the run's recorded server, not the service's own, gets
    the validated metrics, in the training's own MLflow run."""
    other = f"sqlite:///{home / 'other-mlflow.db'}"
    training = mlflow.MlflowClient(other)
    experiment = training.create_experiment("training")
    training_run = training.create_run(experiment).info.run_id
    settings = settings_for(
        home,
        [{"kind": "mlflow"}],
        mlflow_allowed_uris=[other],
        mlflow_allowed_experiments=["training"],
    )
    run = f"mlflow-allowed-{uuid.uuid4().hex[:6]}"
    client = report_checkpoints(settings, run, home, {5: 0.75})
    client.registry.ledger.tag_run(
        client._reporter.run_id,
        {"trackers": {"mlflow": {"run_id": training_run, "tracking_uri": other}}},
    )
    scheduler = validate_all(settings, run)
    assert scheduler.stats["sink_deliveries"] == 1 and scheduler.stats["sink_failures"] == 0
    [metric] = training.get_metric_history(training_run, "accuracy")
    assert (metric.step, metric.value) == (5, 0.75)
    own = mlflow.MlflowClient(mlflow_uri)
    assert own.get_experiment_by_name("ckval") is None  # nothing went to the service's own
