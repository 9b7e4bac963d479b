"""The CLI's fast read path (registry/_fast_read.py): `ckval runs`, `checkpoints`, `best`
and `jobs` print exactly what the Registry path prints, without SQLAlchemy, and fall
back to the Registry wherever it could differ."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.registry_world import delete_checkpoint
from validation_service.cli import common as cli_common
from validation_service.cli import main
from validation_service.config import Settings, get_settings
from validation_service.registry import _fast_read
from validation_service.registry.records import JobOutcome
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest
from validation_service.stopping import StopPolicy

ROOT = Path(__file__).resolve().parents[1]
NODE_ID = "3f9c1e2a7b" + "0" * 46


def _request(pool: str = "CPU", max_attempts: int = 1) -> ValidationRequest:
    return ValidationRequest(
        executor_kind="ray_task",
        pool=pool,
        validate_fn_name="validate",
        validate_fn_ref="json:dumps",
        max_attempts=max_attempts,
    )


def _claim(registry: Registry) -> dict[tuple[str, int], object]:
    claimed = registry.job_queue.claim_due_jobs("fast-read", {}, lease_s=60, default_limit=100)
    return {(c.run, c.report_index): c for c in claimed}


def _finish(registry: Registry, claimed, **outcome) -> None:
    registry.job_queue.finish_job(claimed.job_id, claimed.lease_token, JobOutcome(**outcome))


def _failure(message: str, *, retryable: bool = True, timed_out: bool = False) -> dict:
    return {
        "succeeded": False,
        "error_type": "TimeoutError" if timed_out else "ValueError",
        "error_message": message,
        "error_traceback": f"Traceback (most recent call last):\nValueError: {message}",
        "retryable": retryable,
        "timed_out": timed_out,
        "node_id": NODE_ID,
        "worker_pid": 7,
    }


def populate(path: Path) -> str:
    """Namespace "default": run "alpha" with 2 attempts (the second with validated,
    failed, timed-out, cancelled, running, queued and job-less checkpoints, a deleted one,
    aliases, tags and an overridden stop decision) and run "beta" in another pool with
    tied and NaN metrics and a stop decision; namespace "other": a run "alpha" of its own."""
    url = f"sqlite:///{path}"
    registry = Registry(url, settings=get_settings(retry_backoff_s=0))
    storage = str(path.parent / "checkpoints")

    def report(run_id, index, metrics, job):
        return registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=f"{storage}/{run_id}/{index}",
            size_bytes=1000 * (index + 1),
            manifest_sha256=None,
            reported_metrics=metrics,
            step=10 * index,
            epoch=index,
            job=job,
        )

    # Stop decisions: "alpha"'s second attempt stops at once and is resumed; "beta" stops.
    registry.set_stop_policy("alpha", StopPolicy("accuracy", threshold=0.6))
    registry.set_stop_policy("beta", StopPolicy("accuracy", patience=1))
    first = registry.ledger.ensure_run("alpha", storage_root=storage, tags={"team": "vision"})
    for index in range(2):
        report(first, index, {"loss": 1.0 - index / 10}, _request())
    for claimed in _claim(registry).values():
        _finish(registry, claimed, succeeded=True, metrics={"accuracy": 0.5})
    registry.ledger.finish_run("alpha")

    alpha = registry.ledger.ensure_run("alpha", storage_root=storage)
    losses = [0.9, 0.4, 0.6, 0.5, 0.7, 0.8]
    for index, loss in enumerate(losses):
        job = _request(pool="A10G" if index == 5 else "CPU", max_attempts=2 if index == 2 else 1)
        report(alpha, index, {"loss": loss, "epoch": index}, job)
    claimed = _claim(registry)
    _finish(registry, claimed["alpha", 0], succeeded=True, metrics={"accuracy": 0.7})
    _finish(
        registry,
        claimed["alpha", 1],
        succeeded=True,
        metrics={"accuracy": 0.9, "loss": 0.35},
        node_id=NODE_ID,
        worker_pid=41,
    )
    _finish(registry, claimed["alpha", 2], **_failure("bad shard"))
    _finish(registry, claimed["alpha", 3], **_failure("too slow", timed_out=True))
    registry.cancel_jobs([claimed["alpha", 4].job_id])
    registry.resume_despite_stop("alpha")
    # "alpha" 5 stays RUNNING; 2 failed once and is due again.
    again = _claim(registry)
    _finish(registry, again["alpha", 2], **_failure("bad shard\nsecond line", retryable=True))
    report(alpha, 6, {"loss": 0.3}, _request(pool="A10G"))  # stays QUEUED
    report(alpha, 7, {"loss": 0.05, "f1": 0.3}, None)  # no validation
    deleted = report(alpha, 8, {"loss": 0.01}, None)
    delete_checkpoint(registry, deleted.checkpoint_id)
    registry.set_alias("alpha", "prod", 0)
    registry.set_alias("alpha", "best", 0)
    registry.set_alias("alpha", "latest", 7)
    registry.tag("alpha", 0, "split", "val")
    registry.tag("alpha", 0, "dataset", "v2")

    beta = registry.ledger.ensure_run("beta", storage_root=storage)
    for index in range(4):
        metrics = {"val_loss": 0.5 + index / 100}
        if index == 3:
            metrics["loss"] = float("nan")
        report(beta, index, metrics, _request(pool="GPU"))
    for (_, index), claimed in _claim(registry).items():
        _finish(registry, claimed, succeeded=True, metrics={"accuracy": 0.9 if index < 2 else 0.2})
    registry.ledger.finish_run("beta", "FAILED")
    registry.close()

    other = Registry(url, namespace="other")
    run = other.ledger.ensure_run("alpha", storage_root=storage)
    other.ledger.register_checkpoint(
        run,
        0,
        uri=f"{storage}/o0",
        size_bytes=1,
        manifest_sha256=None,
        reported_metrics={"accuracy": 0.99, "loss": 0.001},
        job=_request(),
    )
    other.close()
    return url


@pytest.fixture(autouse=True)
def _no_session_settings(monkeypatch):
    """The session's CKVAL_* variables but CKVAL_HOME are unset here: a checked one (the
    session sets CKVAL_KEEP_WARM) sends every listing to the Registry path."""
    for name in [name for name in os.environ if name.startswith("CKVAL_")]:
        if name != "CKVAL_HOME":
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    return populate(tmp_path_factory.mktemp("fast-read") / "registry.db")


def invoke(args, *, fast: bool, env: dict | None = None, monkeypatch=None):
    """(exit code, stdout, stderr) of the CLI in this process, on one path."""
    env = {**(env or {}), "CKVAL_CLI_FAST_READ": "1" if fast else "0"}
    result = CliRunner().invoke(main, args, env=env)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def _no_registry(ctx):
    raise AssertionError("the fast read path should have answered")


COMMANDS = [
    ["runs"],
    ["runs", "--status", "finished"],
    ["runs", "--status", "RUNNING", "--json"],
    ["runs", "--json"],
    ["checkpoints", "alpha"],
    ["checkpoints", "alpha", "--json"],
    ["checkpoints", "beta"],
    ["best", "alpha", "--metric", "accuracy"],
    ["best", "alpha", "--metric", "loss"],
    ["best", "alpha", "--metric", "loss", "--mode", "min", "-k", "50"],
    ["best", "alpha", "--metric", "loss", "--mode", "max", "--json", "-k", "3"],
    ["best", "--metric", "accuracy", "-k", "10"],
    ["best", "--metric", "accuracy", "-k", "3", "--json"],
    ["best", "--metric", "val_loss", "--mode", "min"],
    ["best", "--metric", "f1"],
    ["best", "beta", "--metric", "loss"],
    ["best", "--metric", "nope"],
    ["best", "beta", "--metric", "nope"],
    ["best", "missing", "--metric", "accuracy"],
    ["checkpoints", "missing"],
    ["jobs"],
    ["jobs", "alpha"],
    ["jobs", "alpha", "--json"],
    ["jobs", "--json", "--limit", "2"],
    ["jobs", "--limit", "3"],
    ["jobs", "--status", "failed", "--status", "TIMED_OUT"],
    ["jobs", "--status", "queued", "--pool", "A10G"],
    ["jobs", "--pool", "GPU", "--json"],
    ["jobs", "beta", "--limit", "1"],
    ["jobs", "missing"],
    ["--namespace", "other", "runs"],
    ["--namespace", "other", "best", "--metric", "accuracy", "--json"],
    ["--namespace", "other", "checkpoints", "beta"],
    ["--namespace", "other", "jobs", "--json"],
    ["--namespace", "empty", "runs"],
    # Out of range: the Registry's own first check, with its error.
    ["best", "--metric", "accuracy", "-k", "1" + "0" * 30],
    ["best", "alpha", "--metric", "loss", "-k", "10001"],
]


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_fast_path_prints_what_the_registry_path_prints(url, args, monkeypatch):
    slow = invoke(["--database-url", url, *args], fast=False)
    with monkeypatch.context() as patched:
        patched.setattr(cli_common, "registry_of", _no_registry)
        fast = invoke(["--database-url", url, *args], fast=True)
    assert fast == slow
    assert fast[1] or fast[2]


def test_a_limit_beyond_64_bit_integers_is_a_usage_error_on_both_paths(url):
    args = ["--database-url", url, "jobs", "--limit", "1" + "0" * 30]
    fast = invoke(args, fast=True)
    assert fast == invoke(args, fast=False)
    assert fast[0] == 2 and "--limit" in fast[2] and "Traceback" not in fast[2]


def test_the_namespace_comes_from_ckval_namespace_too(url, monkeypatch):
    env = {"CKVAL_NAMESPACE": "other"}
    slow = invoke(["--database-url", url, "runs"], fast=False, env=env)
    monkeypatch.setattr(cli_common, "registry_of", _no_registry)
    fast = invoke(["--database-url", url, "runs"], fast=True, env=env)
    assert fast == slow and "alpha" in fast[1] and "beta" not in fast[1]


def test_records_equal_the_registrys(url):
    registry = Registry(url)
    reader = _fast_read.open_reader(url, None)
    assert reader is not None
    with reader:
        assert reader.run_summaries() == registry.run_summaries()
        assert reader.checkpoints("alpha") == registry.checkpoints("alpha")
        for run in (None, "alpha", "beta"):
            for mode in ("max", "min"):
                assert reader.best_checkpoint_records(
                    run, "loss", mode, 4
                ) == registry.best_checkpoint_records(run, "loss", mode, 4)
        assert reader.list_jobs() == registry.list_jobs()
        assert reader.list_jobs("alpha", statuses=["FAILED"], pool="CPU", limit=1) == (
            registry.list_jobs("alpha", statuses=["FAILED"], pool="CPU", limit=1)
        )
    registry.close()
    failed = [job for job in reader_jobs(url) if job.status == "FAILED"]
    assert len(failed[0].attempt_history) == 2
    assert failed[0].created_at.tzinfo is not None


def reader_jobs(url):
    with _fast_read.open_reader(url, None) as reader:
        return reader.list_jobs()


def test_an_empty_registry(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    Registry(url).close()
    for args in (["runs"], ["runs", "--json"], ["jobs"], ["best", "--metric", "accuracy"]):
        slow = invoke(["--database-url", url, *args], fast=False)
        with monkeypatch.context() as patched:
            patched.setattr(cli_common, "registry_of", _no_registry)
            assert invoke(["--database-url", url, *args], fast=True) == slow


# ------------------------------------------------------------------ falling back
def _downgraded_copy(url: str, tmp_path: Path) -> str:
    copy = tmp_path / "old.db"
    source = sqlite3.connect(url.removeprefix("sqlite:///"))
    target = sqlite3.connect(copy)
    source.backup(target)
    source.close()
    target.close()
    old = f"sqlite:///{copy}"
    Registry(old, check_schema=False).downgrade("0003")
    return old


def test_an_older_schema_goes_through_the_registry_which_migrates_it(url, tmp_path):
    old = _downgraded_copy(url, tmp_path)
    assert _fast_read.open_reader(old, None) is None
    code, out, _ = invoke(["--database-url", old, "runs"], fast=True)
    assert code == 0 and "alpha" in out
    # The Registry path migrated it: from now on the fast path reads it.
    assert _fast_read.open_reader(old, None) is not None


def test_a_newer_or_unknown_schema_is_not_read(url, tmp_path):
    old = _downgraded_copy(url, tmp_path)
    connection = sqlite3.connect(old.removeprefix("sqlite:///"))
    connection.execute("UPDATE alembic_version SET version_num = '9999'")
    connection.commit()
    connection.close()
    assert _fast_read.open_reader(old, None) is None


@pytest.mark.parametrize(
    "database_url",
    [
        "postgresql+psycopg://user:secret@127.0.0.1:1/ckval",
        "sqlite+pysqlite:///{path}",
        "sqlite:///{path}?timeout=5",
        "sqlite://",
    ],
)
def test_other_urls_are_not_read(url, database_url):
    path = url.removeprefix("sqlite:///")
    assert _fast_read.open_reader(database_url.format(path=path), None) is None


@pytest.mark.parametrize(
    "env",
    [
        {"CKVAL_CLI_FAST_READ": "0"},
        {"CKVAL_LEASE_S": "-1"},  # Settings() refuses it: the Registry path says so
        {"CKVAL_POOLS": "{}"},
        {"ckval_home": "/elsewhere"},
        {"CKVAL_HOME": ""},
    ],
)
def test_settings_the_fast_path_does_not_check_send_it_to_the_registry(url, env, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _fast_read.open_reader(url, None) is None


def test_a_bad_namespace_is_the_registrys_error(url):
    slow = invoke(["--database-url", url, "--namespace", "../x", "runs"], fast=False)
    fast = invoke(["--database-url", url, "--namespace", "../x", "runs"], fast=True)
    assert fast == slow and fast[0] != 0 and "namespace" in fast[2]


def test_debug_logging_goes_through_the_registry(url):
    import logging

    logger = logging.getLogger("validation_service")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        assert _fast_read.open_reader(url, None) is None
    finally:
        logger.setLevel(level)


def test_a_failing_read_falls_back_to_the_registry(url, monkeypatch):
    def broken(self, *args, **kwargs):
        raise _fast_read.Unavailable("broken")

    slow = invoke(["--database-url", url, "runs"], fast=False)
    monkeypatch.setattr(_fast_read.FastReader, "run_summaries", broken)
    assert invoke(["--database-url", url, "runs"], fast=True) == slow


def test_plain_and_checked_settings_are_all_of_settings():
    fields = set(Settings.model_fields)
    assert _fast_read.PLAIN_SETTINGS | _fast_read.CHECKED_SETTINGS == fields
    assert not _fast_read.PLAIN_SETTINGS & _fast_read.CHECKED_SETTINGS


# ------------------------------------------------- a fresh process, the default URL
CLI_THEN_MODULES = """
import json, sys
from validation_service.cli import main
try:
    main(sys.argv[1:], prog_name="ckval")
except SystemExit as exc:
    code = exc.code
names = ("sqlalchemy", "pydantic", "ray", "alembic")
print(json.dumps({"exit": code, "loaded": sorted(m for m in names if m in sys.modules)}))
"""


def python(*args: str, home: Path, **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CKVAL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(CKVAL_HOME=str(home), **env_vars)
    return subprocess.run(
        [sys.executable, "-c", CLI_THEN_MODULES, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def home(url) -> Path:
    """A CKVAL_HOME whose default registry.db is the populated registry."""
    return Path(url.removeprefix("sqlite:///")).parent


@pytest.mark.parametrize(
    "args",
    [
        ["runs"],
        ["checkpoints", "alpha", "--json"],
        ["best", "--metric", "accuracy", "-k", "3"],
        ["best", "alpha", "--metric", "loss", "--mode", "min", "--json"],
        ["jobs", "--status", "FAILED"],
    ],
    ids=" ".join,
)
def test_a_fresh_process_loads_neither_sqlalchemy_nor_pydantic(home, args):
    fast = python(*args, home=home)
    slow = python(*args, home=home, CKVAL_CLI_FAST_READ="0")
    assert fast.returncode == slow.returncode == 0, fast.stderr + slow.stderr
    *fast_out, fast_state = fast.stdout.splitlines()
    *slow_out, slow_state = slow.stdout.splitlines()
    assert fast_out == slow_out and fast.stderr == slow.stderr
    assert json.loads(fast_state)["loaded"] == []
    assert "sqlalchemy" in json.loads(slow_state)["loaded"]


def test_a_missing_database_is_not_created_by_the_fast_path(tmp_path):
    missing = tmp_path / "nowhere" / "registry.db"
    assert _fast_read.open_reader(f"sqlite:///{missing}", None) is None
    assert not missing.exists() and not missing.parent.exists()
    # The listing itself behaves as before: the Registry creates the embedded registry.
    fast = python("runs", home=tmp_path / "a")
    slow = python("runs", home=tmp_path / "b", CKVAL_CLI_FAST_READ="0")
    assert fast.returncode == slow.returncode == 0, fast.stderr
    assert fast.stdout.splitlines()[:-1] == slow.stdout.splitlines()[:-1]
    assert (tmp_path / "a" / "registry.db").is_file()


def test_a_listing_never_writes_the_database(home):
    database = home / "registry.db"
    before = database.read_bytes()
    done = python("runs", home=home)
    assert done.returncode == 0, done.stderr
    assert database.read_bytes() == before


def test_the_fast_path_runs_the_catalogs_statements_as_generated():
    """registry/_fast_sql.py holds the catalog's queries compiled for SQLite: after a
    change to one of them, `python -m validation_service.registry._fast_sql_source`
    writes it again."""
    from validation_service.registry import _fast_sql, _fast_sql_source

    generated = _fast_sql_source.statements()
    checked_in = {name: getattr(_fast_sql, name, None) for name in generated}
    assert checked_in == generated
    assert "LIMIT ? OFFSET ?" in generated["KNOWN_RUN_NAMES"]
