"""Many processes reporting to one run: report indices reserved in the registry, so no
two reports share an index or a folder, and none is overwritten or dropped."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.conftest import POSTGRES_URL
from validation_service.errors import ReportIndexTaken
from validation_service.registry.registry import Registry
from validation_service.storage import CheckpointStorage

REPO = Path(__file__).resolve().parents[1]
PROCESSES = 4
REPORTS_EACH = 6

# One training process: waits for the go file, so that all of them report at once, then
# reports REPORTS_EACH checkpoints (SYNC and ASYNC in turn) that say who made them, each
# with a validation to enqueue.
REPORTER = """
import json, os, sys, tempfile, time
from ray.train import Checkpoint
from trainer_integration import CheckpointUploadMode, Client

run, proc, count, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
deadline = time.monotonic() + 300
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit("never told to go")
    time.sleep(0.005)
client = Client(run, start_service=False)  # the run is created by whichever comes first
indices = []
with tempfile.TemporaryDirectory() as scratch:
    for step in range(count):
        folder = os.path.join(scratch, str(step))
        os.makedirs(folder)
        with open(os.path.join(folder, "origin.json"), "w") as f:
            json.dump({"proc": proc, "step": step}, f)
        mode = CheckpointUploadMode.ASYNC if step % 2 else CheckpointUploadMode.SYNC
        indices.append(client.report(
            {"proc": proc, "step": step},
            Checkpoint.from_directory(folder),
            checkpoint_upload_mode=mode,
            delete_local_checkpoint_after_upload=False,
            validate_fn="json:dumps",
        ))
    client.flush(timeout_s=300)
print(json.dumps(indices))
"""


def run_reporters(run: str, env: dict[str, str], tmp_path: Path) -> dict[int, list[int]]:
    """Starts PROCESSES reporter processes, lets them go together; their indices."""
    go = tmp_path / f"go-{uuid.uuid4().hex}"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CKVAL_")}
    full_env.update(env, PYTHONPATH=str(REPO))
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", REPORTER, run, str(proc), str(REPORTS_EACH), str(go)],
            env=full_env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for proc in range(PROCESSES)
    ]
    go.touch()
    indices = {}
    for proc, process in enumerate(processes):
        out, err = process.communicate(timeout=540)
        assert process.returncode == 0, err[-3000:]
        indices[proc] = json.loads(out.strip().splitlines()[-1])
    return indices


def assert_every_report_kept(registry: Registry, run: str, indices, storage_root: str) -> None:
    total = PROCESSES * REPORTS_EACH
    records = registry.checkpoints(run)
    assert sorted(r.report_index for r in records) == list(range(total))
    assert sorted(i for each in indices.values() for i in each) == list(range(total))
    for each in indices.values():  # one process's reports: in the order it made them
        assert each == sorted(each)
    seen = set()
    storage = CheckpointStorage(storage_root)
    for record in records:
        origin = (record.reported_metrics["proc"], record.reported_metrics["step"])
        assert record.report_index == indices[origin[0]][origin[1]]
        with open(os.path.join(record.uri, "origin.json")) as f:
            assert json.load(f) == record.reported_metrics  # its own files, not another's
        storage.verify(record.uri, record.manifest_sha256)
        seen.add(origin)
    assert seen == {(p, s) for p in range(PROCESSES) for s in range(REPORTS_EACH)}
    assert len({r.uri for r in records}) == total


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request, tmp_path) -> str:
    """The registry the processes share: an embedded SQLite file, or PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'home' / 'registry.db'}"
    url = request.getfixturevalue("postgres_server_url")
    Registry(url, upgrade=True).close()
    return url


def test_processes_reporting_to_one_run(tmp_path, unique_run, database_url):
    storage = tmp_path / "checkpoints"
    env = {
        "CKVAL_HOME": str(tmp_path / "home"),
        "CKVAL_DATABASE_URL": database_url,
        "CKVAL_STORAGE": str(storage),
    }
    indices = run_reporters(unique_run, env, tmp_path)
    registry = Registry(database_url)
    assert_every_report_kept(registry, unique_run, indices, str(storage))
    # Each report's validation was enqueued once, for its own checkpoint.
    jobs = registry.validations(unique_run)
    assert sorted(job.report_index for job in jobs) == list(range(PROCESSES * REPORTS_EACH))
    assert {job.status for job in jobs} == {"QUEUED"}

    # A process that comes later (a restarted run) continues after them.
    from ray.train import Checkpoint

    from trainer_integration import Client
    from validation_service.config import Settings

    later = tmp_path / "later"
    later.mkdir()
    settings = Settings(home=tmp_path / "home", database_url=database_url, storage=str(storage))
    client = Client(unique_run, settings, start_service=False)
    assert client.report({"step": 99}, Checkpoint.from_directory(str(later))) == (
        PROCESSES * REPORTS_EACH
    )
    registry.close()


# ------------------------------------------------------------------- the registry
def register(registry: Registry, run_id: int, index: int, uri: str):
    return registry.ledger.register_checkpoint(
        run_id, index, uri=uri, size_bytes=1, manifest_sha256=None, reported_metrics={"i": index}
    )


def test_reservations_never_repeat_and_pass_indices_registered_directly(registry):
    run_id = registry.ledger.ensure_run("run-r", storage_root="/ckpts")
    assert [registry.ledger.reserve_report_index(run_id) for _ in range(3)] == [0, 1, 2]
    register(registry, run_id, 7, "/ckpts/7")  # an index chosen by the caller
    assert registry.ledger.reserve_report_index(run_id) == 8
    registry.ledger.import_checkpoints(
        run_id, [{"report_index": 20, "uri": "/ckpts/20", "metrics": {}}]
    )
    assert registry.ledger.reserve_report_index(run_id) == 21
    assert registry.ledger.next_report_index(run_id) == 22
    other = registry.ledger.ensure_run("run-s", storage_root="/ckpts")
    assert registry.ledger.reserve_report_index(other) == 0  # counters are per run


def test_the_same_report_registers_once_and_another_at_its_index_is_refused(registry):
    run_id = registry.ledger.ensure_run("run-r", storage_root="/ckpts")
    index = registry.ledger.reserve_report_index(run_id)
    first = register(registry, run_id, index, "/ckpts/a")
    again = register(registry, run_id, index, "/ckpts/a")  # retried after a lost reply
    assert first.created and not again.created and again.checkpoint_id == first.checkpoint_id
    with pytest.raises(ReportIndexTaken, match=r"Report index 0 of run run-r .*/ckpts/a"):
        register(registry, run_id, index, "/ckpts/b")
    [record] = registry.checkpoints("run-r")
    assert (record.uri, record.reported_metrics) == ("/ckpts/a", {"i": 0})


# ------------------------------------------------------------------- the migration
def seed_0001(engine: sa.Engine) -> None:
    """Two runs with checkpoints (one with a gap), one without, as 0001 stored them."""
    now = dt.datetime(2026, 1, 1)
    with engine.begin() as conn:
        for run_id, name in [(1, "a"), (2, "b"), (3, "empty")]:
            conn.execute(
                sa.text(
                    "INSERT INTO runs (id, name, namespace, storage_root, created_at, status, "
                    "tags) VALUES (:id, :name, 'default', '/s', :now, 'RUNNING', '{}')"
                ),
                {"id": run_id, "name": name, "now": now},
            )
        for run_id, index in [(1, 0), (1, 1), (1, 2), (2, 0), (2, 5)]:
            conn.execute(
                sa.text(
                    "INSERT INTO checkpoints (run_id, report_index, uri, size_bytes, created_at, "
                    "reported_metrics, metrics, validation_status) VALUES (:run_id, :index, "
                    ":uri, 1, :now, :metrics, :metrics, 'NONE')"
                ),
                {
                    "run_id": run_id,
                    "index": index,
                    "uri": f"/s/{run_id}/{index}",
                    "now": now,
                    "metrics": json.dumps({"i": index}),
                },
            )


def upgrade_from_0001_keeps_rows(url: str) -> None:
    registry = Registry(url, check_schema=False)
    try:
        registry.upgrade("0001")
        seed_0001(registry.engine)
        registry.upgrade()
        assert registry.schema_revision() >= "0002"
        assert [r.name for r in registry.runs()] == ["a", "b", "empty"]
        assert [c.report_index for c in registry.checkpoints("a")] == [0, 1, 2]
        assert [c.reported_metrics for c in registry.checkpoints("b")] == [{"i": 0}, {"i": 5}]
        assert [registry.ledger.next_report_index(run_id) for run_id in (1, 2, 3)] == [3, 6, 0]
        assert registry.ledger.reserve_report_index(2) == 6
        registry.downgrade("0001")  # and back: the rows stay
        with registry.engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM checkpoints")).scalar() == 5
    finally:
        registry.close()


def test_upgrading_a_0001_sqlite_database_keeps_its_rows(tmp_path):
    upgrade_from_0001_keeps_rows(f"sqlite:///{tmp_path / 'old.db'}")


@pytest.mark.postgres
def test_upgrading_a_0001_postgres_database_keeps_its_rows(postgres_server_url):
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    name = f"ckval_0001_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        url = sa.engine.make_url(POSTGRES_URL).set(database=name)
        upgrade_from_0001_keeps_rows(url.render_as_string(hide_password=False))
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
