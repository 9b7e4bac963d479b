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
    from trainer_integration import _client

    monkeypatch.setattr(_client, "_current_run", None)
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
    elsewhere = os.path.join(storage.root, "default", "another-run", "ckpt")
    os.makedirs(elsewhere)
    with pytest.raises(InvalidInput, match="not inside the folder of run"):
        client.report(
            {"v": 8},
            Checkpoint.from_directory(elsewhere),
            validate_fn=read_value,
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )
    assert len(client.registry.checkpoints(unique_run)) == 2
    # Outside the storage root: registered (and validated) where it is.
    outside = make_checkpoint(tmp_path, 8)
    client.report(
        {"v": 8},
        outside,
        validate_fn=read_value,
        checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
    )
    client.wait(timeout_s=120)
    last = client.registry.checkpoints(unique_run)[-1]
    assert last.uri == outside.path and last.metrics["score"] == 8


def test_report_survives_an_unreachable_registry_and_raises_when_it_stays_down(
    tmp_path, unique_run, postgres_server_url, caplog
):
    """PostgreSQL becomes unreachable (its connections cut, new ones refused) after the
    run started. A report whose index was reserved is kept and delivered when it comes
    back, or raised at the next report() when it does not come back in time. A report
    made while it is down cannot reserve its index: it is refused, nothing stored."""
    import sqlalchemy as sa

    from tests.tcp_proxy import TcpProxy
    from trainer_integration import ReportNotDelivered
    from validation_service.config import get_settings
    from validation_service.errors import RegistryUnavailable

    Registry(postgres_server_url, upgrade=True).close()
    url = sa.engine.make_url(postgres_server_url)
    proxy = TcpProxy(url.host, url.port or 5432)
    proxy.start()
    through_proxy = url.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    settings = get_settings(database_url=through_proxy, delivery_timeout_s=4.0)
    client = Client(unique_run, settings)
    reporter = client._reporter
    reporter._link = None  # no service: this is about the registry
    run_folder = os.path.join(settings.resolved_storage(), settings.namespace, unique_run)

    def report_then_cut_the_registry(value) -> int:
        """Reserves the report's index, then cuts the registry before the copy ends."""
        copy_may_start = threading.Event()
        reporter._thread("store").submit(copy_may_start.wait, 60)  # the copy waits
        index = client.report(
            {"v": value},
            make_checkpoint(tmp_path, value),
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
        )
        proxy.stop()
        copy_may_start.set()
        deadline = time.monotonic() + 60
        while f"report {index} of run {unique_run!r} is retried" not in caplog.text:
            assert time.monotonic() < deadline, "the registration never met the outage"
            time.sleep(0.05)
        return index

    try:
        proxy.stop()
        started = time.perf_counter()
        with pytest.raises(RegistryUnavailable, match="unavailable"):
            client.report({"v": 0}, make_checkpoint(tmp_path, 0))
        refused_after = time.perf_counter() - started
        assert not os.path.exists(run_folder) or os.listdir(run_folder) == []
        proxy.start()

        index = report_then_cut_the_registry(1)
        proxy.start()  # back within delivery_timeout_s
        client.flush(timeout_s=30)
        [record] = Registry(postgres_server_url).checkpoints(unique_run)
        assert record.report_index == index and record.reported_metrics == {"v": 1}

        lost = report_then_cut_the_registry(2)  # now it stays down past delivery_timeout_s
        deadline = time.monotonic() + 60
        while not all(f.done() for _, f in reporter._pending._pending):
            assert time.monotonic() < deadline, "background delivery never gave up"
            time.sleep(0.1)
        with pytest.raises(ReportNotDelivered, match=rf"(?s)indices \[{lost}\].*in storage"):
            client.report({"v": 3}, make_checkpoint(tmp_path, 3))
        assert os.path.isdir(os.path.join(run_folder, f"checkpoint_{lost:06d}"))
    finally:
        proxy.stop()
    assert refused_after < settings.delivery_timeout_s


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
    from validation_service.payloads import validation_request

    def validate(checkpoint, config):
        return {"ok": 1.0}

    first, again = (
        validation_request(validate, {"epoch": epoch}, None, 0, None, 3) for epoch in (1, 2)
    )
    assert first.validate_fn_pickle is again.validate_fn_pickle
    assert first.validate_config != again.validate_config
    other = validation_request(lambda checkpoint, config: {}, None, None, 0, None, 3)
    assert other.validate_fn_pickle != first.validate_fn_pickle


def test_storing_a_checkpoint_never_queues_behind_background_deliveries(tmp_path, unique_run):
    """Deliveries retrying through a registry outage hold the background threads."""
    from trainer_integration._reporter import RunReporter

    reporter = RunReporter(unique_run, start_service=False)
    outage_over = threading.Event()
    for index in (100, 101):  # every background thread busy, as retrying deliveries are
        reporter._in_background(index, outage_over.wait, 60)
    try:
        report = reporter.store_and_register({}, make_checkpoint(tmp_path, 1.0), None)
        assert report.stored.result(timeout=20).uri == report.uri
        assert not report.registered.done()  # queued behind the deliveries, not lost
    finally:
        outage_over.set()
    reporter.flush(timeout_s=30)
    [record] = reporter.registry.checkpoints(unique_run)
    assert record.uri == report.uri


def test_a_report_is_registered_as_soon_as_its_copy_is_done(tmp_path, unique_run):
    """Nothing but the copy comes before the registration (Ray Train's report neither)."""
    from trainer_integration._reporter import RunReporter

    reporter = RunReporter(unique_run, start_service=False)
    report = reporter.store_and_register({"loss": 0.5}, make_checkpoint(tmp_path, 1.0), None)
    report.registered.result(timeout=30)
    [record] = reporter.registry.checkpoints(unique_run)
    assert (record.report_index, record.uri) == (report.index, report.uri)
    assert record.reported_metrics["loss"] == 0.5
    assert (tmp_path / "ckpt-1.0").is_dir()  # kept unless asked to delete it


def test_async_reports_delete_the_folder_once_copied_unless_told_not_to(
    service, tmp_path, unique_run
):
    """As ray.train.report(checkpoint_upload_mode=ASYNC) does by default."""
    client = Client(unique_run)
    first = client.report(
        {"v": 1},
        make_checkpoint(tmp_path, 1),
        validate_fn=read_value,
        checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
    )
    client.report(
        {"v": 2},
        make_checkpoint(tmp_path, 2),
        checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
        delete_local_checkpoint_after_upload=False,
    )
    client.wait(timeout_s=120)
    assert not (tmp_path / "ckpt-1").exists()
    assert (tmp_path / "ckpt-2" / "value.json").exists()
    records = {r.report_index: r for r in client.registry.checkpoints(unique_run)}
    assert records[first].metrics["score"] == 1
    assert sorted(records) == [first, first + 1]
    with pytest.raises(InvalidInput, match="delete_local_checkpoint_after_upload must be"):
        client.report({}, make_checkpoint(tmp_path, 3), delete_local_checkpoint_after_upload=1)
    assert len(client.registry.checkpoints(unique_run)) == 2


def test_an_async_copy_that_fails_is_raised_by_the_next_report(tmp_path, unique_run):
    from trainer_integration import ReportNotDelivered
    from trainer_integration._reporter import RunReporter
    from validation_service.config import get_settings

    not_a_folder = tmp_path / "storage-is-a-file"
    not_a_folder.write_text("")
    reporter = RunReporter(unique_run, get_settings(storage=str(not_a_folder)), start_service=False)
    failed = reporter.store_and_register({}, make_checkpoint(tmp_path, 1.0), None)
    with pytest.raises(OSError):
        failed.registered.result(timeout=30)
    with pytest.raises(ReportNotDelivered, match=r"report indices \[0\]"):
        reporter.store_and_register({}, make_checkpoint(tmp_path, 2.0), None)
    # Nothing was registered; index 0 stays reserved (never handed out again).
    assert reporter.registry.checkpoints(unique_run) == []
    assert reporter.registry.ledger.next_report_index(reporter.run_id) == 1
    assert (tmp_path / "ckpt-1.0" / "value.json").exists()  # nothing of the user's lost


def test_every_ckval_error_survives_pickling_with_its_message_and_fields():
    """Errors raised in a Ray worker reach the driver intact (Ray pickles them)."""
    import inspect
    import pickle

    import validation_service.errors as errors
    from trainer_integration import ReportNotDelivered

    samples = [ReportNotDelivered("run-a", [(3, ValueError("db down"))])]
    for cls in vars(errors).values():
        if (
            inspect.isclass(cls)
            and issubclass(cls, Exception)
            and cls.__module__ == errors.__name__
        ):
            required = [
                p
                for p in inspect.signature(cls.__init__).parameters.values()
                if p.name != "self" and p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD
            ]
            samples.append(cls(*[f"arg-{i}" for i in range(len(required))]))
    assert len(samples) > 8
    for error in samples:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == str(error)
        assert copy.__dict__ == error.__dict__
    assert pickle.loads(pickle.dumps(samples[0])).report_indices == [3]


@pytest.fixture
def warming_service(ray_session, tmp_path):
    """A service of its own that keeps workers warm (the session's does not: conftest)."""
    from validation_service.config import get_settings
    from validation_service.service import ValidationService

    settings = get_settings(
        database_url=f"sqlite:///{tmp_path / 'warm.db'}",
        storage=str(tmp_path / "checkpoints"),
        service_name=f"ckval-warm-{tmp_path.name}",
        keep_warm=True,
        pools={"CPU": 2},  # two workers to warm: each imports torch, on 2 cores
    )
    service = ValidationService.start(settings=settings)
    yield service
    service.stop()


def test_setting_a_run_up_warms_validation_workers_with_its_frameworks(warming_service, unique_run):
    """A run's first validations find worker processes started with torch imported."""
    import ray

    from trainer_integration._reporter import RunReporter

    service = warming_service
    warmed = service.status()["warmed"]
    # As rank 0 of a Ray Train run does; this process imported torch.
    RunReporter(unique_run, service.settings).prepare()
    deadline = time.monotonic() + 120
    while service.status()["warmed"] == warmed:
        assert time.monotonic() < deadline, "setting the run up warmed no worker"
        time.sleep(0.2)
    # Only the frameworks the service allows are imported, whatever a caller names; as a
    # run starts, their companions (torch's metrics library) are left to keep_warm(), so
    # that no second of importing is taken from training.
    workers = ray.get(service.warm_up(["torch", "calendar", "no_such_module_xyz"]), timeout=120)
    assert workers and all(imported == ["torch"] for _, imported in workers)
    time.sleep(3)  # idle: Ray keeps workers for the next tasks while CPUs are free
    # Ray retires idle workers beyond its soft limit (one per CPU), the oldest first, and
    # earlier tests of the session leave idle workers of their own: at least one of the
    # warmed ones is kept.
    alive = [pid for pid, _ in workers if _alive(pid)]
    assert alive, f"Ray stopped every warmed worker: {workers}"
    assert Registry(settings=service.settings).find_run_id(unique_run) is None  # nothing written


def test_between_runs_the_service_keeps_its_workers_warm_but_only_on_an_idle_cluster(
    warming_service,
):
    import ray

    service = warming_service

    @ray.remote(num_cpus=1)
    def training_step(seconds):
        time.sleep(seconds)

    def warmed_within(seconds) -> bool:
        before, deadline = service.status()["warmed"], time.monotonic() + seconds
        while time.monotonic() < deadline:
            if service.status()["warmed"] > before:
                return True
            time.sleep(0.2)
        return False

    ray.get(service.warm_up(["torch"]), timeout=120)  # as a run's set-up does
    assert warmed_within(30)  # idle cluster: the pool's workers are kept started
    busy = training_step.remote(8)  # one CPU in use: nothing is taken from it
    time.sleep(1)
    assert not warmed_within(5)
    ray.get(busy)
    assert warmed_within(30)


def test_a_service_told_not_to_keep_workers_warm_starts_none(service, unique_run):
    import ray

    from trainer_integration._reporter import RunReporter

    assert not service.settings.keep_warm  # CKVAL_KEEP_WARM=0 (conftest)
    warmed = service.status()["warmed"]
    RunReporter(unique_run).prepare()
    assert ray.get(service.warm_up(["torch"]), timeout=60) == []
    time.sleep(3)  # two of its keep-warm looks
    assert service.status()["warmed"] == warmed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
