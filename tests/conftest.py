"""Shared fixtures: one Ray instance per session, real SQLite and PostgreSQL registries."""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

# The session's CKVAL_HOME is set before anything reads settings or starts Ray, so Ray
# workers and the service actor inherit it.
_SESSION_HOME = Path(tempfile.mkdtemp(prefix="ckval-tests-"))
os.environ["CKVAL_HOME"] = str(_SESSION_HOME)
os.environ.pop("CKVAL_DATABASE_URL", None)
os.environ.pop("CKVAL_STORAGE", None)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray Train's controller looks at its workers every 2 s: every report of a Ray Train run
# waits for such a look, and so does the end of each run. No test measures Ray's timing,
# so the session's runs (and the scripts it starts) are looked at every 0.1 s.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
# A new local Ray starts a worker process per logical CPU for its first driver (each one
# importing Ray, about a second of CPU): on 2 cores, a test's own Ray (an example, a
# benchmark, a cluster of several nodes) would spend its first seconds on workers it may
# never use. Workers start when a task or an actor needs one.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# Every test ends with the cluster idle: a service keeping workers warm would start them
# again after each one. The test of that feature starts a service of its own.
os.environ["CKVAL_KEEP_WARM"] = "0"

POSTGRES_URL = os.environ.get(
    "CKVAL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@pytest.fixture(scope="session")
def session_home() -> Path:
    return _SESSION_HOME


@pytest.fixture(scope="session")
def ray_session(session_home):
    """One local Ray for the whole session, with more logical CPUs than cores."""
    import ray

    from validation_service.config import ckval_env

    ray.init(
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ckval_env()},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def service(ray_session):
    from validation_service.config import get_settings
    from validation_service.service import ValidationService

    handle = ValidationService.start(settings=get_settings())
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def postgres_server_url():
    """A fresh PostgreSQL database for this session, dropped at the end.

    Skips only when no server answers, and never in CI (CI=true fails instead).
    """
    import sqlalchemy as sa

    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text("select 1"))
    except sa.exc.OperationalError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL at {POSTGRES_URL} is required in CI: {exc}")
        pytest.skip(f"no PostgreSQL server at {POSTGRES_URL}")
    name = f"ckval_test_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.engine.make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    yield url
    with admin.connect() as conn:
        conn.execute(
            sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"),
            {"d": name},
        )
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def registry(request, tmp_path):
    """A migrated, empty registry on SQLite and on PostgreSQL."""
    from validation_service.registry.registry import Registry

    if request.param == "sqlite":
        reg = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
        yield reg
        reg.close()
        return
    url = request.getfixturevalue("postgres_server_url")
    reg = Registry(url, upgrade=True)
    with reg.engine.begin() as conn:
        # Each test starts from an empty queue (the database lives for the session).
        conn.exec_driver_sql(
            "TRUNCATE runs, checkpoints, metric_values, validation_jobs, validation_attempts, "
            "checkpoint_aliases, tracked_aliases, checkpoint_tags, retention_policies, "
            "stop_policies, stop_decisions, service_replicas, watches, watched_folders "
            "RESTART IDENTITY CASCADE"
        )
    yield reg
    reg.close()


@pytest.fixture
def unique_run(request) -> str:
    return f"{request.node.name[:40]}-{uuid.uuid4().hex[:6]}".replace("[", "-").replace("]", "")


@pytest.fixture(autouse=True)
def no_started_run_outlives_its_test():
    """start_run() names this process's run until its Client closes; a test that leaves its
    Client open must not hand that run to the next test's report() or callbacks, nor keep
    a should_stop() watcher reading a registry that is gone."""
    yield
    started = sys.modules.get("trainer_integration._client")
    if started is not None:
        started._current_run = None
    stopping = sys.modules.get("trainer_integration._stopping")
    if stopping is not None:  # nor should a should_stop() watcher of its run
        for run in list(stopping._watchers):
            stopping.forget(run)
