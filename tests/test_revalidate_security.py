"""What a re-validation may do, through Python, the CLI and the HTTP API, on SQLite and
PostgreSQL: never run as report()'s own "default" validation, run over HTTP only the
programs the operator allows, stay within the API's caps, and never lend its signed
payloads to another job of the same checkpoint."""

from __future__ import annotations

import json
import shlex
import sys
import uuid

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from ray.train import Checkpoint
from sqlalchemy import select, update

from tests.test_revalidate import VALUES, read_value, reported_run, settle
from trainer_integration import Client
from validation_service.api import create_app
from validation_service.cli import main
from validation_service.config import Settings
from validation_service.errors import InvalidInput
from validation_service.registry.models import ValidationJob
from validation_service.registry.registry import Registry

READ_VALUE = "tests.test_revalidate:read_value"


@pytest.fixture
def settings(registry, tmp_path) -> Settings:
    """The registry's URL with this session's home (its signing key is the CLI's too)."""
    url = registry.engine.url.render_as_string(hide_password=False)
    return Settings(database_url=url, storage=str(tmp_path / "s"), service_name="ckval-none")


@pytest.fixture
def reg(settings):
    opened = Registry(settings=settings)
    yield opened
    opened.close()


def api(settings: Settings, reg: Registry, **changes) -> TestClient:
    return TestClient(
        create_app(settings.model_copy(update=changes), reg), base_url="http://localhost"
    )


def test_default_is_refused_everywhere_and_aliases_and_jobs_stay(
    reg, settings, tmp_path, unique_run
):
    """report()'s own validator merges into the checkpoint, moves aliases and drives
    retention: an evaluation over history may never take its name, even with force."""
    reported_run(tmp_path, settings, reg, unique_run)
    assert reg.track_alias(unique_run, "production", "score") == 3
    jobs_before = [job.id for job in reg.validations(unique_run)]

    with pytest.raises(InvalidInput, match="report\\(\\)'s own validation"):
        reg.revalidate(unique_run, read_value, validator="default", force=True)
    shell = CliRunner().invoke(
        main,
        ["--database-url", settings.database_url, "revalidate", unique_run]
        + ["--validator", "default", "--validate-fn", READ_VALUE, "--force"],
        env={"CKVAL_STORAGE": settings.storage},
    )
    body = {"validator": "default", "validate_fn": READ_VALUE, "force": True}
    with api(settings, reg, allowed_modules=["tests"]) as client:
        answer = client.post(f"/runs/{unique_run}/revalidate", json=body)

    assert shell.exit_code == 2, shell.output
    assert "report()'s own validation" in shell.output
    assert answer.status_code == 422, answer.text
    assert "report()'s own validation" in answer.json()["detail"]
    assert [job.id for job in reg.validations(unique_run)] == jobs_before  # nothing queued
    assert reg.get_alias_record(unique_run, "production").report_index == 3


def test_http_commands_run_only_the_allowed_programs(reg, settings, tmp_path, unique_run):
    """CKVAL_ALLOWED_MODULES bounds the references reporters may name; it no longer lets a
    token holder run any argv (a prefix as broad as "validation_service" did)."""
    reported_run(tmp_path, settings, reg, unique_run)
    shell = {"validator": "v2", "command": {"argv": ["sh", "-c", "id"]}}
    runner = {
        "validator": "v3",
        "validate_fn": "validation_service.validators.command:run_command",
        "validate_config": {"argv": ["sh", "-c", "id"]},
    }
    with api(settings, reg, allowed_modules=["validation_service"]) as client:
        no_list = client.post(f"/runs/{unique_run}/revalidate", json=shell)
        through_reference = client.post(f"/runs/{unique_run}/revalidate", json=runner)
    with api(
        settings, reg, allowed_modules=["validation_service"], allowed_commands=["lm_eval"]
    ) as client:
        not_listed = client.post(f"/runs/{unique_run}/revalidate", json=shell)

    for answer in (no_list, not_listed):
        assert answer.status_code == 403, answer.text
        assert "CKVAL_ALLOWED_COMMANDS" in answer.json()["detail"]
    assert through_reference.status_code == 403, through_reference.text
    assert "send it as `command`" in through_reference.json()["detail"]
    assert [job.validator for job in reg.validations(unique_run)] == ["default"] * len(VALUES)


def test_an_http_command_of_more_than_256_strings_is_refused(reg, settings, tmp_path, unique_run):
    reported_run(tmp_path, settings, reg, unique_run)
    url = f"/runs/{unique_run}/revalidate"
    with api(settings, reg, allowed_commands=["echo"]) as client:
        too_long = client.post(
            url, json={"validator": "v2", "command": {"argv": ["echo", *["x"] * 256]}}
        )
        empty = client.post(url, json={"validator": "v2", "command": {"argv": []}})
    for answer in (too_long, empty):
        assert answer.status_code == 422, answer.text
        assert "argv" in answer.text
    assert [job.validator for job in reg.validations(unique_run)] == ["default"] * len(VALUES)


def test_the_http_api_caps_what_one_revalidation_costs(reg, settings, tmp_path, unique_run):
    reported_run(tmp_path, settings, reg, unique_run)
    url = f"/runs/{unique_run}/revalidate"
    body = {"validator": "v2", "validate_fn": READ_VALUE}
    with api(settings, reg, allowed_modules=["tests"]) as client:
        huge_body = client.post(url, json={**body, "validate_config": {"x": "y" * 2_000_000}})
        big_config = client.post(url, json={**body, "validate_config": {"x": "y" * 100_000}})
    with api(settings, reg, allowed_modules=["tests"], max_queued_evaluations=3) as client:
        queue_full = client.post(url, json=body)
        within = client.post(url, json={**body, "reports": [0, 1, 2]})

    assert huge_body.status_code == 413, huge_body.text
    assert big_config.status_code == 422 and "bytes" in big_config.json()["detail"]
    assert queue_full.status_code == 422, queue_full.text
    assert "CKVAL_MAX_QUEUED_EVALUATIONS" in queue_full.json()["detail"]
    assert within.status_code == 200 and len(within.json()["job_ids"]) == 3
    assert len([j for j in reg.validations(unique_run) if j.validator == "v2"]) == 3


def test_force_counts_against_a_budget_as_retries_do(reg, settings, tmp_path, unique_run):
    """With CKVAL_MAX_MANUAL_RETRIES=1 a checkpoint gets at most 2 jobs of one validator
    through the API, forced or after failures; the rest are named in over_budget."""
    reported_run(tmp_path, settings, reg, unique_run)
    url = f"/runs/{unique_run}/revalidate"
    body = {"validator": "v2", "validate_fn": READ_VALUE, "force": True, "reports": [0, 1]}
    answers = []
    with api(settings, reg, allowed_modules=["tests"], max_manual_retries=1) as client:
        for _ in range(3):
            answers.append(client.post(url, json=body))
            reg.cancel_jobs(answers[-1].json()["job_ids"] or None, run=unique_run)

    assert [len(a.json()["job_ids"]) for a in answers] == [2, 2, 0], [a.text for a in answers]
    assert answers[-1].json()["over_budget"] == [0, 1]
    assert len([j for j in reg.validations(unique_run) if j.validator == "v2"]) == 4


def test_one_request_queues_at_most_a_thousand_jobs(reg, settings, unique_run):
    run_id = reg.ledger.ensure_run(unique_run, storage_root=settings.storage)
    stored = [
        {"report_index": i, "uri": f"{settings.storage}/x/{i}", "metrics": {}} for i in range(1001)
    ]
    reg.ledger.import_checkpoints(run_id, stored)
    with api(settings, reg, allowed_modules=["tests"]) as client:
        answer = client.post(
            f"/runs/{unique_run}/revalidate", json={"validator": "v2", "validate_fn": READ_VALUE}
        )

    assert answer.status_code == 422 and "at most 1000" in answer.json()["detail"]
    assert reg.validations(unique_run) == []


def test_a_named_jobs_payload_never_verifies_as_the_default_job(
    reg, settings, tmp_path, unique_run
):
    """A database writer without the key copies an evaluation's signed payload into the
    "default" job of the same checkpoint: the payload is bound to its validator and job
    key, so the attempt refuses it before unpickling anything."""
    folder = tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    (folder / "value.json").write_text(json.dumps({"value": 0.5}))
    with Client(unique_run, settings, start_service=False) as client:
        client.report({"step": 0}, Checkpoint.from_directory(str(folder)), validate_fn=read_value)
    [default] = reg.validations(unique_run)
    [named_id] = reg.revalidate(unique_run, read_value, validator="v2", validate_config={})
    jobs = ValidationJob.__table__
    with reg.engine.begin() as conn:
        named = conn.execute(select(jobs).where(jobs.c.id == named_id)).one()
        conn.execute(
            update(jobs)
            .where(jobs.c.id == default.id)
            .values(
                validate_fn_pickle=named.validate_fn_pickle, validate_config=named.validate_config
            )
        )

    [tampered, evaluated] = settle(reg, settings, [default.id, named_id])

    assert tampered.status == "FAILED" and tampered.error_type == "PayloadSignatureError"
    assert "signed for another job" in tampered.error_message
    assert evaluated.status == "SUCCEEDED" and evaluated.result_metrics == {"score": 0.5}
    assert reg.checkpoints(unique_run)[0].metrics == {"step": 0}  # nothing merged


def test_the_cli_gives_a_command_its_environment_with_env(reg, settings, tmp_path, unique_run):
    """A command's program no longer inherits the shell's CKVAL_* variables or secrets:
    `--env NAME=VALUE` is how the CLI hands it what it needs."""
    reported_run(tmp_path, settings, reg, unique_run)
    code = (
        "import json, os, sys; "
        "json.dump({'seed': float(os.environ['EVAL_SEED'])}, open(sys.argv[1], 'w'))"
    )
    command = shlex.join([sys.executable, "-c", code, "{result_path}"])
    base = ["--database-url", settings.database_url, "revalidate", unique_run, "--reports", "0"]
    storage = {"CKVAL_STORAGE": settings.storage}
    bad = CliRunner().invoke(
        main,
        [*base, "--validator", "envtest", "--command", command, "--env", "EVAL_SEED"],
        env=storage,
    )
    queued = CliRunner().invoke(
        main,
        [*base, "--validator", "envtest", "--command", command, "--env", "EVAL_SEED=7"],
        env=storage,
    )

    assert bad.exit_code == 2 and "NAME=VALUE" in bad.output
    assert queued.exit_code == 0, queued.output
    [job] = [j for j in reg.validations(unique_run) if j.validator == "envtest"]
    [done] = settle(reg, settings, [job.id])
    assert done.status == "SUCCEEDED" and done.result_metrics == {"seed": 7.0}
