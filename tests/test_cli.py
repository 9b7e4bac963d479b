"""The `ckval` command line over a real SQLite registry."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from validation_service.cli import main
from validation_service.registry.records import JobOutcome
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest


@pytest.fixture
def populated(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    registry = Registry(url)
    run_id = registry.ensure_run("digits", storage_root=str(tmp_path))
    job = ValidationRequest(
        executor_kind="ray_task",
        pool="CPU",
        validate_fn_name="validate",
        validate_fn_ref="json:dumps",
        max_attempts=1,
    )
    for index, loss in enumerate([0.9, 0.5, 0.7, 0.4]):
        registry.register_checkpoint(
            run_id,
            index,
            uri=f"{tmp_path}/ckpt_{index}",
            size_bytes=2048,
            manifest_sha256=None,
            reported_metrics={"epoch": index, "loss": loss},
            job=job,
        )
    claimed = registry.claim_due_jobs("cli-test", {}, lease_s=60)
    accuracy = {0: 0.61, 1: 0.83, 2: 0.77}
    for c in claimed:
        if c.report_index in accuracy:
            registry.finish_job(
                c.job_id,
                c.lease_token,
                JobOutcome(succeeded=True, metrics={"accuracy": accuracy[c.report_index]}),
            )
        else:
            registry.finish_job(
                c.job_id,
                c.lease_token,
                JobOutcome(
                    succeeded=False,
                    error_type="ValueError",
                    error_message="bad shard",
                    error_traceback="Traceback (most recent call last):\nValueError: bad shard",
                    retryable=False,
                ),
            )
    return url


def invoke(url, *args):
    result = CliRunner().invoke(main, ["--database-url", url, *args])
    return result.exit_code, result.output


def test_best_prints_a_ranked_table(populated):
    code, out = invoke(
        populated, "best", "digits", "--metric", "accuracy", "--mode", "max", "-k", "3"
    )
    assert code == 0, out
    lines = out.strip().splitlines()
    assert lines[0].split()[:5] == ["#", "report", "validation", "accuracy", "epoch"]
    assert [line.split()[1] for line in lines[2:]] == ["1", "2", "0"]
    assert "0.8300" in lines[2] and "ckpt_1" in lines[2]


def test_best_min_mode_and_json(populated):
    import json

    code, out = invoke(
        populated, "best", "digits", "--metric", "loss", "--mode", "min", "-k", "2", "--json"
    )
    assert code == 0, out
    assert [c["report_index"] for c in json.loads(out)] == [3, 1]


def test_checkpoints_and_jobs_tables(populated):
    code, out = invoke(populated, "checkpoints", "digits")
    assert code == 0, out
    assert len(out.strip().splitlines()) == 2 + 4
    assert "VALIDATED" in out and "FAILED" in out and "2.0KB" in out
    code, out = invoke(populated, "jobs", "digits")
    assert code == 0 and "ValueError: bad shard" in out
    job_id = next(line.split()[0] for line in out.splitlines() if "FAILED" in line)
    code, out = invoke(populated, "job", job_id)
    assert code == 0 and "Traceback (most recent call last)" in out


def test_unknown_run_and_metric_are_clear_errors(populated):
    code, out = invoke(populated, "best", "nope", "--metric", "accuracy")
    assert code == 2 and "No run named 'nope'" in out and "digits" in out
    code, out = invoke(populated, "best", "digits", "--metric", "f1")
    assert code == 2 and "'f1'" in out and "accuracy" in out


def test_cancel_and_retry_commands(populated):
    code, out = invoke(populated, "retry", "--run", "digits", "--failed")
    assert code == 0 and "requeued 1 job(s)" in out
    code, out = invoke(populated, "cancel", "--run", "digits")
    assert code == 0 and "cancelled 1 job(s)" in out


def test_db_commands(tmp_path):
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    from validation_service.registry._migrate import head_revision

    head = head_revision(url)
    code, out = invoke(url, "db", "upgrade")
    assert code == 0 and f"schema at {head}" in out
    code, out = invoke(url, "db", "current")
    assert out.strip() == head
