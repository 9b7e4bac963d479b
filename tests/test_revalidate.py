"""Evaluations over history: a second, named validator over a run's stored checkpoints
(here an outside program, CommandValidator), its metrics apart from report()'s, on
SQLite and PostgreSQL. Attempts run in this process (tests/inprocess_attempts.py), the
body every executor runs; the Ray path is in tests/test_revalidate_service.py."""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import pytest
from ray.train import Checkpoint

from tests.inprocess_attempts import InProcessExecutor
from trainer_integration import Client
from validation_service.config import Settings
from validation_service.errors import InvalidInput, UnknownMetric
from validation_service.registry.registry import Registry
from validation_service.retry import RetryPolicy
from validation_service.service.scheduler import Scheduler
from validation_service.validators import CommandValidator

VALUES = [0.1, 0.5, 0.3, 0.9, 0.7]

# The outside program: reads the checkpoint's value and writes torchtitan's result file.
PROGRAM = """
import json, sys
checkpoint_dir, result_path, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
value = json.load(open(checkpoint_dir + "/value.json"))["value"]
print(f"evaluating step {step}")
print(f"value {value}", file=sys.stderr)
with open(result_path, "w") as f:
    json.dump({"metrics": {"score": value * 2, "exact": 1.0}, "step": step}, f)
"""
FAILING = """
import sys
print("loading", file=sys.stderr)
print("RuntimeError: CUDA out of memory (simulated)", file=sys.stderr)
sys.exit(1)
"""
SLOW = """
import sys, time
print("started, now hanging", file=sys.stderr, flush=True)
time.sleep(60)
"""


def read_value(checkpoint, config) -> dict:
    with checkpoint.as_directory() as folder:
        return {"score": json.loads((Path(folder) / "value.json").read_text())["value"]}


@pytest.fixture
def settings(registry, tmp_path) -> Settings:
    url = registry.engine.url.render_as_string(hide_password=False)
    return Settings(home=tmp_path / "home", database_url=url, storage=str(tmp_path / "s"))


@pytest.fixture
def reg(settings):
    """A registry with the test's settings (its signing key is the scheduler's)."""
    opened = Registry(settings=settings)
    yield opened
    opened.close()


def settle(registry: Registry, settings: Settings, job_ids, timeout_s=90.0):
    """Ticks an in-process scheduler until none of the jobs is QUEUED or RUNNING."""
    scheduler = Scheduler(
        registry,
        settings,
        executors={"ray_task": InProcessExecutor(settings)},
        retry_policy=RetryPolicy(backoff_s=0.0),
    )
    deadline = time.monotonic() + timeout_s
    while any(registry.get_job(j).status in ("QUEUED", "RUNNING") for j in job_ids):
        assert time.monotonic() < deadline, [registry.get_job(j).status for j in job_ids]
        scheduler.tick()
    return [registry.get_job(j) for j in job_ids]


def reported_run(tmp_path, settings, registry, run) -> list[int]:
    """A finished run of 5 checkpoints validated by report()'s own ("default") validator."""
    with Client(run, settings, start_service=False) as client:
        for step, value in enumerate(VALUES):
            folder = tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"
            folder.mkdir()
            (folder / "value.json").write_text(json.dumps({"value": value}))
            client.report(
                {"step": step}, Checkpoint.from_directory(str(folder)), validate_fn=read_value
            )
    jobs = registry.validations(run)
    settle(registry, settings, [job.id for job in jobs])
    return [job.id for job in jobs]


def program(tmp_path, text: str, name: str = "eval.py") -> list[str]:
    path = tmp_path / name
    path.write_text(text)
    return [sys.executable, str(path), "{checkpoint_dir}", "{result_path}", "{step}"]


def test_a_command_validator_evaluates_every_checkpoint_apart_from_the_first(
    reg, settings, tmp_path, unique_run
):
    reported_run(tmp_path, settings, reg, unique_run)

    job_ids = reg.revalidate(
        unique_run, CommandValidator(program(tmp_path, PROGRAM)), validator="v2"
    )
    jobs = settle(reg, settings, job_ids)

    assert [job.status for job in jobs] == ["SUCCEEDED"] * 5
    assert {job.validator for job in jobs} == {"v2"}
    records = reg.checkpoints(unique_run)
    assert [r.metrics["score"] for r in records] == VALUES  # default metrics unchanged
    assert [r.evaluations["default"]["score"] for r in records] == VALUES
    assert [r.evaluations["v2"]["score"] for r in records] == [v * 2 for v in VALUES]
    assert [r.validation_status for r in records] == ["VALIDATED"] * 5
    [(_, best_v2)] = reg.best_checkpoints(unique_run, "score", "max", validator="v2")
    assert best_v2 == {"score": 1.8, "exact": 1.0}
    [(_, best_default)] = reg.best_checkpoints(unique_run, "score", "max")
    assert best_default["score"] == 0.9
    lowest = reg.best_checkpoint_records(unique_run, "score", "min", k=2, validator="v2")
    assert [r.report_index for r in lowest] == [0, 2]
    log = jobs[3].attempt_history[-1].log
    assert "evaluating step 3" in log and "value 0.9" in log, log


def test_asking_again_queues_nothing_unless_forced(reg, settings, tmp_path, unique_run):
    reported_run(tmp_path, settings, reg, unique_run)
    validator = CommandValidator(program(tmp_path, PROGRAM))
    first = reg.revalidate(unique_run, validator, validator="v2")

    assert reg.revalidate(unique_run, validator, validator="v2") == []  # queued: nothing
    settle(reg, settings, first)
    assert reg.revalidate(unique_run, validator, validator="v2") == []  # succeeded: nothing
    forced = reg.revalidate(unique_run, validator, validator="v2", force=True, reports=[1, 3])

    assert len(forced) == 2 and not set(forced) & set(first)
    assert [job.report_index for job in settle(reg, settings, forced)] == [1, 3]
    # report()'s own validator is no evaluation over history: refused, nothing queued.
    with pytest.raises(InvalidInput, match="report\\(\\)'s own validation"):
        reg.revalidate(unique_run, read_value, validator="default", force=True)


def test_a_failing_program_ends_failed_with_its_stderr_tail(reg, settings, tmp_path, unique_run):
    reported_run(tmp_path, settings, reg, unique_run)

    [job_id] = reg.revalidate(
        unique_run, CommandValidator(program(tmp_path, FAILING)), validator="v2", reports=[0]
    )
    [job] = settle(reg, settings, [job_id])

    assert job.status == "FAILED" and job.attempts == 1, job
    assert "exited with code 1" in job.error_message
    assert "CUDA out of memory (simulated)" in job.error_message
    assert reg.checkpoints(unique_run)[0].validation_status == "VALIDATED"  # untouched
    # A failed evaluation is tried again by the next revalidate.
    assert len(reg.revalidate(unique_run, read_value, validator="v2", reports=[0])) == 1


def test_a_program_past_its_timeout_is_killed_and_ends_timed_out(
    reg, settings, tmp_path, unique_run
):
    reported_run(tmp_path, settings, reg, unique_run)
    validator = CommandValidator(program(tmp_path, SLOW), timeout_s=1.5)

    [job_id] = reg.revalidate(unique_run, validator, validator="slow", reports=[2])
    started = time.monotonic()
    [job] = settle(reg, settings, [job_id])

    assert time.monotonic() - started < 30
    assert job.status == "TIMED_OUT", (job.status, job.error_message)
    assert "process group" in job.error_message and "now hanging" in job.error_message
    assert job.timeout_s == pytest.approx(1.5 + 30.0)
    assert "killed on timeout" in job.attempt_history[-1].log


def test_a_flat_result_and_a_missing_result(reg, settings, tmp_path, unique_run):
    reported_run(tmp_path, settings, reg, unique_run)
    flat = "import json, sys; json.dump({'f1': 0.25}, open(sys.argv[2], 'w'))"
    silent = "print('done')"

    [flat_id] = reg.revalidate(
        unique_run, CommandValidator(program(tmp_path, flat, "flat.py")), validator="flat"
    )[:1]
    [silent_id] = reg.revalidate(
        unique_run,
        CommandValidator(program(tmp_path, silent, "silent.py")),
        validator="silent",
        reports=[0],
    )
    flat_job, silent_job = settle(reg, settings, [flat_id, silent_id])

    assert flat_job.status == "SUCCEEDED" and flat_job.result_metrics == {"f1": 0.25}
    assert silent_job.status == "FAILED" and "wrote no result" in silent_job.error_message


def test_a_search_result_and_a_list_of_runs(reg, settings, tmp_path, unique_run):
    reported_run(tmp_path, settings, reg, unique_run)
    other = unique_run + "-b"
    reported_run(tmp_path, settings, reg, other)

    both = reg.revalidate([unique_run, other], read_value, validator="again")
    found = reg.search("metrics.score >= 0.7")
    picked = reg.revalidate(found, read_value, validator="top")

    assert len(both) == 10
    assert len(picked) == len(found) == 4
    assert {reg.get_job(j).report_index for j in picked} == {3, 4}


def test_deleted_checkpoints_are_skipped_and_named(reg, settings, tmp_path, unique_run, caplog):
    reported_run(tmp_path, settings, reg, unique_run)
    reg.apply_retention(unique_run, metric="score", keep_best_per_run=1, keep_latest=1)

    with caplog.at_level("WARNING"):
        job_ids = reg.revalidate(unique_run, read_value, validator="v2")

    assert [reg.get_job(j).report_index for j in job_ids] == [3, 4]
    assert f"skipped deleted checkpoints [('{unique_run}', 0)" in caplog.text


def test_bad_input_is_refused_before_anything_is_queued(reg, settings, tmp_path, unique_run):
    reported_run(tmp_path, settings, reg, unique_run)
    good = CommandValidator(program(tmp_path, PROGRAM))

    with pytest.raises(InvalidInput, match=r"has no checkpoint at report index \[7\]"):
        reg.revalidate(unique_run, good, validator="v2", reports=[0, 7])
    with pytest.raises(InvalidInput, match="validator name"):
        reg.revalidate(unique_run, good, validator="no/slash")
    with pytest.raises(InvalidInput, match="takes no validate_config"):
        reg.revalidate(unique_run, good, validator="v2", validate_config={"a": 1})
    with pytest.raises(InvalidInput, match="run name, a list of run names"):
        reg.revalidate(42, good, validator="v2")
    with pytest.raises(InvalidInput, match="non-empty list of strings"):
        CommandValidator("python eval.py")
    with pytest.raises(InvalidInput, match="timeout_s must be a positive"):
        CommandValidator(["true"], timeout_s=0)
    with pytest.raises(UnknownMetric, match="from validator 'v2'"):
        reg.best_checkpoints(unique_run, "score", validator="v2")
    assert all(job.validator == "default" for job in reg.validations(unique_run))


def test_a_registered_outside_folder_is_evaluated_and_never_deleted(
    reg, settings, tmp_path, unique_run
):
    reported_run(tmp_path, settings, reg, unique_run)
    released = tmp_path / "released-model"
    released.mkdir()
    (released / "value.json").write_text(json.dumps({"value": 0.95}))

    index = reg.register(unique_run, str(released), metrics={"source": 1.0}, step=1000)
    [job_id] = reg.revalidate(
        unique_run, CommandValidator(program(tmp_path, PROGRAM)), validator="v2", reports=[index]
    )
    [job] = settle(reg, settings, [job_id])
    deleted = reg.apply_retention(unique_run, metric="score", keep_best_per_run=0, keep_latest=0)

    assert index == 5 and job.status == "SUCCEEDED"
    assert reg.checkpoints(unique_run)[-1].evaluations == {"v2": {"score": 1.9, "exact": 1.0}}
    assert index not in {record.report_index for record in deleted}
    assert (released / "value.json").exists()
    assert reg.checkpoints(unique_run)[-1].step == 1000


def test_register_refuses_what_is_no_folder(reg, tmp_path, unique_run):
    from validation_service.errors import CheckpointNotFound

    (tmp_path / "file.bin").write_bytes(b"x")

    with pytest.raises(CheckpointNotFound, match="no folder|nothing there"):
        reg.register(unique_run, str(tmp_path / "missing"))
    with pytest.raises(CheckpointNotFound, match="a file, not a folder"):
        reg.register(unique_run, str(tmp_path / "file.bin"))
    assert reg.find_run_id(unique_run) is None  # nothing written


def test_the_queue_hands_out_live_jobs_first_and_keeps_a_slot_for_them(
    reg, settings, tmp_path, unique_run
):
    reported_run(tmp_path, settings, reg, unique_run)
    backlog = reg.revalidate(unique_run, read_value, validator="v2")  # 5 background jobs
    with Client(unique_run + "-live", settings, start_service=False) as client:
        folder = tmp_path / "live"
        folder.mkdir()
        (folder / "value.json").write_text(json.dumps({"value": 0.4}))
        client.report({"step": 0}, Checkpoint.from_directory(str(folder)), validate_fn=read_value)
    [live] = reg.validations(unique_run + "-live")

    claimed = reg.job_queue.claim_due_jobs("test", {"CPU": 4}, lease_s=60)

    # The live run's job first; background ones leave one of the 4 slots free.
    assert [c.job_id for c in claimed] == [live.id, *backlog[:2]]
    assert reg.job_queue.claim_due_jobs("test", {"CPU": 4}, lease_s=60) == []
    assert [c.job_id for c in reg.job_queue.claim_due_jobs("test", {"CPU": 1}, lease_s=60)] == []


def test_a_registered_folder_on_s3_is_downloaded_and_evaluated(registry, tmp_path, unique_run):
    """register() takes any fsspec URI: a folder on S3 (moto's server on loopback), read
    with the settings' storage options while the storage itself is a local folder."""
    import boto3

    from tests.moto_s3 import CREDENTIALS, moto_s3_server

    with moto_s3_server("models") as endpoint:
        options = {
            "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "endpoint_url": endpoint,
            "client_kwargs": {"region_name": CREDENTIALS["AWS_DEFAULT_REGION"]},
        }
        url = registry.engine.url.render_as_string(hide_password=False)
        settings = Settings(
            home=tmp_path / "home",
            database_url=url,
            storage=str(tmp_path / "s"),
            storage_options=options,
        )
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            **{k.lower(): v for k, v in CREDENTIALS.items() if "KEY" in k},
        )
        s3.put_object(Bucket="models", Key="released/value.json", Body=b'{"value": 0.25}')
        reg = Registry(settings=settings)
        try:
            index = reg.register(unique_run, "s3://models/released")
            [job_id] = reg.revalidate(
                unique_run, CommandValidator(program(tmp_path, PROGRAM)), validator="v2"
            )
            [job] = settle(reg, settings, [job_id])
            [record] = reg.checkpoints(unique_run)
        finally:
            reg.close()

    assert index == 0 and record.uri == "s3://models/released" and record.size_bytes == 15
    assert job.status == "SUCCEEDED", job.error_message
    assert record.evaluations == {"v2": {"score": 0.5, "exact": 1.0}}
