"""Chaos on service replicas (PostgreSQL): replicas killed in turn and a replica paused
while they hold validations. Every report is validated once, and a paused replica's late
result is refused by its lease's fencing token.

Each test prints its figure (what was injected, what survived) and asserts it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import cloudpickle
import psutil
import pytest
import ray
import sqlalchemy as sa
from ray.train import Checkpoint

from trainer_integration import Client
from validation_service.errors import RunNotFound
from validation_service.jobs import ACTIVE_JOB_STATUSES
from validation_service.registry.registry import Registry
from validation_service.registry.replicas import replica_name
from validation_service.service import ValidationService

pytestmark = pytest.mark.ray
cloudpickle.register_pickle_by_value(sys.modules[__name__])
REPORTER = Path(__file__).with_name("reporter_process.py")
LEASE_S = 6.0
HEARTBEAT_S = 1.0


def figure(text: str) -> None:
    print(f"\nCHAOS FIGURE: {text}")


def wait_for(condition, timeout_s: float, what: str, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"{what} did not happen within {timeout_s}s")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


@pytest.fixture
def start_replicas(ray_session, postgres_server_url, monkeypatch):
    """Starts a service of its own (a unique name) with N replicas on the session's
    PostgreSQL database; stops it at the end."""
    registry = Registry(postgres_server_url, upgrade=True)
    started = []

    def start(count: int, **settings):
        name = f"ckval-chaos-{uuid.uuid4().hex[:6]}"
        monkeypatch.setenv("CKVAL_DATABASE_URL", postgres_server_url)
        monkeypatch.setenv("CKVAL_SERVICE_NAME", name)
        handle = ValidationService.start(
            replicas=count, heartbeat_s=HEARTBEAT_S, lease_s=LEASE_S, **settings
        )
        started.append(handle)
        return handle

    yield start, registry
    for handle in started:
        handle.stop()
    registry.close()


def answering(handle) -> list[dict] | None:
    """Every replica's status entry once all of them answer, else None."""
    try:
        replicas = handle.status(timeout_s=60)["replicas"]
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        return None  # the first replica is starting again
    return replicas if all(r["alive"] and r["pid"] for r in replicas) else None


def reporter_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(CKVAL_RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONUNBUFFERED="1")
    return env


def terminate_backends(url: str) -> int:
    """pg_terminate_backend of every connection to the test database but this one."""
    database = sa.engine.make_url(url).database
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            return conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = :d AND pid <> pg_backend_pid()"
                ),
                {"d": database},
            ).scalar_one()
    finally:
        admin.dispose()


# ------------------------------------------------------ replicas killed in turn
RUNS = 4
REPORTS_PER_RUN = 15
REPLICAS = 3
HOLD_S = 2.0  # each validation's length: 60 of them on 6 slots outlast three kills
POOL_SIZE = 6
KILL_EVERY_S = 12.0
POSTGRES_KILLS_AT_S = (6.0, 18.0)
# Each kill costs the attempts its replica held; under load an attempt may wait long
# enough to be held at two or three kills in a row. The retry budget is not what this
# test judges (test_chaos.py does): loss and duplication are.
MAX_ATTEMPTS = 8


@dataclasses.dataclass
class Kill:
    replica: str
    pid: int
    owner: str
    killed_at: dt.datetime
    held: list[tuple[int, int]]  # (job id, lease token) the replica held at the kill
    back_s: float = 0.0  # until the replica answered again, a new process
    takeover_s: float | None = None  # until all its jobs were claimed again
    reclaimed_by: tuple[str, ...] = ()


def leases_of(registry: Registry, owner: str) -> list[tuple[int, int]]:
    return [
        (job.id, job.lease_token)
        for job in registry.list_jobs(statuses=["RUNNING"])
        if job.lease_owner == owner
    ]


def settled(registry: Registry, runs: list[str]) -> bool:
    """Every report registered, and none QUEUED, RUNNING or WAITING_FOR_RESOURCES (a job
    whose attempt waits for a worker is not settled either)."""
    counts: Counter = Counter()
    for run in runs:
        try:
            counts.update(registry.job_counts(run))
        except RunNotFound:
            return False
    active = sum(counts[status.value] for status in ACTIVE_JOB_STATUSES)
    return sum(counts.values()) == RUNS * REPORTS_PER_RUN and not active


def kill_replica(handle, registry: Registry, kills: list[Kill]) -> Kill:
    """SIGKILL of a replica's process (its pid from status): another one than the last,
    each one before any a second time (the first replica, the supervisor, included), one
    that holds leases where one does, so that its takeover is measured."""
    entries = wait_for(lambda: answering(handle), 180, "every replica answering")
    killed = Counter(kill.replica for kill in kills)
    candidates = [e for e in entries if not kills or e["name"] != kills[-1].replica]
    fewest = min(killed[e["name"]] for e in candidates)
    candidates = [e for e in candidates if killed[e["name"]] == fewest]

    def holding():
        return [e for e in candidates if leases_of(registry, e["owner"])]

    try:
        [entry, *_] = wait_for(holding, 10, "a replica to kill holding a lease")
    except TimeoutError:
        entry = candidates[0]  # killed all the same; its takeover is not measured
    name = entry["name"]
    held = leases_of(registry, entry["owner"])
    kill = Kill(name, entry["pid"], entry["owner"], utcnow(), held)
    started = time.monotonic()
    os.kill(entry["pid"], signal.SIGKILL)

    def back():
        entries = answering(handle)
        return entries and any(e["name"] == name and e["pid"] != kill.pid for e in entries)

    wait_for(back, 180, f"{name} answering again after SIGKILL")
    kill.back_s = time.monotonic() - started
    return kill


def measure_takeovers(kills: list[Kill], jobs: dict) -> None:
    """For each kill: the next attempt's claimed_at of each job the replica held, minus
    the kill time (a job whose held attempt SUCCEEDED had finished before the kill)."""
    for kill in kills:
        waits, owners = [], []
        for job_id, token in kill.held:
            job = jobs[job_id]
            [held] = [a for a in job.attempt_history if a.lease_token == token]
            if held.status == "SUCCEEDED":
                continue
            assert held.status == "FAILED", (kill, held)
            [after] = [a for a in job.attempt_history if a.attempt == held.attempt + 1]
            waits.append((after.claimed_at - kill.killed_at).total_seconds())
            owners.append(after.lease_owner.split("/")[0])
        kill.takeover_s = max(waits) if waits else None
        kill.reclaimed_by = tuple(owners)


def assert_validated_once(registry: Registry, runs: list[str]) -> dict:
    """Exactly one SUCCEEDED attempt per job, one merged result per checkpoint (the one
    its report's step gives), each validated metric stored once; returns jobs by id."""
    jobs = {}
    for run in runs:
        validations = registry.validations(run)
        others = [
            (job.id, job.status, job.error_type, job.error_message, job.attempt_history)
            for job in validations
            if job.status != "SUCCEEDED"
        ]
        statuses = Counter(job.status for job in validations)
        assert statuses == {"SUCCEEDED": REPORTS_PER_RUN}, others
        for job in validations:
            succeeded = [a for a in job.attempt_history if a.status == "SUCCEEDED"]
            assert len(succeeded) == 1, (job.id, job.attempt_history)
            assert succeeded[0].lease_token == job.lease_token, (job.id, job.attempt_history)
            assert not [a for a in job.attempt_history if a.status == "RUNNING"]
            expected = {"step_seen": job.report_index, "score": job.report_index / 1000.0}
            assert job.result_metrics == expected, (job.id, job.result_metrics)
            jobs[job.id] = job
        checkpoints = registry.checkpoints(run)
        assert len(checkpoints) == REPORTS_PER_RUN
        for checkpoint in checkpoints:
            step = checkpoint.report_index
            assert checkpoint.validated_metrics == {"step_seen": step, "score": step / 1000.0}
    rows = validated_metric_rows(registry, runs)
    assert len(rows) == RUNS * REPORTS_PER_RUN * 2
    assert all(count == 1 for count in rows.values()), rows
    return jobs


def validated_metric_rows(registry: Registry, runs: list[str]) -> Counter:
    """(checkpoint id, metric name) -> validated rows in metric_values, for these runs."""
    query = sa.text(
        "SELECT v.checkpoint_id, v.name FROM metric_values v JOIN runs r ON r.id = v.run_id "
        "WHERE v.source = 'validated' AND r.name IN :runs"
    ).bindparams(sa.bindparam("runs", expanding=True))
    with registry.engine.connect() as conn:
        return Counter(tuple(row) for row in conn.execute(query, {"runs": runs}))


def test_replicas_killed_in_turn_lose_and_duplicate_nothing(
    start_replicas, postgres_server_url, tmp_path, unique_run
):
    start, registry = start_replicas
    handle = start(REPLICAS, pools={"CPU": POOL_SIZE})
    names = [replica_name(handle.settings.service_name, i) for i in range(REPLICAS)]
    entries = wait_for(lambda: answering(handle), 180, "every replica answering")
    assert [e["name"] for e in entries] == names

    runs = [f"{unique_run}-{i}" for i in range(RUNS)]
    log = tmp_path / "executions.log"
    env = reporter_env()
    outputs = [tmp_path / f"reporter-{i}" for i in range(RUNS)]
    files = [(o.with_suffix(".out").open("w"), o.with_suffix(".err").open("w")) for o in outputs]
    started = time.monotonic()
    reporters = [
        subprocess.Popen(
            [sys.executable, str(REPORTER), run, str(REPORTS_PER_RUN)]
            + ["--hold-s", str(HOLD_S), "--log", str(log), "--max-attempts", str(MAX_ATTEMPTS)],
            env=env,
            stdout=out,
            stderr=err,
        )
        for run, (out, err) in zip(runs, files, strict=True)
    ]
    kills: list[Kill] = []
    terminated: list[int] = []
    try:
        # Kill a replica every KILL_EVERY_S until every report is validated, each of the
        # three at least once; PostgreSQL's backends are terminated twice meanwhile.
        while not (
            len(kills) >= REPLICAS
            and all(r.poll() is not None for r in reporters)
            and settled(registry, runs)
        ):
            elapsed = time.monotonic() - started
            assert elapsed < 600, f"not settled after {elapsed:.0f}s: {kills}"
            if len(terminated) < len(POSTGRES_KILLS_AT_S):
                if elapsed >= POSTGRES_KILLS_AT_S[len(terminated)]:
                    terminated.append(terminate_backends(postgres_server_url))
            if elapsed >= KILL_EVERY_S * (len(kills) + 1):
                kills.append(kill_replica(handle, registry, kills))
            time.sleep(0.2)
    finally:
        for reporter in reporters:
            if reporter.poll() is None:
                reporter.kill()
            reporter.wait(timeout=60)
        for out, err in files:
            out.close()
            err.close()
    took = time.monotonic() - started
    for reporter, output in zip(reporters, outputs, strict=True):
        assert reporter.returncode == 0, output.with_suffix(".err").read_text()[-3000:]
        acknowledged = output.with_suffix(".out").read_text().count("acknowledged")
        assert acknowledged == REPORTS_PER_RUN

    jobs = assert_validated_once(registry, runs)
    executions = Counter(tuple(line.split()) for line in log.read_text().splitlines())
    assert set(executions) == {(run, str(step)) for run in runs for step in range(REPORTS_PER_RUN)}
    assert {kill.replica for kill in kills} == set(names)
    assert len(terminated) == len(POSTGRES_KILLS_AT_S) and all(terminated)
    measure_takeovers(kills, jobs)
    takeovers = [k.takeover_s for k in kills if k.takeover_s is not None]
    assert len(takeovers) >= REPLICAS - 1, kills
    # A restarted replica releases its predecessor's leases; the others requeue them when
    # they expire: either way within a lease and a few heartbeats of the kill.
    assert max(takeovers) < LEASE_S + 60, kills
    backs = [k.back_s for k in kills]

    def label(replica: str) -> str:
        return "the first" if replica == names[0] else replica.removeprefix(names[0] + "-")

    def takeover(kill: Kill) -> str:
        if kill.takeover_s is None:
            return f"{label(kill.replica)}: no job to take over"
        by = sorted(
            {"itself restarted" if r == kill.replica else label(r) for r in kill.reclaimed_by}
        )
        return (
            f"{label(kill.replica)}: {len(kill.reclaimed_by)} job(s) claimed again after "
            f"{kill.takeover_s:.1f}s by {' and '.join(by)}, answering after {kill.back_s:.1f}s"
        )

    total = RUNS * REPORTS_PER_RUN
    figure(
        f"{REPLICAS} replicas, {total} reports from {RUNS} processes; a replica killed with "
        f"SIGKILL every {KILL_EVERY_S:g}s ({'; '.join(takeover(k) for k in kills)}), PostgreSQL "
        f"backends terminated {len(terminated)} times ({sum(terminated)} connections): "
        f"{total}/{total} validated, 0 duplicate results, 0 stuck; takeover "
        f"{statistics.median(takeovers):.1f}s median / {max(takeovers):.1f}s max after the "
        f"kill, replica answering again {statistics.median(backs):.1f}s median / "
        f"{max(backs):.1f}s max; {sum(executions.values()) - total} executions completed "
        f"twice; {took:.0f}s in all"
    )


# --------------------------------------------- a paused replica's late result
def first_execution_waits(checkpoint, config):
    """The first execution of a report waits for the test's gate; later ones return at
    once. The result says which process and which execution produced it."""
    folder = Path(config["folder"])
    index = config["index"]
    executions = folder / f"executions-{index}"
    with executions.open("a") as f:
        f.write(f"{os.getpid()}\n")
    execution = len(executions.read_text().split())
    if execution == 1:
        gate = folder / f"gate-{index}"
        deadline = time.monotonic() + 600
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    (folder / f"returned-{index}-{execution}").write_text(str(os.getpid()))
    return {"produced_by_pid": os.getpid(), "execution": execution}


def blocked_by(conn, database: str) -> list[tuple[int, str]]:
    """(client port, tuple lock mode) of the backends of the database that wait on a row
    this connection locked."""
    query = sa.text(
        "SELECT a.client_port, l.mode FROM pg_stat_activity a JOIN pg_locks l "
        "ON l.pid = a.pid AND l.locktype = 'tuple' "
        "AND l.relation = 'validation_jobs'::regclass "
        "WHERE a.datname = :d AND pg_backend_pid() = ANY(pg_blocking_pids(a.pid))"
    )
    return [tuple(row) for row in conn.execute(query, {"d": database})]


def finished_task_pids(task_name: str) -> set[int]:
    """Worker pids of the tasks named ``task_name`` whose owner has seen them finish (the
    owner records FINISHED when the result reaches it)."""
    from ray._private import state
    from ray.core.generated import common_pb2

    finished = common_pb2.TaskStatus.Value("FINISHED")
    by_task: dict[bytes, dict] = {}
    for event in state.state._get_all_task_events():
        if event.task_info.name == task_name or event.task_id in by_task:
            seen = by_task.setdefault(event.task_id, {"pid": None, "finished": False})
            updates = event.state_updates
            if updates.HasField("worker_pid"):
                seen["pid"] = updates.worker_pid
            seen["finished"] |= finished in updates.state_ts_ns
    return {seen["pid"] for seen in by_task.values() if seen["finished"] and seen["pid"]}


def worker_log(pid: int) -> str:
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return "".join(path.read_text(errors="replace") for path in logs.glob(f"worker-*-{pid}.err"))


def test_paused_replicas_late_result_is_refused_by_the_fence(
    start_replicas, postgres_server_url, tmp_path, unique_run
):
    """Replica A holds jobs J1 and J2 (J1 launched first). The test holds J1's row FOR KEY
    SHARE (an UPDATE passes it, a FOR UPDATE waits), lets J1's validation end, and A's
    scheduler stops inside J1's finish, after its heartbeat and before its write: where
    a pause lets a stale result through if anything does. A is paused (SIGSTOP) past its
    lease; replica B requeues J2, claims it under a new token, runs it and merges its
    result. J2's first validation (A's) then ends, A is resumed (SIGCONT) and gets its
    result, the test lets go of J1, and A goes on to record J2's late result."""
    start, registry = start_replicas
    handle = start(2, pools={"CPU": 3})
    entries = wait_for(lambda: answering(handle), 180, "both replicas answering")
    by_owner = {e["owner"]: e for e in entries}
    client = Client(unique_run)
    for index in range(3):
        (tmp_path / f"c{index}").mkdir()
        (tmp_path / f"c{index}" / "step.txt").write_text(str(index))
        client.report(
            {"step": index},
            Checkpoint.from_directory(str(tmp_path / f"c{index}")),
            validate_fn=first_execution_waits,
            validate_config={"index": index, "folder": str(tmp_path)},
        )

    def all_running():
        jobs = registry.validations(unique_run)
        started = all((tmp_path / f"executions-{j.report_index}").exists() for j in jobs)
        return jobs if started and all(j.status == "RUNNING" for j in jobs) else None

    jobs = wait_for(all_running, 120, "three first executions running")
    holders = Counter(job.lease_owner for job in jobs)
    a_owner = holders.most_common(1)[0][0]
    a = by_owner[a_owner]
    [b] = [e for e in entries if e["owner"] != a_owner]
    # A's scheduler keeps its attempts in launch order: by claim time, then by id.
    j1, j2 = sorted(
        (job for job in jobs if job.lease_owner == a_owner),
        key=lambda job: (job.attempt_history[-1].claimed_at, job.id),
    )[:2]
    database = sa.engine.make_url(postgres_server_url).database
    engine = sa.create_engine(postgres_server_url)
    a_actor = ray.get_actor(a["name"], namespace=handle.settings.ray_namespace)
    locker = engine.connect()
    lock = locker.begin()
    paused = False
    try:
        locker.execute(
            sa.text("SELECT id FROM validation_jobs WHERE id = :j FOR KEY SHARE"), {"j": j1.id}
        )
        (tmp_path / f"gate-{j1.report_index}").touch()
        [(port, mode)] = wait_for(
            lambda: blocked_by(locker, database), 120, "A's finish of J1 waiting on its row"
        )
        # A FOR UPDATE waits on the tuple in AccessExclusiveLock mode; the waiter is A's.
        assert mode == "AccessExclusiveLock"
        assert port in {c.laddr.port for c in psutil.Process(a["pid"]).net_connections()}
        os.kill(a["pid"], signal.SIGSTOP)
        paused, paused_at = True, time.monotonic()

        def taken_over():
            job = registry.get_job(j2.id)
            return job if job.status == "SUCCEEDED" else None

        j2_done = wait_for(taken_over, 120, "B taking J2 over and finishing it")
        took_over_s = time.monotonic() - paused_at
        (tmp_path / f"gate-{j2.report_index}").touch()
        late_pid = int(
            wait_for(
                lambda: _read(tmp_path / f"returned-{j2.report_index}-1"),
                60,
                "A's execution of J2 returning",
            )
        )
        os.kill(a["pid"], signal.SIGCONT)
        paused, paused_s = False, time.monotonic() - paused_at
        task_name = f"ckval-validate:{unique_run}:{j2.report_index}"
        wait_for(
            lambda: late_pid in finished_task_pids(task_name),
            60,
            "A receiving its late result of J2",
            every_s=0.5,
        )
        lock.commit()
        # A goes on: J1's finish and then J2's, both refused. Its other jobs (B took them
        # over; their first executions still wait for their gates) it drops at its next
        # heartbeat; their gates open after that, so that no third late result comes.
        status = wait_for(
            lambda: (
                (s := ray.get(a_actor.replica_status.remote(), timeout=30))["stale"] >= 2
                and s["in_flight"] == 0
                and s
            ),
            60,
            "A recording its stale results",
        )
    finally:
        if paused:
            os.kill(a["pid"], signal.SIGCONT)
        if lock.is_active:
            lock.rollback()
        locker.close()
        engine.dispose()
        for index in range(3):
            (tmp_path / f"gate-{index}").touch()

    registry.wait(unique_run, timeout_s=180)
    log = worker_log(a["pid"])
    for job in (j1, j2):
        stale = f"discarding the result of job {job.id} with stale lease token {job.lease_token}"
        assert stale in log, log[-3000:]
    assert status["stale"] == 2

    jobs = {job.id: job for job in registry.validations(unique_run)}
    assert Counter(job.status for job in jobs.values()) == {"SUCCEEDED": 3}
    for job in jobs.values():
        assert sum(attempt.status == "SUCCEEDED" for attempt in job.attempt_history) == 1
    final = jobs[j2.id]
    assert final.result_metrics == j2_done.result_metrics
    [stale_attempt] = [t for t in final.attempt_history if t.lease_token == j2.lease_token]
    [kept] = [t for t in final.attempt_history if t.status == "SUCCEEDED"]
    assert stale_attempt.lease_owner == a_owner and stale_attempt.status == "FAILED"
    assert kept.lease_owner == b["owner"] and kept.lease_token > j2.lease_token
    assert final.result_metrics == {"produced_by_pid": kept.worker_pid, "execution": 2}
    assert kept.worker_pid != late_pid
    [checkpoint] = [c for c in registry.checkpoints(unique_run) if c.id == final.checkpoint_id]
    assert checkpoint.validated_metrics == final.result_metrics
    rows = validated_metric_values(registry, final.checkpoint_id)
    assert rows == [("execution", 2.0), ("produced_by_pid", float(kept.worker_pid))]
    figure(
        f"replica paused (SIGSTOP) {paused_s:.1f}s holding a job, past its {LEASE_S:g}s "
        f"lease: the other replica took it over (lease token {j2.lease_token} -> "
        f"{kept.lease_token}) and merged its result {took_over_s:.1f}s after the pause; "
        f"on SIGCONT the paused replica's late result was refused by the fence (stale=2: "
        f"that one, and the job it was finishing when paused, requeued meanwhile); "
        f"1 SUCCEEDED attempt, merged metrics from the new owner's worker "
        f"(pid {kept.worker_pid}, not {late_pid})"
    )


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def validated_metric_values(registry: Registry, checkpoint_id: int) -> list[tuple[str, float]]:
    query = sa.text(
        "SELECT name, value FROM metric_values WHERE checkpoint_id = :c "
        "AND source = 'validated' ORDER BY name"
    )
    with registry.engine.connect() as conn:
        return [tuple(row) for row in conn.execute(query, {"c": checkpoint_id})]
