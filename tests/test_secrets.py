"""Secrets are never shown: masked URLs everywhere, settings_json() without secrets, and
nothing secret in Ray's runtime_env (what Ray's state API and dashboard show)."""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import ray
import sqlalchemy as sa
from fastapi.testclient import TestClient

from validation_service.config import Settings, ckval_env
from validation_service.errors import InvalidSettings
from validation_service.registry.registry import Registry
from validation_service.secrets import WITHHELD_VAR, has_secret, mask_url, public_settings
from validation_service.service import ValidationService

PASSWORD = "pw-" + uuid.uuid4().hex[:12]
KEY = "key-" + uuid.uuid4().hex[:12]
STORAGE_SECRET = "storage-" + uuid.uuid4().hex[:12]
TRACKER_SECRET = "tracker-" + uuid.uuid4().hex[:12]
SECRETS = (PASSWORD, KEY, STORAGE_SECRET, TRACKER_SECRET)


def with_password(url: str, form: str) -> str:
    """The URL with PASSWORD in it: as user:password@, or as ?password= (both reach the
    server: PostgreSQL's trust authentication ignores it)."""
    parsed = sa.engine.make_url(url)
    if form == "userinfo":
        return parsed.set(password=PASSWORD).render_as_string(hide_password=False)
    return parsed.update_query_dict({"password": PASSWORD}).render_as_string(hide_password=False)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://u:secret@db:5432/ckval", "postgresql+psycopg://u:***@db:5432/ckval"),
        (
            "postgresql+psycopg://u@db/ckval?password=secret&sslmode=require",
            "postgresql+psycopg://u@db/ckval?password=***&sslmode=require",
        ),
        (
            "postgresql+psycopg://u@db/ckval?sslpassword=secret&token=secret&passwd=secret",
            "postgresql+psycopg://u@db/ckval?sslpassword=***&token=***&passwd=***",
        ),
        (
            "s3://bucket/prefix?access_key=secret&aws_secret_access_key=secret&region=eu",
            "s3://bucket/prefix?access_key=***&aws_secret_access_key=***&region=eu",
        ),
        ("sqlite:////tmp/registry.db", "sqlite:////tmp/registry.db"),
        ("/tmp/checkpoints", "/tmp/checkpoints"),
    ],
)
def test_mask_url_hides_passwords_and_secret_query_parameters(url, shown):
    assert mask_url(url) == shown


def test_mask_url_takes_a_sqlalchemy_url():
    url = sa.engine.make_url(f"postgresql+psycopg://u:{PASSWORD}@db/x?password={PASSWORD}")
    assert mask_url(url) == "postgresql+psycopg://u:***@db/x?password=***"


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_registry_repr_and_healthz_mask_both_url_forms(postgres_server_url, form):
    url = with_password(postgres_server_url, form)
    registry = Registry(url, upgrade=True)
    try:
        assert PASSWORD not in repr(registry) and "***" in repr(registry)
        assert PASSWORD not in registry.display_url
        from validation_service.api import create_app

        with TestClient(create_app(registry=registry)) as client:
            response = client.get("/healthz")
        assert response.status_code == 200
        assert PASSWORD not in response.text
    finally:
        registry.close()


def test_public_settings_keep_no_secret():
    settings = Settings(
        database_url=f"postgresql+psycopg://ckval:{PASSWORD}@db/ckval?sslpassword={PASSWORD}",
        secret_key=KEY,
        secret_key_previous=KEY,
        storage="s3://bucket/ckval",
        storage_options={
            "key": STORAGE_SECRET,
            "secret": STORAGE_SECRET,
            "endpoint_url": "http://s3",
        },
    )
    shown = public_settings(settings).model_dump_json()
    for secret in (PASSWORD, KEY, STORAGE_SECRET):
        assert secret not in repr(settings)
    assert not any(secret in shown for secret in SECRETS)
    assert json.loads(shown)["storage_options"]["endpoint_url"] == "http://s3"


def test_ckval_env_withholds_every_secret(monkeypatch):
    monkeypatch.setenv("CKVAL_DATABASE_URL", f"postgresql+psycopg://u@db/x?password={PASSWORD}")
    monkeypatch.setenv("CKVAL_SECRET_KEY", KEY)
    monkeypatch.setenv("CKVAL_API_TOKEN", KEY)
    monkeypatch.setenv("CKVAL_STORAGE_OPTIONS", json.dumps({"secret": STORAGE_SECRET}))
    monkeypatch.setenv("CKVAL_POOLS", '{"CPU": 2}')

    env = ckval_env()

    assert not any(secret in value for value in env.values() for secret in SECRETS)
    assert env["CKVAL_POOLS"] == '{"CPU": 2}'
    assert env[WITHHELD_VAR].split(",") == [
        "CKVAL_API_TOKEN",
        "CKVAL_DATABASE_URL",
        "CKVAL_SECRET_KEY",
        "CKVAL_STORAGE_OPTIONS",
    ]
    assert ckval_env(include_secrets=True)["CKVAL_SECRET_KEY"] == KEY


def cluster_state(actor_name: str) -> list[bytes]:
    """Every actor, job and task record the GCS keeps, serialized: what Ray's state API
    (ray.util.state list_actors/list_jobs/list_tasks, runtime_env included) and the
    dashboard serve. Read from the GCS directly: the state API's HTTP server is part of
    the dashboard, which the test suite's Ray does not run."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    accessor = state._connect_and_get_accessor()
    actors = list(accessor.get_actor_table(None, None))
    names = {gcs_pb2.ActorTableData.FromString(record).name for record in actors}
    assert actor_name in names, f"the GCS does not list the service actor: {names}"
    jobs = accessor.get_job_table(
        skip_submission_job_info_field=True, skip_is_running_tasks_field=True
    )
    return [*actors, *jobs, *task_events_naming("settings_seen_by_a_worker")]


def task_events_naming(function_name: str, timeout_s: float = 60) -> list[bytes]:
    """Every task event the GCS keeps, once one names function_name. Workers send their task
    events to the GCS in batches (every second, later on a busy machine), so the test task's
    own event may arrive after its result."""
    from ray._private.state import state

    deadline = time.monotonic() + timeout_s
    while True:
        tasks = [event.SerializeToString() for event in state._get_all_task_events()]
        if any(function_name.encode() in task for task in tasks):
            return tasks
        assert time.monotonic() < deadline, f"no task event names {function_name}"
        time.sleep(0.5)


@ray.remote(num_cpus=0)
def settings_seen_by_a_worker() -> dict:
    """What trainer_integration resolves in a Ray worker started with ckval_env()."""
    from trainer_integration._service_link import resolve_settings

    settings = resolve_settings()
    return {
        "database_url": settings.database_url,
        "secret_key": getattr(settings, "secret_key", None),
    }


@pytest.fixture
def secret_service(postgres_server_url, ray_session, monkeypatch):
    """A service of its own, configured from the environment with a password in its
    database URL, a signing key and storage credentials (as a driver would be)."""
    url = with_password(postgres_server_url, "userinfo")
    Registry(url, upgrade=True).close()
    name = f"ckval-secrets-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("CKVAL_DATABASE_URL", url)
    monkeypatch.setenv("CKVAL_SECRET_KEY", KEY)
    monkeypatch.setenv("CKVAL_SERVICE_NAME", name)
    connection = f"AccountName=a;AccountKey={STORAGE_SECRET};"
    monkeypatch.setenv(
        "CKVAL_STORAGE_OPTIONS",
        json.dumps({"secret": STORAGE_SECRET, "connection_string": connection}),
    )
    # The JSON form of a list of URLs, a password in one of them.
    monkeypatch.setenv(
        "CKVAL_MLFLOW_ALLOWED_URIS", json.dumps([f"https://alice:{TRACKER_SECRET}@m.example"])
    )
    handle = ValidationService.start(settings=Settings())
    yield handle, url
    handle.stop()


def test_no_secret_reaches_ray_state_and_workers_still_get_them(secret_service):
    handle, url = secret_service
    env = ckval_env()
    seen = ray.get(settings_seen_by_a_worker.options(runtime_env={"env_vars": env}).remote())
    for record in cluster_state(handle.settings.service_name):
        assert not any(secret.encode() in record for secret in SECRETS)

    # The worker lacked the withheld variables and got them from the service actor.
    assert seen == {"database_url": url, "secret_key": KEY}
    public = json.loads(ray.get(handle.actor.settings_json.remote()))
    assert public["secret_key"] is None and PASSWORD not in public["database_url"]
    assert public["storage_options"] == {"secret": "***", "connection_string": "***"}
    assert public["mlflow_allowed_uris"] == ["https://alice:***@m.example"]
    status = handle.status()
    assert not any(secret in json.dumps(status, default=str) for secret in SECRETS)
    for log in runtime_env_logs():  # Ray's runtime_env agent logs each runtime_env
        text = log.read_text(errors="replace")
        assert not any(secret in text for secret in SECRETS), log


def test_a_worker_without_the_withheld_secrets_and_no_service_fails_clearly(ray_session):
    env = {
        "CKVAL_SERVICE_NAME": f"no-such-service-{uuid.uuid4().hex[:6]}",
        WITHHELD_VAR: "CKVAL_DATABASE_URL",
    }
    with pytest.raises(ray.exceptions.RayTaskError, match="did not get CKVAL_DATABASE_URL"):
        ray.get(settings_seen_by_a_worker.options(runtime_env={"env_vars": env}).remote())


def test_a_service_for_another_database_is_named_without_passwords(service, postgres_server_url):
    for form in ("userinfo", "query"):
        with pytest.raises(RuntimeError, match="already runs") as raised:
            ValidationService.start(database_url=with_password(postgres_server_url, form))
        assert PASSWORD not in str(raised.value) and "***" in str(raised.value)


# ------------------------------------------- passwords with '/', '#' and '?' in them
# Generated passwords often hold a raw '/'; SQLAlchemy takes '#' and '?' raw as well.
AWKWARD_PASSWORDS = ["Pa/ss", "p#w", "a?b"]


@pytest.mark.parametrize("password", AWKWARD_PASSWORDS)
def test_mask_url_masks_the_password_sqlalchemy_reads(password):
    url = f"postgresql+psycopg://u:{password}@db:5432/ckval?sslmode=require"
    assert sa.engine.make_url(url).password == password
    assert mask_url(url) == "postgresql+psycopg://u:***@db:5432/ckval?sslmode=require"
    assert has_secret(url)


def test_a_secret_query_value_with_a_hash_is_masked_whole():
    url = "postgresql+psycopg://u@db/ckval?password=ab#cd&sslmode=require"
    assert sa.engine.make_url(url).query["password"] == "ab#cd"
    assert mask_url(url) == "postgresql+psycopg://u@db/ckval?password=***&sslmode=require"


def test_ckval_env_withholds_awkward_passwords_sinks_and_storage_credentials(monkeypatch):
    for name in [n for n in os.environ if n.startswith("CKVAL_") and n != "CKVAL_HOME"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CKVAL_DATABASE_URL", "postgresql+psycopg://u:Pa/ss@db/x")
    monkeypatch.setenv(
        "CKVAL_SINKS", json.dumps([{"kind": "mlflow", "tracking_uri": "https://u:p#w@mlflow"}])
    )
    monkeypatch.setenv(
        "CKVAL_STORAGE_OPTIONS", json.dumps({"client_kwargs": {"endpoint_url": "http://u:a?b@s3"}})
    )
    monkeypatch.setenv("CKVAL_POOLS", '{"CPU": 2}')

    env = ckval_env()

    assert not any(p in value for value in env.values() for p in AWKWARD_PASSWORDS), env
    assert env[WITHHELD_VAR].split(",") == [
        "CKVAL_DATABASE_URL",
        "CKVAL_SINKS",
        "CKVAL_STORAGE_OPTIONS",
    ]
    assert env["CKVAL_POOLS"] == '{"CPU": 2}'


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CKVAL_STORAGE_OPTIONS", '{"key": "S3CRET", '),  # no JSON
        ("CKVAL_STORAGE_OPTIONS", '["S3CRET"]'),  # JSON, no object
        ("CKVAL_SINKS", '[{"kind": "mlflow", "tracking_uri": "http://u:S3CRET@h"'),
        ("CKVAL_SINKS", '[["S3CRET"]]'),
        ("CKVAL_SINKS", '[{"tracking_uri": "http://u:S3CRET@h"}]'),
    ],
)
def test_a_bad_storage_options_or_sinks_value_is_never_echoed(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(InvalidSettings, match=variable) as raised:
        Settings()
    assert "S3CRET" not in str(raised.value)


def test_repr_and_public_settings_show_no_sink_or_storage_credential():
    settings = Settings(
        sinks=[{"kind": "mlflow", "tracking_uri": "https://u:p#w@mlflow.example"}],
        storage_options={"client_kwargs": {"endpoint_url": "http://u:a?b@s3"}},
    )
    shown = public_settings(settings).model_dump_json()
    for text in (repr(settings), shown):
        assert not any(p in text for p in AWKWARD_PASSWORDS), text
    assert json.loads(shown)["sinks"] == [
        {"kind": "mlflow", "tracking_uri": "https://u:***@mlflow.example"}
    ]


def runtime_env_logs() -> list[Path]:
    """The runtime_env agent's logs of the session's Ray (it logs each runtime_env)."""
    base = Path(os.environ.get("RAY_TMPDIR", tempfile.gettempdir())) / "ray" / "session_latest"
    logs = sorted((base / "logs").glob("runtime_env*"))
    assert logs, f"no runtime_env logs under {base}"
    return logs


@pytest.fixture(params=AWKWARD_PASSWORDS)
def awkward_service(request, postgres_server_url, ray_session, monkeypatch):
    """A service configured from the environment, as a driver is, whose database URL
    holds an awkward password raw (PostgreSQL's trust authentication ignores it)."""
    password = f"{request.param}-{uuid.uuid4().hex[:8]}"
    server = sa.engine.make_url(postgres_server_url)
    url = (
        f"{server.drivername}://{server.username}:{password}@{server.host}:{server.port}/"
        f"{server.database}"
    )
    assert sa.engine.make_url(url).password == password
    Registry(url, upgrade=True).close()
    monkeypatch.setenv("CKVAL_DATABASE_URL", url)
    monkeypatch.setenv("CKVAL_SERVICE_NAME", f"ckval-awkward-{uuid.uuid4().hex[:6]}")
    monkeypatch.setenv(
        "CKVAL_SINKS", json.dumps([{"kind": "mlflow", "tracking_uri": f"http://u:{password}@m"}])
    )
    handle = ValidationService.start(settings=Settings())
    yield handle, url, password
    handle.stop()


def test_an_awkward_password_never_reaches_ray_and_workers_still_get_it(awkward_service):
    handle, url, password = awkward_service
    env = ckval_env()
    assert not any(password in value for value in env.values())
    seen = ray.get(settings_seen_by_a_worker.options(runtime_env={"env_vars": env}).remote())

    # The actor's runtime_env (and every job and task record) as Ray's state API serves it.
    for record in cluster_state(handle.settings.service_name):
        assert password.encode() not in record
    for log in runtime_env_logs():
        assert password not in log.read_text(errors="replace"), log
    assert seen["database_url"] == url  # from the service actor, not from runtime_env
    status = json.dumps(handle.status(), default=str)
    public = ray.get(handle.actor.settings_json.remote())
    assert password not in status and password not in public
    assert "***" in json.loads(public)["database_url"]
