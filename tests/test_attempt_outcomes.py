"""What a validate_fn returns that no registry can store ends its job FAILED at once,
naming the bad key, on SQLite and PostgreSQL (no retries, no lease error)."""

from __future__ import annotations

import pytest

from tests.inprocess_attempts import run_until_settled
from tests.test_signed_references import report
from validation_service.config import Settings


@pytest.fixture
def settings(registry, tmp_path) -> Settings:
    url = registry.engine.url.render_as_string(hide_password=False)
    return Settings(home=tmp_path / "home", database_url=url, storage=str(tmp_path / "s"))


def lone_surrogate_name(checkpoint, config) -> dict:
    return {"acc\ud800": 0.5}


def nul_in_name(checkpoint, config) -> dict:
    return {"acc\x00uracy": 0.5}


def lone_surrogate_nested(checkpoint, config) -> dict:
    return {"per_class": {"cat\udfff": 0.5}}


@pytest.mark.parametrize(
    ("validate_fn", "named"),
    [
        (lone_surrogate_name, r"'acc\ud800'"),
        (nul_in_name, r"'acc\x00uracy'"),
        (lone_surrogate_nested, r"'cat\udfff'"),
    ],
    ids=["surrogate", "nul", "nested-surrogate"],
)
def test_a_metric_name_no_database_stores_fails_the_job_at_once(
    registry, settings, tmp_path, unique_run, validate_fn, named
):
    job_id = report(tmp_path, settings, unique_run, validate_fn)

    job = run_until_settled(registry, settings, job_id)

    assert job.status == "FAILED" and job.attempts == 1, (job.status, job.error_message)
    assert job.error_type == "InvalidInput", job.error_message
    assert named in job.error_message, job.error_message
    assert "lease" not in job.error_message


def raises_unstorable_text(checkpoint, config) -> dict:
    raise ValueError("label \ud800 and \x00 are bad")


def test_an_error_message_no_database_stores_is_stored_escaped(
    registry, settings, tmp_path, unique_run
):
    job_id = report(tmp_path, settings, unique_run, raises_unstorable_text)

    job = run_until_settled(registry, settings, job_id)

    assert job.status == "FAILED" and job.error_type == "ValueError", job.error_message
    assert job.error_message == r"label \ud800 and \x00 are bad"
    assert r"\ud800" in job.error_traceback
