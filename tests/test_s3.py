"""S3 end to end against moto's S3 server on loopback: upload, manifest, validation, damage."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import sys
import time

import cloudpickle
import pytest
from ray.train import Checkpoint

from tests.tcp_proxy import TcpProxy
from trainer_integration import CheckpointUploadMode, Client
from validation_service.config import get_settings
from validation_service.errors import CheckpointCorrupt, CheckpointNotFound
from validation_service.registry.registry import Registry
from validation_service.service import ValidationService
from validation_service.storage import MANIFEST_NAME, CheckpointStorage

cloudpickle.register_pickle_by_value(sys.modules[__name__])
BUCKET = "ckval-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on loopback with one bucket."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    ).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


def options_for(endpoint: str) -> dict:
    return {
        "key": "test",
        "secret": "test",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }


def model_checkpoint(tmp_path, name: str, value: int) -> Checkpoint:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "model.bin").write_bytes(os.urandom(2 * 1024 * 1024))
    (directory / "value.json").write_text(json.dumps({"value": value}))
    return Checkpoint.from_directory(str(directory))


def read_value(checkpoint, config):
    with checkpoint.as_directory() as directory:
        return {"score": json.load(open(os.path.join(directory, "value.json")))["value"]}


def test_upload_manifest_and_damage_on_s3(s3_endpoint, tmp_path):
    storage = CheckpointStorage(f"s3://{BUCKET}/unit", options_for(s3_endpoint))
    persisted = storage.upload(model_checkpoint(tmp_path, "c", 1).path, "ns", "run", 0)
    assert persisted.uri == f"s3://{BUCKET}/unit/ns/run/checkpoint_000000"
    assert storage.fs.exists(f"{BUCKET}/unit/ns/run/checkpoint_000000/{MANIFEST_NAME}")
    local = storage.materialize(persisted.uri, persisted.manifest_sha256, str(tmp_path))
    assert json.load(open(os.path.join(local, "value.json"))) == {"value": 1}

    model = f"{BUCKET}/unit/ns/run/checkpoint_000000/model.bin"
    storage.fs.pipe(model, b"not the model")
    storage.fs.invalidate_cache()
    with pytest.raises(CheckpointCorrupt, match="model.bin"):
        storage.materialize(persisted.uri, persisted.manifest_sha256, str(tmp_path))
    storage.fs.rm(model)
    storage.fs.invalidate_cache()
    with pytest.raises(CheckpointNotFound, match="model.bin"):
        storage.verify(persisted.uri, persisted.manifest_sha256)
    with pytest.raises(CheckpointNotFound):
        storage.verify(f"s3://{BUCKET}/unit/ns/run/checkpoint_000099", None)


@pytest.fixture
def s3_service(ray_session, s3_endpoint, tmp_path):
    """A service of its own on S3 storage (settings differ from the session's)."""
    settings = get_settings(
        database_url=f"sqlite:///{tmp_path / 's3.db'}",
        storage=f"s3://{BUCKET}/ckval",
        storage_options=options_for(s3_endpoint),
        service_name=f"ckval-s3-{tmp_path.name}",
    )
    handle = ValidationService.start(settings=settings)
    yield settings
    handle.stop()


def test_validation_reads_from_s3(s3_service, tmp_path, unique_run):
    settings = s3_service
    client = Client(unique_run, settings)
    for value in (1, 3, 2):
        client.report(
            {"step": value}, model_checkpoint(tmp_path, f"c{value}", value), validate_fn=read_value
        )
    client.wait(timeout_s=120)
    registry = Registry(settings=settings)
    [(best, metrics)] = registry.best_checkpoints(unique_run, "score", "max", k=1)
    assert metrics["score"] == 3 and best.path.endswith("checkpoint_000001")
    with best.as_directory() as directory:
        assert json.load(open(os.path.join(directory, "value.json"))) == {"value": 3}
    assert all(r.uri.startswith(f"s3://{BUCKET}/ckval/") for r in registry.checkpoints(unique_run))


def test_damaged_s3_checkpoints_fail_without_retries(s3_service, tmp_path, unique_run):
    """Checkpoints damaged in S3 after they were reported: the job fails at once."""
    from validation_service.payloads import signed_request, validation_request
    from validation_service.signing import job_binding

    settings = s3_service
    client = Client(unique_run, settings)
    storage = client._reporter.storage
    for index in (0, 1):  # stored and registered, no validation yet
        client.report({"step": index}, model_checkpoint(tmp_path, f"c{index}", index))
    prefix = f"{BUCKET}/ckval/default/{unique_run}"
    storage.fs.pipe(f"{prefix}/checkpoint_000000/model.bin", b"flipped bytes")
    storage.fs.rm(f"{prefix}/checkpoint_000001/model.bin")
    registry = Registry(settings=settings)
    request = validation_request(read_value, None, None, 0, None, 3)
    for record in registry.checkpoints(unique_run):  # now enqueue their validations
        index = 100 + record.report_index
        # Signed with the reporter's key for this job, as report() signs it.
        binding = job_binding(registry.namespace, unique_run, index, record.uri)
        job = signed_request(request, client._reporter.trust, binding)
        registry.ledger.register_checkpoint(
            client._reporter.run_id,
            index,
            uri=record.uri,
            size_bytes=record.size_bytes,
            manifest_sha256=record.manifest_sha256,
            reported_metrics={},
            job=job,
        )
    client._reporter.nudge()
    registry.wait(unique_run, timeout_s=120)
    jobs = {j.report_index: j for j in registry.validations(unique_run)}
    assert (jobs[100].status, jobs[100].attempts, jobs[100].error_type) == (
        "FAILED",
        1,
        "CheckpointCorrupt",
    )
    assert (jobs[101].status, jobs[101].attempts, jobs[101].error_type) == (
        "FAILED",
        1,
        "CheckpointNotFound",
    )
    assert "model.bin" in jobs[100].error_message and "not retried" in jobs[101].error_message


def test_async_upload_returns_before_the_upload_ends(
    ray_session, s3_endpoint, tmp_path, unique_run
):
    """Through a slow network (a proxy that delays every chunk) to S3."""
    host, port = s3_endpoint.removeprefix("http://").split(":")
    proxy = TcpProxy(host, int(port), delay_s=0.05)
    proxy.start()
    slow = f"http://127.0.0.1:{proxy.port}"
    settings = get_settings(
        database_url=f"sqlite:///{tmp_path / 'async.db'}",
        storage=f"s3://{BUCKET}/async",
        storage_options=options_for(slow),
        service_name=f"ckval-async-{tmp_path.name}",
    )
    handle = ValidationService.start(settings=settings)
    try:
        client = Client(unique_run, settings)
        checkpoint = model_checkpoint(tmp_path, "big", 7)
        started = time.perf_counter()
        index = client.report(
            {"step": 1},
            checkpoint,
            validate_fn=read_value,
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
        )
        returned = dt.datetime.now(dt.timezone.utc)
        blocked = time.perf_counter() - started
        registry = Registry(settings=settings)
        assert registry.checkpoints(unique_run) == []  # not registered until uploaded
        client.flush(timeout_s=300)
        [record] = registry.checkpoints(unique_run)
        upload_s = (record.created_at - returned).total_seconds()
        assert upload_s > blocked  # report() returned before the upload ended
        client.wait(timeout_s=300)
        [job] = registry.validations(unique_run)
        assert job.status == "SUCCEEDED" and job.result_metrics == {"score": 7}
        assert job.attempt_history[0].claimed_at >= record.created_at  # only after upload
        assert record.report_index == index
        print(
            f"\nASYNC: report() blocked {blocked * 1000:.0f} ms; upload registered "
            f"{upload_s:.2f} s after report() returned"
        )
    finally:
        handle.stop()
        proxy.stop()


def s3_eval_loop(config: dict) -> dict:
    """An eval-only Ray Train loop that reads the checkpoint it is given."""
    checkpoint = config["checkpoint"]
    with checkpoint.as_directory() as directory:
        value = json.load(open(os.path.join(directory, "value.json")))["value"]
    return {"score": value, "read_from_s3": float(checkpoint.path.startswith(f"{BUCKET}/"))}


def test_torch_trainer_validator_workers_read_the_checkpoint_from_s3(
    s3_service, tmp_path, unique_run, session_home
):
    """The eval run's workers may be on other nodes: they get the S3 checkpoint, not the
    validating task's local copy."""
    from ray.train import RunConfig, ScalingConfig

    from validation_service.executors.torch_trainer import TorchTrainerValidator

    validator = TorchTrainerValidator(
        s3_eval_loop,
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(storage_path=str(session_home / "ray_results")),
    )
    client = Client(unique_run, s3_service)
    client.report(
        {"step": 1},
        model_checkpoint(tmp_path, "c", 7),
        validate_fn=validator,
        validation_resources=validator.recommended_resources,
    )
    client.wait(timeout_s=240)
    [record] = Registry(settings=s3_service).checkpoints(unique_run)
    assert record.validation_status == "VALIDATED", record
    assert record.validated_metrics == {"score": 7, "read_from_s3": 1.0}
