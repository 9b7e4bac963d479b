"""Bad input is refused with a clear ckval error before anything is copied or written, and
the database's own refusals (DataError and the like) are raised at once, never retried."""

from __future__ import annotations

import json
import math
import os
import stat

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from ray.train import Checkpoint

import trainer_integration
from trainer_integration import CheckpointUploadMode, Client
from validation_service import retry, validation
from validation_service.cli import main
from validation_service.config import get_settings
from validation_service.errors import (
    InvalidInput,
    InvalidSettings,
    JobNotFound,
    RegistryRejected,
    RegistryUnavailable,
)
from validation_service.registry.models import Checkpoint as CheckpointRow
from validation_service.registry.models import ValidationJob
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest

REFUSED_URL = "postgresql+psycopg://postgres:s3cret@127.0.0.1:1/x"


def validate(checkpoint, config):
    return {"score": 1.0}


def make_checkpoint(tmp_path, name="ckpt") -> Checkpoint:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "weights.json").write_text(json.dumps({"w": 1}))
    return Checkpoint.from_directory(str(directory))


def stored_files(run: str) -> list[str]:
    """Every file that storage holds for the run (the default local storage)."""
    settings = get_settings()
    folder = os.path.join(settings.resolved_storage(), settings.namespace, run)
    return sorted(os.path.join(root, name) for root, _, names in os.walk(folder) for name in names)


def assert_nothing_written(client: Client, run: str) -> None:
    assert client.registry.checkpoints(run) == []
    assert client.registry.job_counts(run) == {}
    assert stored_files(run) == []


# ------------------------------------------------------------- report()
BAD_REPORTS = [
    ({"metrics": {"loss": 10**400}}, r"metrics 'loss' is an int of 1329 bits, too large"),
    ({"metrics": {"step": 2**70}}, r"metrics\['step'\] must be an int from"),
    ({"metrics": {"step": 1e30}}, r"metrics\['step'\] must be an int from"),
    ({"metrics": {"epoch": 2**40}}, r"metrics\['epoch'\] must be an int from"),
    ({"priority": 2**70}, r"priority must be an int from -2147483648 to 2147483647"),
    ({"max_attempts": 10**12}, r"max_attempts must be an int >= 1 \(at most 1000\)"),
    ({"timeout_s": float("nan")}, r"timeout_s must be a positive number of seconds"),
    ({"timeout_s": math.inf}, r"timeout_s must be a positive number of seconds"),
    ({"timeout_s": True}, r"timeout_s must be a positive number of seconds or None, got True"),
    ({"validation_resources": {"num_cpus": float("nan")}}, r"\['num_cpus'\] must be a number"),
    ({"validation_resources": {"num_gpus": math.inf}}, r"\['num_gpus'\] must be a number"),
    ({"validation_resources": {"memory": 10**400}}, r"\['memory'\] must be a number"),
    ({"validation_resources": "abc"}, r"validation_resources must be a dict"),
    (
        {"validation_resources": {"accelerator_type": "A" * 300}},
        r"\['accelerator_type'\] must be a non-empty str of at most 128 characters.*300 char",
    ),
    ({"validation_resources": {"accelerator_type": 7}}, r"\['accelerator_type'\] must be a"),
    ({"validation_resources": {"resources": "abc"}}, r"\['resources'\] must be a dict"),
    ({"validation_resources": {"resources": {"TPU": -1}}}, r"\['resources'\]\['TPU'\] must be"),
    ({"validation_resources": {"resources": {"GPU": 1}}}, r"names 'GPU'; use num_cpus, num_gpus"),
    ({"validate_fn": ".x:y"}, r"'.x:y' is not of the form 'package.module:function'"),
    ({"validate_fn": "json:"}, r"'json:' is not of the form 'package.module:function'"),
    ({"retry_on_timeout": "no"}, r"retry_on_timeout must be True or False, got 'no'"),
    ({"retry_on_timeout": 1}, r"retry_on_timeout must be True or False, got 1"),
]


@pytest.mark.parametrize("mode", [CheckpointUploadMode.SYNC, CheckpointUploadMode.ASYNC])
@pytest.mark.parametrize(("arguments", "message"), BAD_REPORTS)
def test_a_bad_report_is_refused_before_anything_is_copied_or_written(
    tmp_path, unique_run, mode, arguments, message
):
    client = Client(unique_run, start_service=False)
    options = {"validate_fn": validate, "checkpoint_upload_mode": mode, **arguments}
    metrics = options.pop("metrics", {"loss": 0.5})
    with pytest.raises(InvalidInput, match=message):
        client.report(metrics, make_checkpoint(tmp_path), **options)
    client.flush(timeout_s=60)
    assert_nothing_written(client, unique_run)
    assert (tmp_path / "ckpt" / "weights.json").exists()  # the reported folder is kept


def test_report_outside_ray_train_refuses_the_same_inputs(tmp_path, unique_run):
    client = trainer_integration.start_run(unique_run, start_service=False)
    with pytest.raises(InvalidInput, match=r"metrics\['step'\]"):
        trainer_integration.report({"step": 2**70}, make_checkpoint(tmp_path))
    with pytest.raises(InvalidInput, match=r"validation_resources\['num_cpus'\]"):
        trainer_integration.report(
            {"loss": 0.5},
            make_checkpoint(tmp_path, "second"),
            validate_fn=validate,
            validation_resources={"num_cpus": float("nan")},
        )
    assert_nothing_written(client, unique_run)


@pytest.mark.parametrize("checkpoint", ["/tmp", {"path": "/tmp"}, 7])
def test_a_checkpoint_that_is_no_checkpoint_is_refused_naming_what_to_pass(
    tmp_path, unique_run, checkpoint
):
    client = trainer_integration.start_run(unique_run, start_service=False)
    for report in (client.report, trainer_integration.report):
        with pytest.raises(InvalidInput, match="checkpoint must be a ray.train.Checkpoint") as e:
            report({"loss": 0.5}, checkpoint, validate_fn=validate)
        assert "Checkpoint.from_directory(path)" in str(e.value)
    assert_nothing_written(client, unique_run)


def test_an_int_metric_beyond_float_is_refused_but_non_finite_floats_are_stored(
    tmp_path, unique_run
):
    client = Client(unique_run, start_service=False)
    with pytest.raises(InvalidInput, match="metrics 'loss' is an int of 1329 bits"):
        client.report({"loss": -(10**400)}, make_checkpoint(tmp_path, "huge"))
    assert_nothing_written(client, unique_run)
    client.report({"loss": math.inf, "step": 3}, make_checkpoint(tmp_path))
    [record] = client.registry.checkpoints(unique_run)
    assert record.metrics == {"loss": math.inf, "step": 3} and record.step == 3
    assert client.registry.best_checkpoints(unique_run, "loss", "min") == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"priority": 2**31}, "priority must be an int from"),
        ({"max_attempts": 0}, "max_attempts must be an int >= 1"),
        ({"timeout_s": float("nan")}, "timeout_s must be a positive number"),
        ({"resources": {"num_gpus": -1}}, r"validation_resources\['num_gpus'\]"),
        ({"pool": "p" * 129}, "pool name must be a str of at most 128 characters"),
        ({"coalesce": "newest"}, "coalesce must be None or 'latest'"),
    ],
)
def test_a_validation_request_is_checked_where_it_is_made(fields, message):
    # Every front door (report, Client, Keras, Dask) builds one of these.
    with pytest.raises(InvalidInput, match=message):
        ValidationRequest(
            **{"executor_kind": "ray_task", "pool": "CPU", "validate_fn_name": "v", **fields}
        )


def test_the_limits_match_the_columns():
    jobs, checkpoints = ValidationJob.__table__.c, CheckpointRow.__table__.c
    assert jobs.pool.type.length == validation.MAX_POOL_NAME
    assert isinstance(checkpoints.step.type, sa.BigInteger)
    assert not isinstance(checkpoints.epoch.type, sa.BigInteger)  # 32 bits on PostgreSQL
    assert not isinstance(jobs.priority.type, sa.BigInteger)


# ---------------------------------------------------------------- registry
def test_register_checkpoint_refuses_a_step_beyond_64_bits(registry):
    run_id = registry.ledger.ensure_run("r", storage_root="/tmp")
    with pytest.raises(InvalidInput, match=r"step must be an int from"):
        registry.ledger.register_checkpoint(
            run_id, 0, uri="/tmp/c0", size_bytes=1, manifest_sha256=None,
            reported_metrics={}, step=2**70,
        )  # fmt: skip
    assert registry.checkpoints("r") == []


@pytest.mark.parametrize("k", [0, 10_001, 10**30, True])
def test_best_checkpoints_k_must_be_from_1_to_10000(registry, k):
    with pytest.raises(InvalidInput, match=r"k must be an int"):
        registry.best_checkpoints(None, "accuracy", k=k)


@pytest.mark.parametrize("job_id", [2**63, 10**23])
def test_a_job_id_out_of_range_is_no_job(registry, job_id):
    with pytest.raises(JobNotFound, match=f"No validation job with id {job_id}"):
        registry.get_job(job_id)
    assert registry.cancel_jobs([job_id]) == []
    assert registry.retry_jobs([job_id]) == []


def test_an_integrity_error_that_is_no_repeated_report_is_not_read_as_one(registry):
    # A run id that does not exist: a foreign key violation, not "registered before".
    with pytest.raises(RegistryRejected, match="is not retried"):
        registry.ledger.register_checkpoint(
            987654, 0, uri="/tmp/c0", size_bytes=1, manifest_sha256=None, reported_metrics={}
        )


# -------------------------------------------------------- database errors
def count_statement_errors(registry: Registry) -> list[BaseException]:
    errors: list[BaseException] = []
    sa.event.listen(
        registry.engine, "handle_error", lambda ctx: errors.append(ctx.original_exception)
    )
    return errors


def test_a_data_error_on_postgresql_is_raised_at_once_not_retried(postgres_server_url):
    registry = Registry(postgres_server_url, upgrade=True)
    run_id = registry.ledger.ensure_run("data-error", storage_root="/tmp")
    errors = count_statement_errors(registry)
    # manifest_sha256 is a String(64) column: PostgreSQL refuses 100 characters.
    with pytest.raises(RegistryRejected, match="StringDataRightTruncation") as raised:
        registry.ledger.register_checkpoint(
            run_id, 0, uri="/tmp/c0", size_bytes=1, manifest_sha256="f" * 100,
            reported_metrics={"loss": 0.5},
        )  # fmt: skip
    assert not isinstance(raised.value, RegistryUnavailable)
    assert len(errors) == 1  # one statement, no retry
    assert registry.checkpoints("data-error") == []
    registry.close()


def test_database_errors_are_classified_from_real_driver_errors(postgres_server_url):
    engine = sa.create_engine(postgres_server_url)

    def error_of(statement: str) -> sa.exc.DBAPIError:
        with pytest.raises(sa.exc.DBAPIError) as raised, engine.connect() as conn:
            conn.execute(sa.text(statement))
        return raised.value

    data_error = error_of("SELECT CAST('abcdef' AS varchar(2))::int")
    programming_error = error_of("SELECT * FROM no_such_table")
    assert isinstance(data_error, sa.exc.DataError)
    assert isinstance(programming_error, sa.exc.ProgrammingError)
    for permanent in (data_error, programming_error):
        assert not retry.is_transient_database_error(permanent)
        assert not retry.should_rerun(permanent)

    refused = sa.create_engine(REFUSED_URL)
    with pytest.raises(sa.exc.OperationalError) as raised, refused.connect():
        pass
    assert retry.is_transient_database_error(raised.value)
    assert retry.should_rerun(raised.value)

    serialization = serialization_failure(engine)
    assert serialization.orig.sqlstate == "40001"
    assert retry.is_transient_database_error(serialization)
    assert retry.should_rerun(serialization)
    engine.dispose()


def serialization_failure(engine: sa.Engine) -> sa.exc.DBAPIError:
    """Two SERIALIZABLE transactions that each read what the other writes."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE IF NOT EXISTS rw (k int)"))
    serializable = engine.execution_options(isolation_level="SERIALIZABLE")
    with serializable.connect() as first, serializable.connect() as second:
        first.execute(sa.text("SELECT count(*) FROM rw WHERE k = 1"))
        second.execute(sa.text("SELECT count(*) FROM rw WHERE k = 2"))
        first.execute(sa.text("INSERT INTO rw VALUES (2)"))
        second.execute(sa.text("INSERT INTO rw VALUES (1)"))
        first.commit()
        with pytest.raises(sa.exc.OperationalError) as raised:
            second.commit()
    return raised.value


def test_a_locked_sqlite_file_is_an_outage_but_not_rerun(tmp_path):
    url = f"sqlite:///{tmp_path / 'locked.db'}"
    Registry(url).close()
    holder = sa.create_engine(url, connect_args={"isolation_level": None})
    other = sa.create_engine(url, connect_args={"timeout": 0, "isolation_level": None})
    with holder.connect() as conn:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
        with pytest.raises(sa.exc.OperationalError) as raised, other.connect() as conn2:
            conn2.exec_driver_sql("BEGIN IMMEDIATE")
        conn.exec_driver_sql("ROLLBACK")
    assert retry.is_transient_database_error(raised.value)
    assert not retry.should_rerun(raised.value)


# ------------------------------------------------------------ database URL
@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("notaurl", "is not a database URL"),
        ("postgresql+psycopg://postgres:s3cret@127.0.0.1:abc/x", "is not a database URL"),
        ("postgresql+psycopg://postgres:s3cret@127.0.0.1:99999/x", "port 99999, which is not"),
        ("nosuchdialect://u:s3cret@h/x", "names a database ckval cannot open"),
    ],
)
def test_a_malformed_database_url_names_where_it_came_from(monkeypatch, url, message):
    with pytest.raises(InvalidInput, match=message) as raised:
        Registry(url)
    assert "the database_url argument" in str(raised.value)
    monkeypatch.setenv("CKVAL_DATABASE_URL", url)
    with pytest.raises(InvalidSettings, match=message) as raised:
        Registry()
    text = str(raised.value)
    assert text.startswith("CKVAL_DATABASE_URL ") and "s3cret" not in text and "\n" not in text


def test_a_refused_connection_at_open_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("CKVAL_DATABASE_URL", REFUSED_URL)
    with pytest.raises(RegistryUnavailable) as raised:
        Registry()
    text = str(raised.value)
    assert "postgresql+psycopg://postgres:***@127.0.0.1:1/x" in text
    assert "Connection refused" in text and "check CKVAL_DATABASE_URL" in text
    assert "s3cret" not in text and "\n" not in text


# --------------------------------------------------------------------- CLI
def run_cli(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, list(args), env=env)


def assert_one_line_error(result, *expected: str, exit_code: int = 2) -> None:
    assert result.exit_code == exit_code, result.output
    assert "Traceback" not in result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: ")
    for text in expected:
        assert text in line


def test_cli_huge_job_id_and_k_are_clear_errors(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    Registry(url).close()
    result = run_cli("--database-url", url, "job", "99999999999999999999999")
    assert_one_line_error(result, "No validation job with id 99999999999999999999999")
    result = run_cli("--database-url", url, "best", "--metric", "x", "-k", "1" + "0" * 30)
    assert_one_line_error(result, "k must be an int from 1 to 10000")


def test_cli_huge_report_index_unknown_jobs_and_revisions_are_one_line_errors(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    registry = Registry(url)
    run_id = registry.ledger.ensure_run("r", storage_root=str(tmp_path))
    registry.ledger.register_checkpoint(
        run_id, 0, uri=str(tmp_path / "c0"), size_bytes=1, manifest_sha256=None, reported_metrics={}
    )
    huge = "9" * 30
    for args, expected in [
        (["tag", "r", huge, "k", "v"], f"run 'r' has no checkpoint with report index {huge}"),
        (["alias", "r", "a", huge], f"run 'r' has no checkpoint with report index {huge}"),
        (["cancel", huge], f"No validation job with id {huge}"),
        (["retry", huge], f"No validation job with id {huge}"),
        (["cancel", "7"], "No validation job with id 7"),
        (
            ["db", "upgrade", "--revision", "bogus"],
            "Cannot migrate the registry to revision 'bogus'",
        ),
        (["db", "downgrade", "nonexistent", "--yes"], "revision 'nonexistent'"),
    ]:
        assert_one_line_error(run_cli("--database-url", url, *args), expected)
    assert registry.schema_revision() is not None and registry.checkpoints("r")[0].tags == {}
    registry.close()


@pytest.mark.parametrize(
    ("url", "expected", "exit_code"),
    [
        ("notaurl", "CKVAL_DATABASE_URL is not a database URL", 2),  # the user's input
        (REFUSED_URL, "unavailable (OperationalError: connection failed", 1),  # an outage
    ],
)
def test_cli_bad_or_unreachable_database_is_one_line(url, expected, exit_code):
    result = run_cli("runs", env={"CKVAL_DATABASE_URL": url})
    assert_one_line_error(result, expected, "CKVAL_DATABASE_URL", exit_code=exit_code)
    assert "s3cret" not in result.output


def test_db_downgrade_asks_and_refuses_without_a_terminal(tmp_path):
    url = f"sqlite:///{tmp_path / 'downgrade.db'}"
    registry = Registry(url)
    head = registry.schema_revision()
    registry.ledger.ensure_run("kept", storage_root=str(tmp_path))

    refused = run_cli("--database-url", url, "db", "downgrade", "base")
    assert refused.exit_code == 2
    assert "drops every table" in refused.output and "--yes" in refused.output
    assert registry.schema_revision() == head
    assert [run.name for run in registry.runs()] == ["kept"]

    done = run_cli("--database-url", url, "db", "downgrade", "base", "--yes")
    assert done.exit_code == 0, done.output
    assert registry.schema_revision() is None
    assert "runs" not in sa.inspect(registry.engine).get_table_names()
    registry.close()


# ----------------------------------------------------- SQLite permissions
def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_sqlite_registry_and_its_folder_are_owner_only(tmp_path):
    home = tmp_path / "home" / "ckval"
    registry = Registry(f"sqlite:///{home / 'registry.db'}")
    registry.ledger.ensure_run("private", storage_root=str(tmp_path))
    with registry.db.read() as session:  # the -wal and -shm files are open meanwhile
        session.execute(sa.text("SELECT 1"))
        side_files = sorted(p.name for p in home.iterdir())
        modes = {name: mode_of(home / name) for name in side_files}
    registry.close()
    assert {"registry.db", "registry.db-wal", "registry.db-shm"} <= set(side_files)
    assert set(modes.values()) == {0o600}, modes
    assert mode_of(home) == 0o700 and mode_of(home.parent) == 0o700


@pytest.mark.parametrize("existing_mode", [0o600, 0o640])
def test_a_new_registry_file_is_owner_only_and_an_existing_one_keeps_its_mode(
    tmp_path, existing_mode
):
    path = tmp_path / "registry.db"
    Registry(f"sqlite:///{path}").close()
    assert mode_of(path) == 0o600
    os.chmod(path, existing_mode)
    registry = Registry(f"sqlite:///{path}")
    registry.ledger.ensure_run("again", storage_root=str(tmp_path))
    registry.close()
    assert mode_of(path) == existing_mode


def test_a_registry_rejection_crosses_processes_intact():
    # Ray Train workers raise these in the driver: they are pickled on the way.
    import pickle

    error = RegistryRejected("sqlite:///x.db", ValueError("value too long"))
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is RegistryRejected and str(copy) == str(error)
