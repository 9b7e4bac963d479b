"""Evaluations over history through the running service: a CommandValidator's program
runs in a Ray task for each stored checkpoint, beside report()'s own validations."""

from __future__ import annotations

import json
import sys
import uuid

from ray.train import Checkpoint

from tests.test_revalidate import PROGRAM, VALUES, read_value
from trainer_integration import Client
from validation_service.registry.registry import Registry
from validation_service.registry.waiting import wait_for_jobs
from validation_service.validators import CommandValidator


def test_the_service_runs_a_command_validator_over_a_runs_history(service, tmp_path, unique_run):
    with Client(unique_run) as client:
        for step, value in enumerate(VALUES):
            folder = tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"
            folder.mkdir()
            (folder / "value.json").write_text(json.dumps({"value": value}))
            client.report(
                {"step": step}, Checkpoint.from_directory(str(folder)), validate_fn=read_value
            )
    registry = Registry()
    registry.wait(unique_run, timeout_s=120)
    script = tmp_path / "eval.py"
    script.write_text(PROGRAM)
    validator = CommandValidator(
        [sys.executable, str(script), "{checkpoint_dir}", "{result_path}", "{step}"],
        timeout_s=60,
    )

    job_ids = registry.revalidate(unique_run, validator, validator="v2")
    counts = wait_for_jobs(registry, job_ids, "v2", timeout_s=180, poll_s=0.2, progress=False)

    assert counts == {"SUCCEEDED": 5}, [registry.get_job(j).error_message for j in job_ids]
    records = registry.checkpoints(unique_run)
    assert [r.metrics["score"] for r in records] == VALUES
    assert [r.evaluations["v2"]["score"] for r in records] == [v * 2 for v in VALUES]
    job = registry.get_job(job_ids[0])
    assert job.attempt_history[-1].node_id  # it ran in a Ray task on a node
    assert "evaluating step 0" in job.attempt_history[-1].log
    registry.close()
