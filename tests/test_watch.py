"""Watched folders on a real registry (SQLite and PostgreSQL), listed by the service's
FolderWatcher and validated by in-process attempts (run_attempt, every executor's body):
each complete step folder registered once, whoever lists it; the ready rules; what a
listing reports; a folder the trainer deleted; copies kept until validated."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from tests.inprocess_attempts import InProcessExecutor
from validation_service.config import Settings
from validation_service.registry.registry import Registry
from validation_service.retry import RetryPolicy
from validation_service.service.scheduler import Scheduler
from validation_service.service.watcher import FolderWatcher

SCORE_FN = "tests.test_watch:score"


def score(checkpoint, config) -> dict:
    """Reads the value a step folder holds."""
    with checkpoint.as_directory() as folder:
        return {"score": json.loads((Path(folder) / "value.json").read_text())["value"]}


@pytest.fixture
def settings(registry, tmp_path) -> Settings:
    url = registry.engine.url.render_as_string(hide_password=False)
    return Settings(
        home=tmp_path / "home",
        database_url=url,
        storage=str(tmp_path / "store"),
        watch_interval_s=0.001,
        watch_settle_s=3600,
        lease_s=30,
    )


@pytest.fixture
def reg(settings):
    opened = Registry(settings=settings)
    yield opened
    opened.close()


def watcher(reg: Registry, settings: Settings, owner: str = "replica-a/1") -> FolderWatcher:
    return FolderWatcher(reg.watch_listings, settings, owner)


def step_folder(root: Path, name: str, value: float, marker: str | None = ".metadata") -> Path:
    """A step folder as a trainer saves it: its files, then its completion marker."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "value.json").write_text(json.dumps({"value": value}))
    if marker:
        (folder / marker).write_text("{}")
    return folder


def list_until(book: FolderWatcher, condition, timeout_s: float = 30.0) -> None:
    """Lists the due watches until ``condition()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        book.tick()


def settle(reg: Registry, settings: Settings, run: str, timeout_s: float = 60.0):
    scheduler = Scheduler(
        reg,
        settings,
        executors={"ray_task": InProcessExecutor(settings)},
        retry_policy=RetryPolicy(backoff_s=0.0),
    )
    deadline = time.monotonic() + timeout_s
    while any(job.status in ("QUEUED", "RUNNING") for job in reg.validations(run)):
        assert time.monotonic() < deadline
        scheduler.tick()
    return reg.validations(run)


def test_each_complete_step_folder_is_registered_in_place_once_with_its_step(
    reg, settings, tmp_path, unique_run
):
    steps = tmp_path / "trainer"
    step_folder(steps, "step-100", 0.25)
    step_folder(steps, "step-200", 0.5, marker=None)  # still being written
    (steps / "logs").mkdir()  # no integer in its name: not a step folder
    watch_id = reg.watch(str(steps), unique_run, SCORE_FN)
    first = watcher(reg, settings)

    assert first.tick() == 1
    [waiting] = reg.watches(unique_run)[0].waiting
    assert (waiting.name, waiting.step) == ("step-200", 200)
    (steps / "step-200" / ".metadata").write_text("{}")  # DCP writes it last
    step_folder(steps, "global_step50", 0.75)  # an older step, complete at once
    assert first.tick() == 2
    # A restarted service (another owner, a new watcher) registers nothing again.
    again = watcher(reg, settings, owner="replica-a/2")
    for _ in range(3):
        assert again.tick() == 0

    records = reg.checkpoints(unique_run)
    assert [(r.report_index, r.step, r.metrics["step"]) for r in records] == [
        (0, 100, 100),
        (1, 50, 50),
        (2, 200, 200),
    ]
    assert [r.uri for r in records] == [
        str(steps / n) for n in ("step-100", "global_step50", "step-200")
    ]
    jobs = settle(reg, settings, unique_run)
    assert [j.status for j in jobs] == ["SUCCEEDED"] * 3
    assert [r.metrics["score"] for r in reg.checkpoints(unique_run)] == [0.25, 0.75, 0.5]
    [listed] = reg.watches()
    assert (listed.id, listed.registered, listed.waiting) == (watch_id, 3, ())
    assert (steps / "step-100" / "value.json").exists()  # never copied, never moved


def test_two_replicas_listing_at_once_register_each_step_folder_once(
    reg, settings, tmp_path, unique_run
):
    steps = tmp_path / "trainer"
    steps.mkdir()
    reg.watch(str(steps), unique_run, SCORE_FN)
    replicas = [watcher(reg, settings, owner=f"replica-{i}/1") for i in range(3)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def keep_listing(replica: FolderWatcher) -> None:
        try:
            while not stop.is_set():
                replica.tick()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=keep_listing, args=(r,)) for r in replicas]
    for thread in threads:
        thread.start()
    try:
        for step in range(1, 13):
            step_folder(steps, f"step-{step}", step / 100)
        deadline = time.monotonic() + 60
        while len(reg.checkpoints(unique_run)) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)  # the threads list; this only looks at the registry
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []
    records = reg.checkpoints(unique_run)
    assert sorted(r.step for r in records) == list(range(1, 13))
    assert len({r.uri for r in records}) == 12
    assert len(reg.validations(unique_run)) == 12
    assert sum(r.stats["registered"] for r in replicas) == 12


def test_a_listing_under_a_lease_taken_over_writes_nothing(reg, settings, tmp_path, unique_run):
    steps = tmp_path / "trainer"
    step_folder(steps, "step-1", 0.1)
    reg.watch(str(steps), unique_run, SCORE_FN)
    book = reg.watch_listings
    [slow] = book.claim_due("replica-a/1", lease_s=0.001)
    time.sleep(0.01)  # past the lease: another replica may claim the watch
    [fast] = book.claim_due("replica-b/1", lease_s=60)
    assert fast.token == slow.token + 1
    assert watcher(reg, settings).list_watch(slow) == 0
    assert reg.checkpoints(unique_run) == []
    assert watcher(reg, settings, "replica-b/1").list_watch(fast) == 1
    assert [r.step for r in reg.checkpoints(unique_run)] == [1]


def test_ready_rules_markers_and_settling(reg, settings, tmp_path, unique_run):
    hf, marked, settled = tmp_path / "hf", tmp_path / "marked", tmp_path / "settled"
    step_folder(hf, "checkpoint-10", 0.1, marker="trainer_state.json")  # HF Trainer
    step_folder(hf, "checkpoint-20", 0.2, marker="pytorch_model.bin")  # no state yet
    step_folder(marked, "step-1", 0.1, marker=".metadata")  # not the marker asked for
    step_folder(settled, "step-1", 0.1, marker=None)
    reg.watch(str(hf), f"{unique_run}-hf", SCORE_FN)
    reg.watch(str(marked), f"{unique_run}-m", SCORE_FN, ready="marker:COMPLETE")
    reg.watch(str(settled), f"{unique_run}-s", SCORE_FN, ready="stable:0.3")
    book = watcher(reg, settings)
    book.tick()
    assert [r.step for r in reg.checkpoints(f"{unique_run}-hf")] == [10]
    assert reg.checkpoints(f"{unique_run}-m") == []
    assert reg.checkpoints(f"{unique_run}-s") == []  # seen once: not settled yet
    (marked / "step-1" / "COMPLETE").write_text("")
    list_until(book, lambda: len(reg.checkpoints(f"{unique_run}-m")) == 1)
    started = time.monotonic()
    list_until(book, lambda: len(reg.checkpoints(f"{unique_run}-s")) == 1)
    assert time.monotonic() - started >= 0.2  # it waited for the folder to settle
    [waiting] = reg.watches(f"{unique_run}-hf")[0].waiting
    assert waiting.name == "checkpoint-20" and waiting.since <= waiting.changed_at


def test_a_folder_still_changing_is_never_registered_half_written(
    reg, settings, tmp_path, unique_run
):
    steps = tmp_path / "trainer"
    folder = step_folder(steps, "step-5", 0.5, marker=None)
    reg.watch(str(steps), unique_run, SCORE_FN, ready="stable:0.5")
    book = watcher(reg, settings)
    deadline = time.monotonic() + 1.5
    part = 0
    while time.monotonic() < deadline:  # the trainer keeps writing shards
        (folder / f"shard-{part}.bin").write_bytes(b"x" * (part + 1))
        part += 1
        book.tick()
        assert reg.checkpoints(unique_run) == []
    list_until(book, lambda: len(reg.checkpoints(unique_run)) == 1)
    [record] = reg.checkpoints(unique_run)
    assert record.size_bytes == sum(p + 1 for p in range(part)) + len('{"value": 0.5}')


def test_unwatch_stops_the_listing_and_keeps_what_it_registered(
    reg, settings, tmp_path, unique_run
):
    steps = tmp_path / "trainer"
    step_folder(steps, "step-1", 0.1)
    watch_id = reg.watch(str(steps), unique_run, SCORE_FN)
    book = watcher(reg, settings)
    book.tick()
    reg.unwatch(watch_id)
    step_folder(steps, "step-2", 0.2)
    for _ in range(3):
        assert book.tick() == 0
    assert [r.step for r in reg.checkpoints(unique_run)] == [1]
    assert reg.watches() == []
    # Watched again: step-1 is not registered a second time, step-2 is new.
    reg.watch(str(steps), unique_run, SCORE_FN)
    book.tick()
    assert [r.step for r in reg.checkpoints(unique_run)] == [1, 2]


def test_a_named_validator_keeps_its_metrics_apart(reg, settings, tmp_path, unique_run):
    steps = tmp_path / "trainer"
    step_folder(steps, "step-3", 0.3)
    reg.watch(str(steps), unique_run, SCORE_FN, validator="eval-suite")
    watcher(reg, settings).tick()
    [job] = settle(reg, settings, unique_run)
    [record] = reg.checkpoints(unique_run)
    assert job.status == "SUCCEEDED"
    assert record.evaluations["eval-suite"] == {"score": 0.3}
    assert record.metrics == {"step": 3} and record.validation_status == "NONE"


def test_a_step_folder_the_trainer_deleted_before_its_validation_fails_clearly(
    reg, settings, tmp_path, unique_run
):
    steps = tmp_path / "trainer"
    step_folder(steps, "step-1", 0.1)
    reg.watch(str(steps), unique_run, SCORE_FN)
    watcher(reg, settings).tick()
    shutil.rmtree(steps / "step-1")  # keep_latest_k rotation
    [job] = settle(reg, settings, unique_run)
    assert job.status == "FAILED" and job.attempts == 1
    assert job.error_type == "CheckpointNotFound"
    assert "deleted" in job.error_message and "copy=True" in job.error_message
    assert "Traceback" not in job.error_message


def test_copy_keeps_each_step_folder_until_it_is_validated(reg, settings, tmp_path, unique_run):
    steps = tmp_path / "trainer"
    step_folder(steps, "step-7", 0.7)
    reg.watch(str(steps), unique_run, SCORE_FN, copy=True)
    assert watcher(reg, settings).tick() == 1
    shutil.rmtree(steps / "step-7")  # rotated away before the validation ran
    [job] = settle(reg, settings, unique_run)
    [record] = reg.checkpoints(unique_run)
    assert job.status == "SUCCEEDED" and record.metrics["score"] == 0.7
    assert record.uri.startswith(str(tmp_path / "store")) and record.manifest_sha256
    assert record.step == 7


def test_a_copy_interrupted_by_a_restart_is_finished_once(reg, settings, tmp_path, unique_run):
    steps = tmp_path / "trainer"
    step_folder(steps, "step-1", 0.1)
    reg.watch(str(steps), unique_run, SCORE_FN, copy=True)
    book = reg.watch_listings
    [claimed] = book.claim_due("replica-a/1", lease_s=0.001)
    first = watcher(reg, settings)
    # The listing takes the folder (COPYING), then the replica stops before copying.
    first._copy_all = lambda *args: 0
    assert first.list_watch(claimed) == 0
    assert reg.checkpoints(unique_run) == []
    time.sleep(0.01)  # its lease runs out
    assert watcher(reg, settings, "replica-b/1").tick() == 1
    assert [(r.report_index, r.step) for r in reg.checkpoints(unique_run)] == [(0, 1)]


def test_an_outside_program_validates_each_step_folder_and_retention_keeps_them(
    reg, settings, tmp_path, unique_run
):
    from tests.test_revalidate import PROGRAM, program
    from validation_service.validators import CommandValidator

    steps = tmp_path / "trainer"
    for step, value in ((10, 0.1), (20, 0.2), (30, 0.3)):
        step_folder(steps, f"step-{step}", value)
    reg.watch(str(steps), unique_run, CommandValidator(program(tmp_path, PROGRAM)))
    watcher(reg, settings).tick()
    jobs = settle(reg, settings, unique_run)
    assert [j.status for j in jobs] == ["SUCCEEDED"] * 3
    assert [r.metrics["score"] for r in reg.checkpoints(unique_run)] == [0.2, 0.4, 0.6]
    reg.apply_retention(unique_run, metric="score", keep_best_per_run=0, keep_latest=0)
    assert all((steps / f"step-{s}" / "value.json").exists() for s in (10, 20, 30))
