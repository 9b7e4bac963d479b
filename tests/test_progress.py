"""Progress lines, and what Registry.wait() says about failed validations.

No Ray: a real SQLite registry whose jobs move through its own transitions (claim, finish),
as the scheduler would move them.
"""

from __future__ import annotations

import io
import pickle
import threading
import warnings

import pytest

from validation_service.errors import ValidationsFailed, ValidationsFailedWarning
from validation_service.progress import ProgressRenderer, RunProgress
from validation_service.registry.records import JobOutcome
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest

RUN = "progress-run"
OWNER = "progress-test"


class FakeClock:
    """A clock the test moves by hand, so the rate limit is checked without waiting."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class WatchedStream(io.StringIO):
    """A stream that lets a test wait until a given text has been written."""

    def __init__(self):
        super().__init__()
        self.changed = threading.Condition()

    def write(self, text: str) -> int:
        with self.changed:
            written = super().write(text)
            self.changed.notify_all()
        return written

    def wait_for(self, text: str, timeout_s: float = 30.0) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: text in self.getvalue(), timeout_s):
                raise TimeoutError(f"{text!r} not written within {timeout_s}s:\n{self.getvalue()}")


@pytest.fixture
def registry(tmp_path):
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    yield registry
    registry.close()


def register_jobs(registry: Registry, n: int, max_attempts: int = 1) -> list[int]:
    run_id = registry.ledger.ensure_run(RUN, storage_root="/ckpts")
    request = ValidationRequest(
        executor_kind="ray_task",
        pool="CPU",
        validate_fn_name="validate",
        validate_fn_ref="json:dumps",
        max_attempts=max_attempts,
    )
    return [
        registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=f"/ckpts/{index}",
            size_bytes=1,
            manifest_sha256=None,
            reported_metrics={"step": index},
            job=request,
        ).job_id
        for index in range(n)
    ]


def claim_one(registry: Registry):
    [job] = registry.job_queue.claim_due_jobs(OWNER, {"CPU": 1}, lease_s=60, max_jobs=1)
    return job


def succeed(registry: Registry, job) -> None:
    outcome = JobOutcome(succeeded=True, metrics={"accuracy": 0.5})
    assert registry.job_queue.finish_job(job.job_id, job.lease_token, outcome)


def fail(registry: Registry, job) -> None:
    outcome = JobOutcome(
        succeeded=False,
        error_type="OSError",
        error_message="the validation data is not reachable",
        retryable=False,
    )
    assert registry.job_queue.finish_job(job.job_id, job.lease_token, outcome)


# ----------------------------------------------------------------- renderer
def test_plain_lines_only_when_the_counts_change():
    stream, clock = io.StringIO(), FakeClock()
    renderer = ProgressRenderer(stream, isatty=False, clock=clock)
    assert renderer.update("r", {"QUEUED": 2})
    clock.now += 5
    assert not renderer.update("r", {"QUEUED": 2})  # same counts: nothing new to say
    assert renderer.update("r", {"QUEUED": 1, "RUNNING": 1})
    renderer.close()
    assert stream.getvalue().splitlines() == [
        "ckval run 'r': 2 reported, 2 queued, 0 running, 0 succeeded, 0 failed",
        "ckval run 'r': 2 reported, 1 queued, 1 running, 0 succeeded, 0 failed",
    ]
    assert "\r" not in stream.getvalue()


def test_at_most_one_line_per_interval_and_the_last_state_at_close():
    stream, clock = io.StringIO(), FakeClock()
    renderer = ProgressRenderer(stream, isatty=False, min_interval_s=1.0, clock=clock)
    renderer.update("r", {"QUEUED": 3})
    clock.now += 0.2
    assert not renderer.update("r", {"QUEUED": 2, "RUNNING": 1})  # held back
    clock.now += 0.2
    assert not renderer.update("r", {"QUEUED": 1, "RUNNING": 1, "SUCCEEDED": 1})
    assert len(stream.getvalue().splitlines()) == 1
    clock.now += 1.0
    assert renderer.update("r", {"QUEUED": 1, "RUNNING": 1, "SUCCEEDED": 1})
    clock.now += 0.1
    renderer.update("r", {"SUCCEEDED": 2, "TIMED_OUT": 1})
    renderer.close()  # the held-back final state is written, not lost
    assert stream.getvalue().splitlines() == [
        "ckval run 'r': 3 reported, 3 queued, 0 running, 0 succeeded, 0 failed",
        "ckval run 'r': 3 reported, 1 queued, 1 running, 1 succeeded, 0 failed",
        "ckval run 'r': 3 reported, 0 queued, 0 running, 2 succeeded, 1 failed",
    ]


def test_terminal_line_has_a_bar_and_is_redrawn_in_place():
    stream, clock = io.StringIO(), FakeClock()
    renderer = ProgressRenderer(stream, isatty=True, clock=clock)
    renderer.update("r", {"QUEUED": 3, "RUNNING": 1})
    clock.now += 2
    renderer.update("r", {"SUCCEEDED": 3, "FAILED": 1})
    renderer.close()
    out = stream.getvalue()
    assert out.count("\n") == 1 and out.endswith("\n")  # one line, ended once at close
    first, second = out.rstrip("\n").split("\r")[1:]
    assert first == (
        "ckval run 'r' [------------------------] 0/4 "
        "| 4 reported, 3 queued, 1 running, 0 succeeded, 0 failed"
    )
    assert second.startswith(
        "ckval run 'r' [########################] 4/4 "
        "| 4 reported, 0 queued, 0 running, 3 succeeded, 1 failed"
    )


def test_terminal_redraw_wipes_a_longer_previous_line():
    stream, clock = io.StringIO(), FakeClock()
    renderer = ProgressRenderer(stream, isatty=True, clock=clock)
    renderer.update("r", {"QUEUED": 10, "CANCELLED": 2})
    clock.now += 2
    renderer.update("r", {"SUCCEEDED": 12})
    first, second = stream.getvalue().split("\r")[1:]
    assert "2 cancelled" in first and "cancelled" not in second
    assert len(second) == len(first) and second.endswith(" ")


def test_the_stream_says_whether_it_is_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert ProgressRenderer(Terminal()).isatty
    assert not ProgressRenderer(io.StringIO()).isatty


def test_counts_of_every_status():
    progress = RunProgress.from_counts(
        {"QUEUED": 1, "RUNNING": 2, "SUCCEEDED": 3, "FAILED": 4, "TIMED_OUT": 5, "CANCELLED": 6}
    )
    assert progress == RunProgress(21, 1, 2, 3, 9, 6)
    assert progress.done == 18


# --------------------------------------------------------------------- wait
def test_wait_shows_progress_while_jobs_change_state(registry):
    register_jobs(registry, 2)
    stream = WatchedStream()
    renderer = ProgressRenderer(stream, isatty=False, min_interval_s=0.0)
    failures: list[BaseException] = []

    def drive() -> None:
        # Each step waits until wait() has shown the one before: every state is seen.
        try:
            stream.wait_for("2 queued")
            first = claim_one(registry)
            stream.wait_for("1 running")
            succeed(registry, first)
            stream.wait_for("1 succeeded")
            second = claim_one(registry)
            stream.wait_for("0 queued, 1 running, 1 succeeded")
            succeed(registry, second)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            failures.append(exc)

    driver = threading.Thread(target=drive)
    driver.start()
    registry.wait(RUN, timeout_s=60, progress=renderer)
    driver.join(30)
    assert failures == []
    assert stream.getvalue().splitlines() == [
        f"ckval run {RUN!r}: 2 reported, 2 queued, 0 running, 0 succeeded, 0 failed",
        f"ckval run {RUN!r}: 2 reported, 1 queued, 1 running, 0 succeeded, 0 failed",
        f"ckval run {RUN!r}: 2 reported, 1 queued, 0 running, 1 succeeded, 0 failed",
        f"ckval run {RUN!r}: 2 reported, 0 queued, 1 running, 1 succeeded, 0 failed",
        f"ckval run {RUN!r}: 2 reported, 0 queued, 0 running, 2 succeeded, 0 failed",
    ]


def test_wait_progress_true_writes_to_standard_error(registry, capsys):
    [job_id] = register_jobs(registry, 1)
    succeed(registry, claim_one(registry))
    registry.wait(RUN, timeout_s=10, progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        captured.err
        == f"ckval run {RUN!r}: 1 reported, 0 queued, 0 running, 1 succeeded, 0 failed\n"
    )
    assert registry.get_job(job_id).status == "SUCCEEDED"


def test_wait_warns_naming_the_failed_jobs(registry):
    ids = register_jobs(registry, 3)
    succeed(registry, claim_one(registry))
    fail(registry, claim_one(registry))
    fail(registry, claim_one(registry))
    with pytest.warns(ValidationsFailedWarning) as caught:
        registry.wait(RUN, timeout_s=10)
    [warning] = caught
    message = str(warning.message)
    assert f"2 of 3 validation(s) of run {RUN!r} failed" in message
    assert f"job {ids[1]}: report 1, FAILED, OSError: the validation data is not reachable" in (
        message
    )
    assert f"job {ids[2]}: report 2, FAILED" in message
    assert f"`ckval job {ids[1]}`" in message
    assert warning.filename == __file__  # points at the caller of wait()


def test_wait_is_silent_when_every_validation_succeeded(registry):
    register_jobs(registry, 2)
    for _ in range(2):
        succeed(registry, claim_one(registry))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.wait(RUN, timeout_s=10)
    assert [j.status for j in registry.validations(RUN)] == ["SUCCEEDED", "SUCCEEDED"]


def test_wait_raise_on_failure_lists_the_jobs_and_survives_pickling(registry):
    ids = register_jobs(registry, 2)
    fail(registry, claim_one(registry))
    fail(registry, claim_one(registry))
    with pytest.raises(ValidationsFailed) as caught:
        registry.wait(RUN, timeout_s=10, raise_on_failure=True)
    error = caught.value
    assert error.run == RUN and error.job_ids == ids and error.total == 2
    assert "2 of 2 validation(s)" in str(error) and "ckval retry --failed" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ValidationsFailed
    assert (copy.run, copy.job_ids, copy.failed, str(copy)) == (
        error.run,
        error.job_ids,
        error.failed,
        str(error),
    )


def test_a_timed_out_validation_counts_as_failed(registry):
    [job_id] = register_jobs(registry, 1)
    job = claim_one(registry)
    timed_out = JobOutcome(
        succeeded=False,
        error_type="TimeoutError",
        error_message="validation ran longer than timeout_s=1",
        retryable=False,
        timed_out=True,
    )
    registry.job_queue.finish_job(job.job_id, job.lease_token, timed_out)
    with pytest.raises(ValidationsFailed) as caught:
        registry.wait(RUN, timeout_s=10, raise_on_failure=True)
    assert caught.value.job_ids == [job_id]
    assert "TIMED_OUT, TimeoutError" in caught.value.failed[job_id]


def test_wait_still_raises_timeout_while_jobs_are_active(registry):
    register_jobs(registry, 1)
    stream = io.StringIO()
    with pytest.raises(TimeoutError, match="still QUEUED or RUNNING"):
        registry.wait(
            RUN, timeout_s=0.2, progress=ProgressRenderer(stream, isatty=True, min_interval_s=0)
        )
    assert stream.getvalue().endswith("\n")  # the line drawn in place was ended


# --------------------------------------------------------------------- demo
def test_demo_exit_message_names_the_failed_validation(registry):
    from validation_service.cli.demo import exit_message

    ids = register_jobs(registry, 3)
    for _ in range(2):
        succeed(registry, claim_one(registry))
    fail(registry, claim_one(registry))
    message = exit_message(registry, RUN, epochs=3)
    assert message.startswith(f"1 of 3 validation(s) of run {RUN!r} failed (job {ids[2]}: ")
    assert f"`ckval job {ids[2]}`" in message


def test_demo_exit_message_is_none_when_every_epoch_validated(registry):
    from validation_service.cli.demo import exit_message

    register_jobs(registry, 2)
    for _ in range(2):
        succeed(registry, claim_one(registry))
    assert exit_message(registry, RUN, epochs=2) is None
    assert "expected 3 validated checkpoints" in exit_message(registry, RUN, epochs=3)
