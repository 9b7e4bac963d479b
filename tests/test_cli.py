"""The `ckval` command line over a real SQLite registry, and against real Ray clusters."""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from validation_service.cli import EXIT_NOT_RUNNING, EXIT_USAGE, main
from validation_service.cli._format import format_time
from validation_service.errors import InvalidInput
from validation_service.metrics import lower_is_better
from validation_service.registry.records import JobOutcome
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest

ROOT = Path(__file__).resolve().parents[1]
FLOAT32_ACCURACY = 0.699999988079071  # float(torch.tensor(0.7)): what a float32 metric stores
NODE_ID = "3f9c1e2a7b" + "0" * 46  # Ray node ids have 56 hex characters
LOCAL_TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC[+-]\d\d:\d\d")


def _request(pool: str = "CPU") -> ValidationRequest:
    return ValidationRequest(
        executor_kind="ray_task",
        pool=pool,
        validate_fn_name="validate",
        validate_fn_ref="json:dumps",
        max_attempts=1,
    )


@pytest.fixture
def populated(tmp_path):
    """Run "digits": 3 validated checkpoints and a failed one. Run "mnist": one validated
    with a float32 metric on a named node, one still QUEUED in the A10G pool."""
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    registry = Registry(url)
    run_id = registry.ledger.ensure_run("digits", storage_root=str(tmp_path))
    for index, loss in enumerate([0.9, 0.5, 0.7, 0.4]):
        registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=f"{tmp_path}/ckpt_{index}",
            size_bytes=2048,
            manifest_sha256=None,
            reported_metrics={"epoch": index, "loss": loss},
            job=_request(),
        )
    claimed = registry.job_queue.claim_due_jobs("cli-test", {}, lease_s=60)
    accuracy = {0: 0.61, 1: 0.83, 2: 0.77}
    for c in claimed:
        if c.report_index in accuracy:
            registry.job_queue.finish_job(
                c.job_id,
                c.lease_token,
                JobOutcome(succeeded=True, metrics={"accuracy": accuracy[c.report_index]}),
            )
        else:
            registry.job_queue.finish_job(
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
    mnist = registry.ledger.ensure_run("mnist", storage_root=str(tmp_path))
    for index, pool in enumerate(["CPU", "A10G"]):
        registry.ledger.register_checkpoint(
            mnist,
            index,
            uri=f"{tmp_path}/mnist_{index}",
            size_bytes=4096,
            manifest_sha256=None,
            reported_metrics={"epoch": index},
            job=_request(pool),
        )
    [c] = registry.job_queue.claim_due_jobs("cli-test", {"A10G": 0}, lease_s=60)
    registry.job_queue.finish_job(
        c.job_id,
        c.lease_token,
        JobOutcome(
            succeeded=True, metrics={"accuracy": FLOAT32_ACCURACY}, node_id=NODE_ID, worker_pid=41
        ),
    )
    registry.close()
    return url


def invoke(url, *args, env=None):
    result = CliRunner().invoke(main, ["--database-url", url, *args], env=env)
    return result.exit_code, result.output


def invoke_split(url, *args):
    """Exit code, stdout and stderr apart."""
    result = CliRunner().invoke(main, ["--database-url", url, *args])
    return result.exit_code, result.stdout, result.stderr


def table_rows(out: str) -> list[list[str]]:
    """The rows of the first table in ``out`` (after the header and the rule), split."""
    lines = out.strip().splitlines()
    rows = []
    for line in lines[2:]:
        if not line.strip() or line.startswith("("):
            break
        rows.append(line.split())
    return rows


# ------------------------------------------------------------------------------- best
def test_best_prints_a_ranked_table(populated):
    code, out = invoke(
        populated, "best", "digits", "--metric", "accuracy", "--mode", "max", "-k", "3"
    )
    assert code == 0, out
    lines = out.strip().splitlines()
    assert lines[0].split()[:5] == ["#", "report", "validation", "accuracy", "epoch"]
    assert [row[1] for row in table_rows(out)] == ["1", "2", "0"]
    assert "0.83 " in lines[2] and "ckpt_1" in lines[2]


def test_best_min_mode_and_json(populated):
    code, out = invoke(
        populated, "best", "digits", "--metric", "loss", "--mode", "min", "-k", "2", "--json"
    )
    assert code == 0, out
    assert [c["report_index"] for c in json.loads(out)] == [3, 1]


def test_best_warns_when_mode_defaults_to_max_for_a_loss(populated):
    code, out, err = invoke_split(populated, "best", "digits", "--metric", "loss", "-k", "2")
    assert code == 0, err
    assert "--mode defaulted to max" in err and "--mode min" in err and "'loss'" in err
    # The default still ranks highest first: the warning explains, it does not change it.
    assert [row[1] for row in table_rows(out)] == ["0", "2"]


def test_best_with_an_explicit_mode_or_a_higher_is_better_metric_does_not_warn(populated):
    for args in (["--metric", "loss", "--mode", "max"], ["--metric", "accuracy"]):
        code, out, err = invoke_split(populated, "best", "digits", *args)
        assert code == 0, err
        assert err == ""
        assert len(table_rows(out)) == 1


@pytest.mark.parametrize(
    "name",
    ["loss", "val_loss", "valLoss", "valloss", "test/error", "top1_err", "val_mse", "mae",
     "rmse", "eval_perplexity", "wer", "val_cer"],
)  # fmt: skip
def test_lower_is_better_names(name):
    assert lower_is_better(name)


@pytest.mark.parametrize("name", ["accuracy", "val_acc", "f1", "power", "answer", "num_errors"])
def test_higher_is_better_names(name):
    assert not lower_is_better(name)


def test_registry_best_checkpoints_warns_only_without_a_mode(populated):
    registry = Registry(populated)
    with pytest.warns(UserWarning, match="mode='min'"):
        ranked = registry.best_checkpoints("digits", "loss", k=4)
    assert [metrics["loss"] for _, metrics in ranked] == [0.9, 0.7, 0.5, 0.4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        [(_, metrics)] = registry.best_checkpoints("digits", "loss", "min")
        assert metrics["loss"] == 0.4
        assert len(registry.best_checkpoints("digits", "accuracy")) == 1


def test_cross_run_best_shows_the_run_column(populated):
    code, out = invoke(populated, "best", "--metric", "accuracy", "-k", "4")
    assert code == 0, out
    assert out.splitlines()[0].split()[:4] == ["#", "run", "report", "validation"]
    rows = table_rows(out)
    assert [(row[1], row[2]) for row in rows] == [
        ("digits", "1"),
        ("digits", "2"),
        ("mnist", "0"),
        ("digits", "0"),
    ]


def test_best_k_below_one_is_a_usage_error(populated):
    code, out = invoke(populated, "best", "digits", "--metric", "accuracy", "-k", "0")
    assert code == EXIT_USAGE and "-k" in out and "x>=1" in out


def test_unknown_run_and_metric_are_clear_errors(populated):
    code, out = invoke(populated, "best", "nope", "--metric", "accuracy")
    assert code == 2 and "No run named 'nope'" in out and "digits" in out
    code, out = invoke(populated, "best", "digits", "--metric", "f1")
    assert code == 2 and "'f1'" in out and "accuracy" in out


# ------------------------------------------------------------------- human formatting
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


def test_human_output_rounds_floats_shortens_node_ids_and_shows_plain_dicts(populated):
    code, out = invoke(populated, "checkpoints", "mnist")
    assert code == 0, out
    assert "0.7 " in out and "0.69999" not in out
    code, out = invoke(populated, "jobs", "mnist")
    assert code == 0, out
    [validated] = [row for row in table_rows(out) if "SUCCEEDED" in row]
    assert NODE_ID[:8] in validated and NODE_ID not in out
    job_id = validated[0]
    code, out = invoke(populated, "job", job_id)
    assert code == 0, out
    assert re.search(r"^result_metrics\s+accuracy=0\.7$", out, re.MULTILINE)
    assert re.search(r"^resources\s+-$", out, re.MULTILINE)
    assert "{" not in out and "0.69999" not in out and NODE_ID not in out
    assert re.search(rf"^1\s+SUCCEEDED\s+{NODE_ID[:8]}\s+41\s", out, re.MULTILINE)
    assert re.search(rf"^created_at\s+{LOCAL_TIME.pattern}$", out, re.MULTILINE)


@pytest.fixture
def india_time():
    """This process's local zone at UTC+05:30, for the test's length."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "IST-5:30"
    time.tzset()
    yield
    if before is None:
        os.environ.pop("TZ")
    else:
        os.environ["TZ"] = before
    time.tzset()


def test_human_times_are_local_with_their_zone(populated, india_time):
    code, out = invoke(populated, "runs", "--json")
    assert code == 0, out
    created = dt.datetime.fromisoformat(json.loads(out)[0]["created_at"])
    code, out = invoke(populated, "runs")
    assert code == 0, out
    local = created.astimezone(dt.timezone(dt.timedelta(hours=5, minutes=30)))
    assert f"{local:%Y-%m-%d %H:%M:%S} UTC+05:30" in out


def test_format_time_names_the_offset():
    utc = dt.datetime(2026, 11, 23, 11, 3, 4, tzinfo=dt.timezone.utc)
    plus_one = dt.timezone(dt.timedelta(hours=1))
    assert format_time(utc, plus_one) == "2026-11-23 12:03:04 UTC+01:00"
    minus = dt.timezone(-dt.timedelta(hours=5, minutes=30))
    assert format_time(utc, minus) == "2026-11-23 05:33:04 UTC-05:30"
    # The registry's times are UTC; a naive one is read as UTC.
    assert format_time(utc.replace(tzinfo=None), plus_one) == "2026-11-23 12:03:04 UTC+01:00"


# ------------------------------------------------------------------------------- JSON
def _assert_utc_iso(value: str) -> None:
    parsed = dt.datetime.fromisoformat(value)
    assert parsed.utcoffset() == dt.timedelta(0), value


def test_runs_json(populated):
    code, out = invoke(populated, "runs", "--json")
    assert code == 0, out
    runs = {run["name"]: run for run in json.loads(out)}
    assert set(runs) == {"digits", "mnist"}
    assert runs["digits"]["checkpoints"] == 4
    assert runs["digits"]["jobs"]["SUCCEEDED"] == 3 and runs["digits"]["jobs"]["FAILED"] == 1
    assert runs["mnist"]["jobs"]["QUEUED"] == 1
    _assert_utc_iso(runs["mnist"]["created_at"])


def test_checkpoints_json_keeps_full_precision(populated):
    code, out = invoke(populated, "checkpoints", "mnist", "--json")
    assert code == 0, out
    first, second = json.loads(out)
    assert first["metrics"]["accuracy"] == FLOAT32_ACCURACY
    assert first["validated_metrics"] == {"accuracy": FLOAT32_ACCURACY}
    assert (first["run"], first["report_index"], second["validation_status"]) == (
        "mnist",
        0,
        "PENDING",
    )
    _assert_utc_iso(first["created_at"])


def test_cross_run_best_json_names_each_run(populated):
    code, out = invoke(populated, "best", "--metric", "accuracy", "-k", "3", "--json")
    assert code == 0, out
    assert [(c["run"], c["metrics"]["accuracy"]) for c in json.loads(out)] == [
        ("digits", 0.83),
        ("digits", 0.77),
        ("mnist", FLOAT32_ACCURACY),
    ]


def test_jobs_and_job_json(populated):
    code, out = invoke(populated, "jobs", "--json")
    assert code == 0, out
    found = json.loads(out)
    assert [(j["run"], j["report_index"], j["status"]) for j in found] == [
        ("digits", 0, "SUCCEEDED"),
        ("digits", 1, "SUCCEEDED"),
        ("digits", 2, "SUCCEEDED"),
        ("digits", 3, "FAILED"),
        ("mnist", 0, "SUCCEEDED"),
        ("mnist", 1, "QUEUED"),
    ]
    mnist_job = found[4]["id"]
    code, out = invoke(populated, "job", str(mnist_job), "--json")
    assert code == 0, out
    record = json.loads(out)
    assert record["result_metrics"] == {"accuracy": FLOAT32_ACCURACY}
    [attempt] = record["attempts"]
    assert attempt["node_id"] == NODE_ID and attempt["worker_pid"] == 41
    _assert_utc_iso(record["finished_at"])


# ------------------------------------------------------------------------------- jobs
def test_jobs_without_a_run_lists_the_whole_queue_with_a_run_column(populated):
    code, out = invoke(populated, "jobs")
    assert code == 0, out
    assert out.splitlines()[0].split()[:3] == ["job", "run", "report"]
    assert [(row[1], row[3]) for row in table_rows(out)] == [
        ("digits", "SUCCEEDED"),
        ("digits", "SUCCEEDED"),
        ("digits", "SUCCEEDED"),
        ("digits", "FAILED"),
        ("mnist", "SUCCEEDED"),
        ("mnist", "QUEUED"),
    ]


def test_jobs_status_filter_is_repeatable_and_case_blind(populated):
    code, out = invoke(populated, "jobs", "--status", "FAILED")
    assert code == 0, out
    assert [(row[1], row[3]) for row in table_rows(out)] == [("digits", "FAILED")]
    code, out = invoke(populated, "jobs", "--status", "queued", "--status", "failed")
    assert code == 0, out
    assert [row[3] for row in table_rows(out)] == ["FAILED", "QUEUED"]
    code, out = invoke(populated, "jobs", "digits", "--status", "QUEUED")
    assert code == 0 and "(none)" in out


def test_jobs_pool_filter(populated):
    code, out = invoke(populated, "jobs", "--pool", "A10G", "--json")
    assert code == 0, out
    assert [(j["run"], j["pool"], j["status"]) for j in json.loads(out)] == [
        ("mnist", "A10G", "QUEUED")
    ]


def test_jobs_limit_keeps_the_newest_and_says_so(populated):
    code, out, err = invoke_split(populated, "jobs", "--limit", "2")
    assert code == 0, err
    assert [(row[1], row[2]) for row in table_rows(out)] == [("mnist", "0"), ("mnist", "1")]
    assert "the newest 2 jobs" in err
    code, out, err = invoke_split(populated, "jobs", "--limit", "6")
    assert len(table_rows(out)) == 6 and err == ""


def test_jobs_unknown_status_is_a_usage_error(populated):
    code, out = invoke(populated, "jobs", "--status", "DONE")
    assert code == EXIT_USAGE and "'DONE'" in out and "QUEUED" in out


def test_jobs_limit_below_one_is_a_usage_error(populated):
    code, out = invoke(populated, "jobs", "--limit", "0")
    assert code == EXIT_USAGE and "--limit" in out


def test_jobs_watch_with_json_is_a_usage_error(populated):
    code, out = invoke(populated, "jobs", "digits", "--watch", "--json")
    assert code == EXIT_USAGE and "--watch" in out


def test_jobs_of_an_unknown_run_is_a_clear_error(populated):
    code, out = invoke(populated, "jobs", "nope")
    assert code == EXIT_USAGE and "No run named 'nope'" in out


def test_job_unknown_id_is_a_clear_error(populated):
    code, out = invoke(populated, "job", "999")
    assert code == EXIT_USAGE and "No validation job with id 999" in out


def test_registry_list_jobs_rejects_an_unknown_status(populated):
    with pytest.raises(InvalidInput, match="unknown job status 'DONE'.*QUEUED"):
        Registry(populated).list_jobs(statuses=["DONE"])


def test_registry_list_jobs_rejects_a_limit_below_one(populated):
    with pytest.raises(InvalidInput, match="limit must be at least 1"):
        Registry(populated).list_jobs(limit=0)


def test_jobs_watch_returns_at_once_when_nothing_is_active(populated):
    code, out = invoke(populated, "jobs", "digits", "--watch")
    assert code == 0, out
    *table, last = out.strip().splitlines()
    assert len(table) == 2 + 4
    assert last == "no job is QUEUED, RUNNING or WAITING_FOR_RESOURCES: SUCCEEDED=3 FAILED=1"


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


# --------------------------------------------------------- the service, without Ray
@functools.cache
def _out_of_sight_of_other_rays() -> tuple[str, ...] | None:
    """A command prefix under which no running Ray of this machine can be found: a new
    PID namespace (unshare), or none at all when no Ray runs here; None when neither."""
    unshare = shutil.which("unshare")
    if unshare:
        prefix = (unshare, "--pid", "--fork", "--mount-proc", "--kill-child")
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    from ray._private.services import find_gcs_addresses

    return None if find_gcs_addresses() else ()


@pytest.fixture
def without_ray(tmp_path):
    """(command prefix, environment) for a process that can find no Ray cluster: no
    address configured, its own Ray temp folder, no Ray process in sight."""
    prefix = _out_of_sight_of_other_rays()
    if prefix is None:
        pytest.skip("Ray runs on this machine and unshare cannot hide it")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "CKVAL_RAY_ADDRESS")}
    env.update(
        RAY_TMPDIR=str(tmp_path / "ray-tmp"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    return list(prefix), env


# Runs the CLI in this process, then reports its exit status and whether Ray is connected.
CLI_AND_RAY_STATE = """
import json, sys
from validation_service.cli import main
try:
    main(sys.argv[1:], prog_name="ckval")
except SystemExit as exc:
    code = exc.code
ray = sys.modules.get("ray")
print(json.dumps({"exit": code, "ray_initialized": bool(ray and ray.is_initialized())}))
"""


def run_cli_probe(prefix, env, *args, timeout=300):
    done = subprocess.run(
        [*prefix, sys.executable, "-c", CLI_AND_RAY_STATE, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    *printed, state = done.stdout.strip().splitlines()
    return json.loads(state), "\n".join(printed), done.stderr


@pytest.mark.parametrize("command", ["status", "stop"])
def test_without_a_ray_cluster_status_and_stop_start_none(without_ray, tmp_path, command):
    prefix, env = without_ray
    state, out, err = run_cli_probe(prefix, env, command)
    assert state == {"exit": EXIT_NOT_RUNNING, "ray_initialized": False}, err
    assert out == (
        "no ckval service is running (no Ray cluster found; start one with `ckval serve`)"
    )
    # Nothing was started: no Ray session folder in this process's Ray temp folder.
    assert not list((tmp_path / "ray-tmp").glob("**/session_*"))


def test_serve_detach_without_a_ray_cluster_is_refused_and_starts_none(without_ray, tmp_path):
    """A Ray that `serve --detach` started itself would stop with the command, and the
    service with it: a later `ckval status` would find nothing."""
    prefix, env = without_ray
    state, out, err = run_cli_probe(prefix, env, "serve", "--detach")
    assert state == {"exit": 1, "ray_initialized": False}, err
    assert "--detach leaves the service on a running Ray cluster" in err
    assert "no Ray cluster found" in err and "ray start --head --port 6380" in err
    assert not list((tmp_path / "ray-tmp").glob("**/session_*"))


# `ckval serve` in the background, then `ckval status` (until it answers) and `ckval stop`
# from other processes, as from another shell; prints each one's exit status.
SERVE_THEN_STATUS = """
ckval="$PYTHON -m validation_service.cli"
$ckval serve > serve.log 2>&1 &
served=$!
while [ $SECONDS -lt 150 ]; do
    timeout 20 $ckval status > status.json 2> status.err
    code=$?
    [ "$code" = 0 ] && break
    kill -0 $served 2> /dev/null || break
    sleep 1
done
echo "status: $code"
timeout 20 $ckval stop > stop.out 2>&1
echo "stop: $?"
kill -INT $served  # Ctrl-C, as in a terminal
timeout 30 tail --pid=$served -f /dev/null
"""


def test_status_joins_the_ray_that_serve_started_with_its_token(without_ray, tmp_path):
    """A new local Ray gets a token from Ray (RAY_AUTH_MODE unset), kept in
    ~/.ray/auth_token: `ckval status` and `ckval stop` from another process join that Ray
    with it, as `ray status` does, instead of failing on a missing token."""
    prefix, env = without_ray
    env.pop("RAY_AUTH_MODE", None)
    env.update(HOME=str(tmp_path / "home"), CKVAL_HOME=str(tmp_path / "ckval"))
    # A short Ray temp folder: its sockets' paths must fit a Unix socket's 107 bytes.
    env.update(PYTHON=sys.executable, RAY_TMPDIR=tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    done = subprocess.run(
        [*prefix, "bash", "-c", SERVE_THEN_STATUS],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    logs = {name: (tmp_path / name).read_text() for name in ("serve.log", "status.err")}
    assert "status: 0\nstop: 0" in done.stdout, (done.stdout, done.stderr, logs)
    assert (tmp_path / "home" / ".ray" / "auth_token").is_file()  # the Ray had a token
    assert json.loads((tmp_path / "status.json").read_text())["replicas"], logs


@pytest.mark.parametrize("command", ["status", "stop"])
def test_a_configured_address_where_no_ray_answers(tmp_path, command):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free once closed: nothing listens there
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(CKVAL_RAY_ADDRESS=f"127.0.0.1:{port}", RAY_TMPDIR=str(tmp_path / "ray-tmp"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    state, out, err = run_cli_probe([], env, command)
    assert state == {"exit": EXIT_NOT_RUNNING, "ray_initialized": False}, err
    assert f"no Ray cluster answers at 127.0.0.1:{port}, from CKVAL_RAY_ADDRESS" in out
    assert not list((tmp_path / "ray-tmp").glob("**/session_*"))


def _start_watch(prefix, env, url, *args):
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "validation_service.cli", "--database-url", url]
        + ["jobs", *args, "--watch", "--interval", "0.2"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a foreground job
        # As a terminal's foreground job: SIGINT at its default, even when this test runs
        # in a background job that ignores it (Python then raises no KeyboardInterrupt).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    errors: list[str] = []
    err_reader = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)
    err_reader.start()
    # The only readers of the pipes: joined once the process ends (see _finish_watch).
    proc.readers, proc.errors = (reader, err_reader), errors
    return proc, lines


def _finish_watch(proc, timeout_s: float = 120) -> str:
    """Waits for the watch to exit; returns its standard error (stdout is in its lines)."""
    proc.wait(timeout=timeout_s)
    for reader in proc.readers:
        reader.join(timeout_s)
    return "".join(proc.errors)


def _wait_for_line(lines: queue.Queue, pattern: str, timeout_s: float = 120) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if re.search(pattern, line):
            return seen
    raise AssertionError(f"no line matching {pattern!r} within {timeout_s}s: {seen}")


def test_jobs_watch_prints_status_changes_until_nothing_is_active(populated, without_ray):
    prefix, env = without_ray
    proc, lines = _start_watch(prefix, env, populated, "mnist")
    try:
        _wait_for_line(lines, r"^\d+\s+1\s+QUEUED\s")
        registry = Registry(populated)
        [claimed] = registry.job_queue.claim_due_jobs("watch-test", {}, lease_s=60)
        registry.job_queue.finish_job(
            claimed.job_id, claimed.lease_token, JobOutcome(succeeded=True, metrics={"f1": 0.5})
        )
        err = _finish_watch(proc)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    rest = "".join(iter_queue(lines))
    assert re.search(rf"UTC[+-]\d\d:\d\d  job {claimed.job_id} \(mnist report 1\): ", rest)
    assert "QUEUED -> SUCCEEDED" in rest or "RUNNING -> SUCCEEDED" in rest
    last = rest.strip().splitlines()[-1]
    assert last == "no job is QUEUED, RUNNING or WAITING_FOR_RESOURCES: SUCCEEDED=2"
    # No Ray to be found: the watch says why QUEUED jobs may not move, and goes on.
    assert "no ckval service is running (no Ray cluster found)" in err


def iter_queue(lines: queue.Queue):
    while True:
        try:
            yield lines.get_nowait()
        except queue.Empty:
            return


def _watch_env_without_ray(tmp_path) -> dict[str, str]:
    """An address where no Ray answers: the watch finds no service, at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(CKVAL_RAY_ADDRESS=f"127.0.0.1:{port}", RAY_TMPDIR=str(tmp_path / "ray-tmp"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_jobs_watch_ctrl_c_exits_zero(populated, tmp_path):
    proc, lines = _start_watch([], _watch_env_without_ray(tmp_path), populated)
    try:
        _wait_for_line(lines, r"\bQUEUED\b")
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
        err = _finish_watch(proc)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err


# Ctrl-C made to land inside exec() of a string, as it can while the watch imports Ray
# (dataclasses and namedtuple build their methods with exec and eval): CPython marks
# that KeyboardInterrupt unhandled even once the watch caught it, and `python -m` ended
# the process by SIGINT (one Ctrl-C in twelve, in a wait between 20 and 80 ms).
CTRL_C_INSIDE_EXEC = """\
import sys

class _CtrlCWhileRayImports:
    def find_spec(self, name, path=None, target=None):
        if name == "ray":
            sys.meta_path.remove(self)
            exec("import os, signal\\nos.kill(os.getpid(), signal.SIGINT)\\nwhile True: pass")
        return None

sys.meta_path.insert(0, _CtrlCWhileRayImports())
"""


def test_jobs_watch_ctrl_c_inside_an_exec_while_ray_imports_exits_zero(populated, tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(CTRL_C_INSIDE_EXEC)
    env = _watch_env_without_ray(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env["PYTHONPATH"]])
    proc, lines = _start_watch([], env, populated)
    try:
        err = _finish_watch(proc)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "QUEUED" in "".join(iter_queue(lines))  # the table came first, then Ctrl-C


# ----------------------------------------------------------- the service, on Ray
@pytest.mark.ray
def test_status_finds_the_running_service(service):
    code, out = invoke("sqlite://", "status")
    assert code == 0, out
    assert json.loads(out)["owner"] == service.status()["owner"]


@pytest.mark.ray
def test_status_from_a_new_process_finds_the_service_by_ray_address(service, ray_session):
    env = {k: v for k, v in os.environ.items() if k != "CKVAL_RAY_ADDRESS"}
    env["RAY_ADDRESS"] = ray_session.get_runtime_context().gcs_address
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "validation_service.cli", "status"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["owner"] == service.status()["owner"]


@pytest.mark.ray
def test_stop_stops_the_service_and_status_then_says_none(ray_session, tmp_path):
    from validation_service.config import get_settings
    from validation_service.service import ValidationService

    name = f"ckval-cli-{uuid.uuid4().hex[:8]}"
    url = f"sqlite:///{tmp_path / 'stop.db'}"
    ValidationService.start(settings=get_settings(service_name=name, database_url=url))
    env = {"CKVAL_SERVICE_NAME": name}
    code, out = invoke(url, "stop", env=env)
    assert code == 0 and f"stopped the ckval service '{name}'" in out
    code, out = invoke(url, "status", env=env)
    assert code == EXIT_NOT_RUNNING, out
    address = ray_session.get_runtime_context().gcs_address
    assert out.strip() == (
        f"no ckval service is running on the Ray cluster at {address} "
        "(start one with `ckval serve`)"
    )
    code, out = invoke(url, "stop", env=env)
    assert code == EXIT_NOT_RUNNING, out
