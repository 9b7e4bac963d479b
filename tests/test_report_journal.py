"""A SYNC report that returned before its index was reserved is never lost: a process that
dies before registering it leaves a record, and the next reporter of the run finishes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

from ray.train import Checkpoint

from trainer_integration._journal import RECORD_SUFFIX, ReportJournal
from trainer_integration._reporter import RunReporter
from validation_service.config import get_settings
from validation_service.payloads import validation_request

# The reporting process: reports SYNC with copy_now (as report() does inside Ray Train),
# with the step named by BLOCK held back, and dies at once after report() returns.
REPORTER = textwrap.dedent(
    """
    import json, os, sys, threading
    from ray.train import Checkpoint
    from trainer_integration._reporter import RunReporter
    from validation_service.payloads import validation_request

    run, folder, block = sys.argv[1], sys.argv[2], sys.argv[3]
    reporter = RunReporter(run, start_service=False)
    held = threading.Event()
    if block == "reserve":
        reporter._thread("reserve").submit(held.wait)
    else:  # the index is reserved and the copy renamed; the registration never runs
        for _ in range(2):
            reporter._thread("report").submit(held.wait)
    job = validation_request("json:dumps", {"indent": 1}, None, 0, None, 3)
    stored = reporter.store_and_register(
        {"step": 7, "loss": 0.25}, Checkpoint.from_directory(folder), job, copy_now=True
    )
    if block != "reserve":
        stored.stored.result()
    os._exit(0)
    """
)


def _checkpoint_folder(tmp_path, value: int) -> str:
    folder = tmp_path / f"source-{value}"
    folder.mkdir()
    (folder / "state.json").write_text(json.dumps({"value": value}))
    return str(folder)


def _report_and_die(run: str, folder: str, block: str, home) -> None:
    env = {**os.environ, "CKVAL_HOME": str(home)}
    subprocess.run([sys.executable, "-c", REPORTER, run, folder, block], env=env, check=True)


def _run_folder(home, run: str) -> str:
    settings = get_settings(home=str(home))
    return os.path.join(settings.resolved_storage(), settings.namespace, run)


def test_a_report_whose_process_died_before_its_index_is_finished_by_the_next_reporter(
    tmp_path, unique_run
):
    home = tmp_path / "home"
    _report_and_die(unique_run, _checkpoint_folder(tmp_path, 1), "reserve", home)
    run_folder = _run_folder(home, unique_run)
    [record] = [n for n in os.listdir(run_folder) if n.endswith(RECORD_SUFFIX)]
    reporter = RunReporter(unique_run, get_settings(home=str(home)), start_service=False)
    journal = ReportJournal(reporter.storage, "default", unique_run, reporter.trust)
    assert journal._read(os.path.join(run_folder, record))["report_index"] is None

    [checkpoint] = reporter.registry.checkpoints(unique_run)
    assert (checkpoint.report_index, checkpoint.reported_metrics) == (0, {"step": 7, "loss": 0.25})
    assert checkpoint.step == 7
    assert checkpoint.uri == os.path.join(run_folder, "checkpoint_000000")
    reporter.storage.verify(checkpoint.uri, checkpoint.manifest_sha256)
    with open(os.path.join(checkpoint.uri, "state.json")) as f:
        assert json.load(f) == {"value": 1}
    [job] = reporter.registry.validations(unique_run)
    assert job.validate_fn_name == "json:dumps" and job.status == "QUEUED"
    assert sorted(os.listdir(run_folder)) == ["checkpoint_000000"]  # no record, no staging
    # This process's next report follows on.
    folder = _checkpoint_folder(tmp_path, 2)
    index, _ = reporter.report(_sync({"step": 8}), Checkpoint.from_directory(folder))
    assert index == 1
    reporter.close()


def test_a_report_renamed_to_its_index_but_not_registered_keeps_its_index(tmp_path, unique_run):
    home = tmp_path / "home"
    _report_and_die(unique_run, _checkpoint_folder(tmp_path, 1), "register", home)
    run_folder = _run_folder(home, unique_run)
    assert "checkpoint_000000" in os.listdir(run_folder)
    reporter = RunReporter(unique_run, get_settings(home=str(home)), start_service=False)
    [checkpoint] = reporter.registry.checkpoints(unique_run)
    assert checkpoint.report_index == 0 and checkpoint.reported_metrics["loss"] == 0.25
    reporter.storage.verify(checkpoint.uri, checkpoint.manifest_sha256)
    assert sorted(os.listdir(run_folder)) == ["checkpoint_000000"]
    reporter.close()


def test_a_living_writers_report_is_never_taken_over(tmp_path, unique_run):
    settings = get_settings(home=str(tmp_path / "home"))
    writer = RunReporter(unique_run, settings, start_service=False)
    held = threading.Event()
    writer._thread("reserve").submit(held.wait)
    job = validation_request("json:dumps", None, None, 0, None, 3)
    stored = writer.store_and_register(
        {"step": 1}, Checkpoint.from_directory(_checkpoint_folder(tmp_path, 1)), job, copy_now=True
    )
    # Another reporter of the run (this same, living process) leaves the record alone.
    other = RunReporter(unique_run, settings, start_service=False)
    try:
        assert other.registry.find_run_id(unique_run) is None  # nothing registered
    finally:
        held.set()
    stored.registered.result(timeout=60)
    [checkpoint] = other.registry.checkpoints(unique_run)
    assert checkpoint.report_index == 0
    run_folder = _run_folder(tmp_path / "home", unique_run)
    assert sorted(os.listdir(run_folder)) == ["checkpoint_000000"]
    writer.close()
    other.close()


def _sync(metrics):
    """A checked SYNC report of ``metrics`` with no validation."""
    from trainer_integration import CheckpointUploadMode
    from trainer_integration._request import PreparedReport

    return PreparedReport(metrics, None, CheckpointUploadMode.SYNC, delete_local=False)


def test_a_record_that_does_not_verify_is_never_used(tmp_path, unique_run, caplog):
    """A record written into storage by something else (or changed there): left as it is,
    nothing registered, nothing unpickled."""
    home = tmp_path / "home"
    _report_and_die(unique_run, _checkpoint_folder(tmp_path, 1), "reserve", home)
    run_folder = _run_folder(home, unique_run)
    [record] = [n for n in os.listdir(run_folder) if n.endswith(RECORD_SUFFIX)]
    path = os.path.join(run_folder, record)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data.replace(b'"loss": 0.25', b'"loss": 0.01'))
    reporter = RunReporter(unique_run, get_settings(home=str(home)), start_service=False)
    assert reporter.registry.find_run_id(unique_run) is None  # nothing registered
    assert record in os.listdir(run_folder)
    assert "is not trusted, left as it is" in caplog.text
    reporter.close()
