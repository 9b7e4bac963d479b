"""A job's validate_fn reference is bound to its signature: a database writer without
the key cannot turn a job into one that imports and calls a module of their choosing.

The reporter is the real one (Client), the registry real SQLite and PostgreSQL, the
attempt the body every executor runs; the tampering is an UPDATE of the job's row.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from ray.train import Checkpoint

from tests.inprocess_attempts import run_until_settled
from trainer_integration import Client
from validation_service.config import Settings
from validation_service.registry.registry import Registry


def validate(checkpoint, config) -> dict:
    with checkpoint.as_directory() as directory:
        return {"score": json.loads(Path(directory, "value.json").read_text())["value"]}


@pytest.fixture
def settings(registry, tmp_path) -> Settings:
    url = registry.engine.url.render_as_string(hide_password=False)
    return Settings(
        home=tmp_path / "home",
        database_url=url,
        storage=str(tmp_path / "storage"),
        secret_key="the-service-key",
        keep_warm=False,
    )


@pytest.fixture
def attacker_module(tmp_path, monkeypatch):
    """(reference, marker): a module whose import (its top-level code) creates marker."""
    name = f"downgrade_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / f"{name}.imported"
    folder = tmp_path / "attacker"
    folder.mkdir()
    (folder / f"{name}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
        "def validate(checkpoint, config):\n    return {'score': 666.0}\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    yield f"{name}:validate", marker
    sys.modules.pop(name, None)


def report(tmp_path, settings, run, validate_fn) -> int:
    folder = tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    (folder / "value.json").write_text(json.dumps({"value": 0.5}))
    client = Client(run, settings, start_service=False)
    try:
        client.report({"x": 1}, Checkpoint.from_directory(str(folder)), validate_fn=validate_fn)
        [job] = client.registry.validations(run)
    finally:
        client.close()
    return job.id


def tamper(registry: Registry, job_id: int, **columns) -> None:
    sets = ", ".join(f"{name} = :{name}" for name in columns)
    with registry.engine.begin() as connection:
        connection.execute(
            sa.text(f"UPDATE validation_jobs SET {sets} WHERE id = :id"),
            {**columns, "id": job_id},
        )


def assert_refused_unimported(job, marker: Path, registry: Registry, run: str) -> None:
    assert job.status == "FAILED" and job.attempts == 1, (job.status, job.error_message)
    assert job.error_type == "PayloadSignatureError", job.error_message
    assert "signature did not verify" in job.error_message
    assert not marker.exists()
    assert registry.checkpoints(run)[0].metrics.get("score") is None


@pytest.mark.parametrize("keep_config", [False, True], ids=["config-nulled", "config-kept"])
def test_a_signed_pickled_job_downgraded_to_a_reference_is_refused_before_any_import(
    registry, settings, tmp_path, unique_run, attacker_module, keep_config
):
    ref, marker = attacker_module
    job_id = report(tmp_path, settings, unique_run, validate)
    columns = {"validate_fn_pickle": None, "validate_fn_ref": ref}
    if not keep_config:
        columns["validate_config"] = None
    tamper(registry, job_id, **columns)

    job = run_until_settled(registry, settings, job_id)

    assert_refused_unimported(job, marker, registry, unique_run)


def test_a_signed_references_module_cannot_be_swapped(
    registry, settings, tmp_path, unique_run, attacker_module
):
    ref, marker = attacker_module
    job_id = report(tmp_path, settings, unique_run, f"{__name__}:validate")
    tamper(registry, job_id, validate_fn_ref=ref)

    job = run_until_settled(registry, settings, job_id)

    assert_refused_unimported(job, marker, registry, unique_run)


def test_a_signed_reference_still_runs(registry, settings, tmp_path, unique_run):
    job_id = report(tmp_path, settings, unique_run, f"{__name__}:validate")

    job = run_until_settled(registry, settings, job_id)

    assert job.status == "SUCCEEDED", job.error_message
    assert registry.checkpoints(unique_run)[0].metrics["score"] == 0.5
