"""Signed payloads: what the registry stores is unpickled only once its signature verifies.

The reporter is the real one, the jobs run in real Ray tasks launched by a real Scheduler,
and tampering is what an attacker with write access to the database would do: an UPDATE
of the validation_jobs row.
"""

from __future__ import annotations

import json
import os
import pickle
import stat
import subprocess
import sys
import threading
from pathlib import Path

import cloudpickle
import pytest
from ray.train import Checkpoint

from trainer_integration import Client
from validation_service.config import Settings
from validation_service.errors import ModuleNotAllowed, PayloadSignatureError
from validation_service.registry.registry import Registry
from validation_service.service.scheduler import Scheduler
from validation_service.signing import KEY_FILE, PREFIX, PayloadTrust, job_binding, key_file

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.usefixtures("ray_session")


def read_value(checkpoint, config):
    with checkpoint.as_directory() as directory:
        value = json.loads(Path(directory, "value.json").read_text())["value"]
    return {"score": value * config.get("scale", 1)}


class _CreatesMarker:
    """What an attacker stores: unpickling it runs a shell command (creates a file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def evil_pickle(marker: Path) -> bytes:
    return pickle.dumps(_CreatesMarker(marker))


def make_checkpoint(tmp_path: Path, value: float) -> Checkpoint:
    directory = tmp_path / f"ckpt-{value}"
    directory.mkdir()
    (directory / "value.json").write_text(json.dumps({"value": value}))
    return Checkpoint.from_directory(str(directory))


def settings_for(tmp_path: Path, **values) -> Settings:
    """Settings of one test: its own SQLite registry, storage and CKVAL_HOME."""
    base = dict(
        home=tmp_path / "home",
        database_url=f"sqlite:///{tmp_path / 'registry.db'}",
        storage=str(tmp_path / "storage"),
        service_name=f"signing-{tmp_path.name}",
        poll_interval_s=0.05,
        heartbeat_s=0.0,
        retry_backoff_s=0.0,
    )
    return Settings(**{**base, **values})


def report_one(tmp_path, run, settings, **kwargs) -> int:
    """Reports one checkpoint with a validation through the real reporter; its job id."""
    client = Client(run, settings, start_service=False)
    client.report({"x": 1}, make_checkpoint(tmp_path, 2), **kwargs)
    [job] = client.registry.validations(run)
    assert job.status == "QUEUED"
    return job.id


def run_jobs(settings: Settings, run: str) -> Registry:
    """Runs the run's queued jobs with a service-side scheduler (real Ray tasks)."""
    registry = Registry(settings=settings)
    scheduler = Scheduler(registry, settings)
    thread = threading.Thread(target=scheduler.run_forever, daemon=True)
    thread.start()
    try:
        registry.wait(run, timeout_s=120)
    finally:
        scheduler.stop()
        thread.join(30)
    return registry


def tamper(registry: Registry, job_id: int, **columns) -> None:
    sets = ", ".join(f"{name} = :{name}" for name in columns)
    with registry.engine.begin() as connection:
        connection.exec_driver_sql(
            f"UPDATE validation_jobs SET {sets} WHERE id = :id", {**columns, "id": job_id}
        )


def test_a_tampered_validate_config_is_never_unpickled(tmp_path, unique_run):
    settings = settings_for(tmp_path, secret_key="shared-key")
    job_id = report_one(
        tmp_path, unique_run, settings, validate_fn=read_value, validate_config={"scale": 3}
    )
    marker = tmp_path / "config-was-unpickled"
    registry = Registry(settings=settings)
    tamper(registry, job_id, validate_config=evil_pickle(marker))

    job = run_jobs(settings, unique_run).get_job(job_id)

    assert job.status == "FAILED" and job.attempts == 1
    assert job.error_type == "PayloadSignatureError"
    assert "validate_config payload's signature did not verify" in job.error_message
    assert "carries no signature" in job.error_message
    assert "CKVAL_SECRET_KEY" in job.error_message
    assert not marker.exists()
    assert registry.checkpoints(unique_run)[0].metrics.get("score") is None


def test_a_tampered_validate_fn_is_never_unpickled(tmp_path, unique_run):
    settings = settings_for(tmp_path, secret_key="shared-key")
    job_id = report_one(tmp_path, unique_run, settings, validate_fn=read_value)
    marker = tmp_path / "fn-was-unpickled"
    tamper(Registry(settings=settings), job_id, validate_fn_pickle=evil_pickle(marker))

    job = run_jobs(settings, unique_run).get_job(job_id)

    assert job.status == "FAILED" and job.attempts == 1
    assert job.error_type == "PayloadSignatureError"
    assert "validate_fn payload's signature did not verify" in job.error_message
    assert "carries no signature" in job.error_message
    assert not marker.exists()


def test_reporter_and_service_with_different_keys_fail_clearly(tmp_path, unique_run):
    reporter = settings_for(tmp_path, secret_key="reporter-key")
    job_id = report_one(tmp_path, unique_run, reporter, validate_fn=read_value)

    service = reporter.model_copy(update={"secret_key": "service-key"})
    job = run_jobs(service, unique_run).get_job(job_id)

    assert job.status == "FAILED" and job.attempts == 1
    assert job.error_type == "PayloadSignatureError"
    assert "different CKVAL_SECRET_KEY" in job.error_message
    assert "no configured key produced its signature" in job.error_message
    assert "reporter-key" not in job.error_message and "service-key" not in job.error_message


def test_a_forged_signature_does_not_verify(tmp_path):
    trust = PayloadTrust.from_settings(Settings(home=tmp_path, secret_key="k"))
    job = job_binding("default", "r", 0, "/ckpts/r/checkpoint_000000")
    signed = trust.sign("validate_config", b"payload", bound_to=job)
    forged = PREFIX + bytes(32) + b"payload"
    assert trust.verify("validate_config", signed, bound_to=job) == b"payload"
    with pytest.raises(PayloadSignatureError, match="no configured key produced"):
        trust.verify("validate_config", forged, bound_to=job)
    with pytest.raises(PayloadSignatureError, match="validate_fn payload"):
        # signed as a config, never valid as a function
        trust.verify("validate_fn", signed, bound_to=job)
    for other in [
        job_binding("default", "r", 1, "/ckpts/r/checkpoint_000000"),
        job_binding("default", "r2", 0, "/ckpts/r/checkpoint_000000"),
        job_binding("other", "r", 0, "/ckpts/r/checkpoint_000000"),
        job_binding("default", "r", 0, "/ckpts/r/checkpoint_000001"),
    ]:
        with pytest.raises(PayloadSignatureError, match="signed for another job"):
            trust.verify("validate_config", signed, bound_to=other)
    unbound = b"ckv1:" + signed[len(PREFIX) :]  # as an older ckval stored it
    with pytest.raises(PayloadSignatureError, match="without binding it to its job"):
        trust.verify("validate_config", unbound, bound_to=job)


def test_a_signed_payload_copied_onto_another_job_is_never_unpickled(tmp_path, unique_run):
    """What a database writer without the key might try: the signed validate_config of
    one job, copied into another job's row, to run that job with the first one's config."""
    settings = settings_for(tmp_path, secret_key="shared-key")
    client = Client(unique_run, settings, start_service=False)
    for value, scale in ((2, 3), (5, 1000)):
        client.report(
            {"x": value},
            make_checkpoint(tmp_path, value),
            validate_fn=read_value,
            validate_config={"scale": scale},
        )
    first, second = client.registry.validations(unique_run)
    registry = Registry(settings=settings)
    with registry.engine.begin() as connection:
        [stored] = connection.exec_driver_sql(
            "SELECT validate_config FROM validation_jobs WHERE id = ?", (second.id,)
        ).one()
    tamper(registry, first.id, validate_config=stored)

    run_jobs(settings, unique_run)

    job = registry.get_job(first.id)
    assert job.status == "FAILED" and job.error_type == "PayloadSignatureError"
    assert "signed for another job" in job.error_message
    assert registry.get_job(second.id).status == "SUCCEEDED"
    scores = [c.metrics.get("score") for c in registry.checkpoints(unique_run)]
    assert scores == [None, 5000]


def test_during_a_rotation_the_previous_key_still_verifies(tmp_path, unique_run):
    reporter = settings_for(tmp_path, secret_key="old-key")
    job_id = report_one(
        tmp_path, unique_run, reporter, validate_fn=read_value, validate_config={"scale": 5}
    )

    service = reporter.model_copy(
        update={"secret_key": "new-key", "secret_key_previous": "old-key"}
    )
    registry = run_jobs(service, unique_run)

    assert registry.get_job(job_id).status == "SUCCEEDED"
    assert registry.checkpoints(unique_run)[0].metrics["score"] == 10


def test_the_key_file_is_made_once_with_mode_0600_and_reused(tmp_path):
    home = tmp_path / "home"
    settings = Settings(home=home)

    first = PayloadTrust.from_settings(settings)
    path = home / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_text()) == 64  # 32 random bytes, hex
    second = PayloadTrust.from_settings(Settings(home=home))
    assert first.keys == second.keys == (path.read_text().encode(),)
    assert os.listdir(home) == [KEY_FILE]  # no draft left behind


def test_processes_racing_to_make_the_key_file_all_get_the_winners_key(tmp_path):
    home = tmp_path / "home"
    go = tmp_path / "go"
    program = (
        "import os, sys, time\n"
        "from validation_service.signing import key_file\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.001)\n"
        f"print(key_file({str(home)!r}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    racers = [
        subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, env=env)
        for _ in range(4)
    ]
    go.touch()
    keys = {racer.communicate(timeout=120)[0].decode().strip() for racer in racers}
    assert keys == {key_file(home)}
    assert sorted(os.listdir(home)) == [KEY_FILE]


def test_a_disallowed_module_is_refused_at_report_time(tmp_path, unique_run):
    settings = settings_for(tmp_path, allowed_modules=["tests.test_signing"])
    client = Client(unique_run, settings, start_service=False)

    with pytest.raises(ModuleNotAllowed, match="'json:dumps' names a module outside"):
        client.report({"x": 1}, make_checkpoint(tmp_path, 1), validate_fn="json:dumps")

    assert list((tmp_path / "storage").rglob("*")) == []
    assert client.registry.checkpoints(unique_run) == []


def test_the_allowed_modules_setting_reads_a_list_or_commas(monkeypatch):
    monkeypatch.setenv("CKVAL_ALLOWED_MODULES", "mypkg.validators, other")
    assert Settings().allowed_modules == ["mypkg.validators", "other"]
    monkeypatch.setenv("CKVAL_ALLOWED_MODULES", '["mypkg"]')
    assert Settings().allowed_modules == ["mypkg"]
    monkeypatch.setenv("CKVAL_ALLOWED_MODULES", "")
    assert Settings().allowed_modules is None


def test_a_disallowed_module_is_refused_by_the_service_and_never_imported(
    tmp_path, unique_run, session_home
):
    """A reporter whose settings allow any module reports a reference the service's
    CKVAL_ALLOWED_MODULES does not allow: the service refuses it without importing it."""
    reporter = settings_for(tmp_path)
    job_id = report_one(
        tmp_path, unique_run, reporter, validate_fn="tests.signing_marker_module:validate"
    )
    # The reporter imported it to check it; the service's workers must not.
    marker = session_home / "signing_marker_module.imported"
    marker.unlink(missing_ok=True)

    service = reporter.model_copy(update={"allowed_modules": ["json"]})
    job = run_jobs(service, unique_run).get_job(job_id)

    assert job.status == "FAILED" and job.attempts == 1
    assert job.error_type == "ModuleNotAllowed"
    assert "outside CKVAL_ALLOWED_MODULES (json)" in job.error_message
    assert not marker.exists()


def test_allowed_modules_bound_the_whole_reference_not_only_its_module(tmp_path, unique_run):
    """With only "json" allowed, "json:codecs.open" walks from json into codecs: refused
    when reported, and by the service for a reference a reporter without the list signed."""
    settings = settings_for(tmp_path, allowed_modules=["json"])
    client = Client(unique_run, settings, start_service=False)
    with pytest.raises(ModuleNotAllowed, match="'json:codecs.open' leads to codecs, outside"):
        client.report({"x": 1}, make_checkpoint(tmp_path, 1), validate_fn="json:codecs.open")
    assert client.registry.checkpoints(unique_run) == []
    client.close()

    unrestricted = settings.model_copy(update={"allowed_modules": None})
    run = f"{unique_run}-b"
    job_id = report_one(tmp_path, run, unrestricted, validate_fn="json:codecs.open")
    job = run_jobs(settings, run).get_job(job_id)
    assert job.status == "FAILED" and job.error_type == "ModuleNotAllowed"
    assert "leads to codecs" in job.error_message


def test_a_shared_database_without_a_key_warns_once(tmp_path, caplog, monkeypatch):
    from validation_service import signing

    monkeypatch.setattr(signing, "_warned_shared", False)
    settings = Settings(home=tmp_path, database_url="postgresql+psycopg://u:pw@db/ckval")
    with caplog.at_level("WARNING", logger="validation_service.signing"):
        PayloadTrust.from_settings(settings)
        PayloadTrust.from_settings(settings)
    [record] = caplog.records
    assert "must set the same CKVAL_SECRET_KEY" in record.getMessage()
    assert "pw" not in record.getMessage()
