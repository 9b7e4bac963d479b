"""report() and Client: bad inputs refused up front, and reports outside Ray Train."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import cloudpickle
import pytest
import torch
from ray.train import Checkpoint

import trainer_integration
from trainer_integration import CheckpointUploadMode, Client
from validation_service.errors import InvalidInput
from validation_service.registry.registry import Registry

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def read_value(checkpoint, config):
    with checkpoint.as_directory() as directory:
        value = json.load(open(os.path.join(directory, "value.json")))["value"]
    return {"score": value * config.get("scale", 1), "checked": torch.tensor(1.0)}


def make_checkpoint(tmp_path, value, name=None) -> Checkpoint:
    directory = tmp_path / (name or f"ckpt-{value}")
    directory.mkdir()
    (directory / "value.json").write_text(json.dumps({"value": value}))
    return Checkpoint.from_directory(str(directory))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"validate_config": {"lock": threading.Lock()}}, "validate_config cannot be pickled"),
        ({"validate_config": [1, 2]}, "validate_config must be a dict"),
        ({"validate_fn": "no_such_module_xyz:fn"}, "module 'no_such_module_xyz' does not import"),
        ({"validate_fn": "json:no_such_fn"}, "has no attribute 'no_such_fn'"),
        ({"validate_fn": "just-a-name"}, "'package.module:function'"),
        ({"validate_fn": 3}, "validate_fn must be a callable"),
        ({"validation_resources": {"gpus": 1}}, "unknown keys \\['gpus'\\]"),
        ({"validation_resources": {"num_gpus": -1}}, "must be a number >= 0"),
        ({"timeout_s": -5}, "timeout_s must be a positive"),
        ({"max_attempts": 0}, "max_attempts must be an int >= 1"),
        ({"priority": "high"}, "priority must be an int"),
        ({"checkpoint_upload_mode": "SYNC"}, "must be a CheckpointUploadMode"),
    ],
)
def test_bad_report_arguments_are_refused_before_anything_is_stored(
    tmp_path, unique_run, kwargs, message
):
    client = Client(unique_run)
    arguments = {"validate_fn": read_value, **kwargs}
    with pytest.raises(InvalidInput, match=message):
        if "checkpoint_upload_mode" in kwargs:
            trainer_integration.start_run(unique_run)
            trainer_integration.report({"x": 1}, make_checkpoint(tmp_path, 1), **arguments)
        else:
            client.report({"x": 1}, make_checkpoint(tmp_path, 1), **arguments)
    assert client.registry.checkpoints(unique_run) == []


def test_bad_metrics_and_missing_pieces(tmp_path, unique_run):
    client = Client(unique_run)
    with pytest.raises(InvalidInput, match="metrics must be a dict"):
        trainer_integration.report([1, 2])
    with pytest.raises(InvalidInput, match="without a checkpoint"):
        client.report({"x": 1}, None, validate_fn=read_value)
    with pytest.raises(InvalidInput, match="at most 1000"):
        client.report({f"m{i}": i for i in range(2000)}, make_checkpoint(tmp_path, 1))
    assert client.registry.checkpoints(unique_run) == []


def test_report_outside_ray_train_needs_a_run(monkeypatch):
    monkeypatch.setattr(trainer_integration, "_current_run", None)
    with pytest.raises(InvalidInput, match="start_run"):
        trainer_integration.report({"loss": 1.0})


@pytest.mark.ray
def test_client_reports_are_validated_by_the_service(service, tmp_path, unique_run):
    client = trainer_integration.start_run(unique_run)
    for value in (3, 9, 5):
        trainer_integration.report(
            {"loss": 1.0 / value, "step": value * 10},
            make_checkpoint(tmp_path, value),
            validate_fn=read_value,
            validate_config={"scale": 2},
        )
    client.wait(timeout_s=120)
    registry = Registry()
    [(best, metrics)] = registry.best_checkpoints(unique_run, "score", "max", k=1)
    assert metrics == {"loss": 1 / 9, "step": 90, "score": 18, "checked": 1.0}
    assert [c.step for c in registry.checkpoints(unique_run)] == [30, 90, 50]
    with best.as_directory() as directory:
        assert json.load(open(os.path.join(directory, "value.json"))) == {"value": 9}


@pytest.mark.ray
def test_validate_fn_by_import_reference(service, tmp_path, unique_run):
    client = Client(unique_run)
    # json:loads applied to (checkpoint, config) raises TypeError: a user error, stored.
    client.report({"a": 1}, make_checkpoint(tmp_path, 1), validate_fn="json:loads", max_attempts=1)
    client.wait(timeout_s=120)
    [job] = client.registry.validations(unique_run)
    assert job.status == "FAILED" and job.error_type == "TypeError"
    assert job.validate_fn_name == "json:loads"


@pytest.mark.ray
def test_async_and_no_upload_modes(service, tmp_path, unique_run):
    client = Client(unique_run)
    index = client.report(
        {"v": 4},
        make_checkpoint(tmp_path, 4),
        validate_fn=read_value,
        checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
    )
    storage = client._reporter.storage
    in_storage = storage.checkpoint_path("default", unique_run, 100)
    os.makedirs(in_storage)
    with open(os.path.join(in_storage, "value.json"), "w") as f:
        json.dump({"value": 7}, f)
    client.report(
        {"v": 7},
        Checkpoint.from_directory(in_storage),
        validate_fn=read_value,
        checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
    )
    client.wait(timeout_s=120)
    records = {c.report_index: c for c in client.registry.checkpoints(unique_run)}
    assert records[index].metrics["score"] == 4
    assert records[index + 1].metrics["score"] == 7
    assert records[index + 1].uri == in_storage
    outside = make_checkpoint(tmp_path, 8)
    with pytest.raises(InvalidInput, match="outside the storage root"):
        client.report(
            {"v": 8},
            outside,
            validate_fn=read_value,
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )
    assert len(client.registry.checkpoints(unique_run)) == 2


def test_report_survives_an_unreachable_registry_and_raises_when_it_stays_down(
    tmp_path, unique_run, postgres_server_url
):
    """PostgreSQL becomes unreachable (its connections cut, new ones refused) after the
    run started: reports are kept and delivered when it comes back, or raised at the
    next report() when it does not come back in time."""
    import sqlalchemy as sa

    from tests.tcp_proxy import TcpProxy
    from trainer_integration import ReportNotDelivered
    from validation_service.config import get_settings

    Registry(postgres_server_url, upgrade=True).close()
    url = sa.engine.make_url(postgres_server_url)
    proxy = TcpProxy(url.host, url.port or 5432)
    proxy.start()
    through_proxy = url.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    settings = get_settings(database_url=through_proxy, delivery_timeout_s=4.0)
    client = Client(unique_run, settings)
    client._reporter._start_service = False  # no service: this is about the registry
    try:
        proxy.stop()
        started = time.perf_counter()
        index = client.report({"v": 1}, make_checkpoint(tmp_path, 1))
        blocked = time.perf_counter() - started
        proxy.start()  # back within delivery_timeout_s
        client.flush(timeout_s=30)
        [record] = Registry(postgres_server_url).checkpoints(unique_run)
        assert record.report_index == index and record.reported_metrics == {"v": 1}

        proxy.stop()  # now it stays down past delivery_timeout_s
        lost = client.report({"v": 2}, make_checkpoint(tmp_path, 2))
        deadline = time.monotonic() + 60
        while not all(f.done() for _, f in client._reporter._pending):
            assert time.monotonic() < deadline, "background delivery never gave up"
            time.sleep(0.1)
        with pytest.raises(ReportNotDelivered, match=rf"(?s)indices \[{lost}\].*in storage"):
            client.report({"v": 3}, make_checkpoint(tmp_path, 3))
    finally:
        proxy.stop()
    assert blocked < settings.delivery_timeout_s


def report_context(checkpoint, config):
    from validation_service.executors import current_validation

    context = current_validation()
    return {
        "index_seen": context.report_index,
        "attempt_seen": context.attempt,
        "run_matches": float(context.run == config["run"]),
    }


@pytest.mark.ray
def test_validate_fn_sees_which_validation_it_runs(service, tmp_path, unique_run):
    from validation_service.executors import current_validation

    assert current_validation() is None  # outside a validation
    client = Client(unique_run)
    for value in (1, 2):
        client.report(
            {"v": value},
            make_checkpoint(tmp_path, value),
            validate_fn=report_context,
            validate_config={"run": unique_run},
        )
    client.wait(timeout_s=120)
    seen = [c.validated_metrics for c in client.registry.checkpoints(unique_run)]
    assert seen == [
        {"index_seen": 0, "attempt_seen": 1, "run_matches": 1.0},
        {"index_seen": 1, "attempt_seen": 1, "run_matches": 1.0},
    ]


def test_a_validate_fn_is_pickled_once_per_process():
    """As Ray pickles ValidationConfig(fn) once: per-report values go in validate_config."""
    from trainer_integration._reporter import build_job_spec

    def validate(checkpoint, config):
        return {"ok": 1.0}

    first, again = (
        build_job_spec(validate, {"epoch": epoch}, None, 0, None, 3) for epoch in (1, 2)
    )
    assert first.validate_fn_pickle is again.validate_fn_pickle
    assert first.validate_config != again.validate_config
    other = build_job_spec(lambda checkpoint, config: {}, None, None, 0, None, 3)
    assert other.validate_fn_pickle != first.validate_fn_pickle


def test_storing_a_checkpoint_never_queues_behind_background_deliveries(tmp_path, unique_run):
    """Deliveries retrying through a registry outage hold the background threads."""
    from trainer_integration._reporter import RunReporter

    reporter = RunReporter(unique_run, start_service=False)
    outage_over = threading.Event()
    for index in (100, 101):  # every background thread busy, as retrying deliveries are
        reporter._in_background(index, outage_over.wait, 60)
    try:
        index, uri, storing = reporter.start_storing(make_checkpoint(tmp_path, 1.0))
        assert storing.result(timeout=20).uri == uri
    finally:
        outage_over.set()
    reporter.flush(timeout_s=30)


def test_a_registration_held_for_ray_trains_report_happens_even_if_it_never_returns(
    tmp_path, unique_run
):
    """Ray Train holds a report while its result queue is full: the registration (and so
    the validation) then goes ahead anyway, a moment after the checkpoint is stored."""
    from trainer_integration._reporter import RunReporter

    reporter = RunReporter(unique_run, start_service=False)
    report_returned = threading.Event()  # never set: Ray Train still holds the report
    index, uri, storing = reporter.start_storing(make_checkpoint(tmp_path, 1.0))
    reporter.register_in_background(
        index, storing.result(timeout=20), {"loss": 0.5}, None, not_before=report_returned
    )
    reporter.flush(timeout_s=30)
    [record] = reporter.registry.checkpoints(unique_run)
    assert (record.report_index, record.uri) == (index, uri)
    assert record.reported_metrics["loss"] == 0.5
    assert not report_returned.is_set()
