"""One operation, one transaction: each registry call named below opens exactly one
(counted as connection checkouts of the registry's pool), and a report's registration
on PostgreSQL takes the round trips pinned here (read from libpq's own trace of every
connection: each round trip ends with the server's ReadyForQuery)."""

from __future__ import annotations

import contextlib
import tempfile

import pytest
from ray.train import Checkpoint
from sqlalchemy import event
from sqlalchemy.pool import Pool

from trainer_integration import CheckpointUploadMode, Client
from validation_service.config import get_settings
from validation_service.registry.assemblies import ReportCall
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest
from validation_service.stopping import StopPolicy

JOB = ValidationRequest("ray_task", "CPU", "json:dumps", validate_fn_ref="json:dumps")


@contextlib.contextmanager
def transactions(registry: Registry):
    """The list that gets one item per connection taken from the registry's pool (every
    read, write and one-statement transaction takes one)."""
    taken: list[int] = []

    def checkout(dbapi_connection, record, proxy) -> None:
        taken.append(1)

    event.listen(registry.engine, "checkout", checkout)
    try:
        yield taken
    finally:
        event.remove(registry.engine, "checkout", checkout)


@pytest.fixture
def world(registry: Registry) -> Registry:
    """Run "r" with reports 0-2 (each with a job), alias "best" on 1, a stop decision."""
    run_id = registry.ledger.ensure_run("r", storage_root="/ckpts")
    for index in range(3):
        registry.ledger.register_checkpoint(
            run_id,
            registry.ledger.reserve_report_index(run_id),
            uri=f"/ckpts/r/{index}",
            size_bytes=1,
            manifest_sha256=None,
            reported_metrics={"loss": 1.0 - index / 10},
            job=JOB,
        )
    registry.set_alias("r", "best", 1)
    registry.tag("r", 1, "split", "val")
    return registry


CALL = ReportCall("group", 1, 0, 2)  # one report() call of rank 0 of 2

CALLS = {
    "checkpoints": lambda r: r.checkpoints("r"),
    "get_alias_record": lambda r: r.get_alias_record("r", "best"),
    "set_alias": lambda r: r.set_alias("r", "best", 2),
    "remove_alias": lambda r: r.remove_alias("r", "best"),
    "tag": lambda r: r.tag("r", 0, "split", "train"),
    "track_alias": lambda r: r.track_alias("r", "lowest", "loss", "min"),
    "latest_checkpoint": lambda r: r.latest_checkpoint("r"),
    "best_checkpoint_records": lambda r: r.best_checkpoint_records("r", "loss", "min", 2),
    "find_run_id": lambda r: r.find_run_id("r"),
    "stop_decision": lambda r: r.stop_decision("r"),
    "stop_policy": lambda r: r.stop_policy("r"),
    "incomplete_checkpoints": lambda r: r.incomplete_checkpoints("r"),
    "get_job": lambda r: r.get_job(1),
    "retry_jobs of a run": lambda r: r.retry_jobs(run="r"),
    "revalidate": lambda r: r.revalidate("r", "json:dumps", validator="again"),
    "ledger.reserve_report_index": lambda r: r.ledger.reserve_report_index(1),
    "ledger.finish_run": lambda r: r.ledger.finish_run("r"),
    "ledger.tag_run": lambda r: r.ledger.tag_run(1, {"team": "a"}),
    "ledger.register_checkpoint": lambda r: r.ledger.register_checkpoint(
        1, 7, uri="/ckpts/r/7", size_bytes=1, manifest_sha256=None, reported_metrics={}, job=JOB
    ),
    "assemblies.join": lambda r: r.assemblies.join(1, CALL, lambda i: f"/ckpts/r/{i}"),
    "assemblies.advance": lambda r: r.assemblies.advance(1, CALL),
    # What the dashboard and /metrics are given: the reader, one transaction a read.
    "dashboard.run_view": lambda r: r.dashboard.run_view("r"),
    "dashboard.run_page": lambda r: r.dashboard.run_page(metric="loss"),
    "dashboard.replicas": lambda r: r.dashboard.replicas("ckval"),
    # The policy stored and the run's results judged by it, together.
    "set_stop_policy": lambda r: r.set_stop_policy("r", StopPolicy("loss", mode="min", patience=1)),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_each_call_opens_one_transaction(world: Registry, call: str):
    with transactions(world) as taken:
        CALLS[call](world)
    assert len(taken) == 1, f"{call} opened {len(taken)} transactions"


def test_the_alias_read_selects_the_aliased_checkpoint_only(world: Registry):
    record = world.get_alias_record("r", "best")
    assert (record.report_index, record.aliases, record.tags) == (1, ("best",), {"split": "val"})
    world.set_alias("r", "best", 2)
    assert world.get_alias("r", "best")[1] == {"loss": pytest.approx(0.8)}


def test_the_run_page_reads_the_latest_attempt_of_a_reused_run_name(world: Registry):
    """A run name used again after its run ended: the page's record, checkpoints and jobs
    are all of the new attempt, read together."""
    world.ledger.finish_run("r")
    run_id = world.ledger.ensure_run("r", storage_root="/ckpts")
    world.ledger.register_checkpoint(
        run_id,
        world.ledger.reserve_report_index(run_id),
        uri="/ckpts/r/2-0",
        size_bytes=1,
        manifest_sha256=None,
        reported_metrics={"loss": 0.5},
        job=JOB,
    )
    view = world.dashboard.run_view("r")
    assert (view.record.attempt, view.record.id, view.record.status) == (2, run_id, "RUNNING")
    assert [c.uri for c in view.checkpoints] == ["/ckpts/r/2-0"]
    assert [job.report_index for job in view.jobs] == [0]


def test_an_outcome_is_one_transaction_and_its_housekeeping_one_more(world: Registry):
    """A job's outcome with nothing to follow it: one transaction. With a stop policy, a
    tracked alias and retention: one more, after the outcome's commit (a failing rule
    never loses a recorded result), whatever the policies decide."""
    queue = world.job_queue
    first, second = queue.claim_due_jobs("w/1", {}, lease_s=60)[:2]
    with transactions(world) as taken:
        assert queue.finish_job(first.job_id, first.lease_token, _succeeded({"loss": 0.9}))
    assert len(taken) == 1
    world.set_stop_policy("r", StopPolicy("loss", mode="min", threshold=0.5))
    world.track_alias("r", "lowest", "loss", "min")
    world.set_retention("r", metric="loss", mode="min", keep_best_per_run=1, keep_latest=1)
    with transactions(world) as taken:
        assert queue.finish_job(second.job_id, second.lease_token, _succeeded({"loss": 0.4}))
    assert len(taken) == 2
    assert world.stop_decision("r").rule == "threshold"
    assert world.get_alias_record("r", "lowest").report_index == second.report_index


def test_resuming_a_stopped_run_is_one_transaction(registry: Registry):
    run_id = registry.ledger.ensure_run("s", storage_root="/ckpts")
    registry.set_stop_policy("s", StopPolicy("loss", mode="min", threshold=0.5))
    for index, loss in enumerate((0.9, 0.4)):
        registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=f"/ckpts/s/{index}",
            size_bytes=1,
            manifest_sha256=None,
            reported_metrics={},
            job=JOB,
        )
        [job] = registry.job_queue.claim_due_jobs("w/1", {}, lease_s=60)
        registry.job_queue.finish_job(job.job_id, job.lease_token, _succeeded({"loss": loss}))
    assert registry.stop_decision("s") is not None
    with transactions(registry) as taken:
        decision = registry.resume_despite_stop("s")
    assert len(taken) == 1 and decision.overridden_at is not None


def _succeeded(metrics):
    from validation_service.registry.records import JobOutcome

    return JobOutcome(succeeded=True, metrics=metrics)


@contextlib.contextmanager
def round_trips():
    """A function that counts the round trips of every PostgreSQL connection opened
    meanwhile, from libpq's trace of each."""
    traces = []

    def trace(dbapi_connection, record) -> None:
        if hasattr(dbapi_connection, "pgconn"):
            file = tempfile.TemporaryFile()
            dbapi_connection.pgconn.trace(file.fileno())
            traces.append(file)

    def count(message: bytes = b"ReadyForQuery") -> int:
        total = 0
        for file in traces:
            file.seek(0)
            total += file.read().count(message)
        return total

    event.listen(Pool, "connect", trace)
    try:
        yield count
    finally:
        event.remove(Pool, "connect", trace)
        for file in traces:
            file.close()


# A SYNC report's registry work on PostgreSQL, its validation job included: the report
# index reserved (one statement), then the checkpoint, its metric values and its job
# registered (one statement), each checking its pooled connection first (pool_pre_ping).
# Before: 8, each statement in a transaction of its own (BEGIN and COMMIT sent apart).
REPORT_ROUND_TRIPS = 4


def test_a_reports_registration_takes_four_round_trips_on_postgresql(
    postgres_server_url, tmp_path, unique_run
):
    settings = get_settings(database_url=postgres_server_url, storage=str(tmp_path / "store"))
    Registry(postgres_server_url, upgrade=True).close()
    with round_trips() as count:
        client = Client(unique_run, settings, start_service=False)
        try:
            sent = []
            for index in range(3):
                folder = tmp_path / f"checkpoint-{index}"
                folder.mkdir()
                (folder / "weights.txt").write_text(str(index))
                before, statements = count(), count(b'Query\t "BEGIN"')
                client.report(
                    {"loss": 1.0 / (index + 1), "step": index},
                    Checkpoint.from_directory(str(folder)),
                    validate_fn="json:dumps",
                    checkpoint_upload_mode=CheckpointUploadMode.SYNC,
                )
                client.flush()
                sent.append((count() - before, count(b'Query\t "BEGIN"') - statements))
        finally:
            client.close()
    # The first report also creates the run.
    assert sent[1:] == [(REPORT_ROUND_TRIPS, 0)] * 2, sent
    registry = Registry(postgres_server_url)
    records = registry.checkpoints(unique_run)
    registry.close()
    assert [r.validation_status for r in records] == ["PENDING"] * 3
