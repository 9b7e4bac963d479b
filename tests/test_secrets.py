"""Secrets are never shown: masked URLs everywhere, settings_json() without secrets, and
nothing secret in Ray's runtime_env (what Ray's state API and dashboard show)."""

from __future__ import annotations

import json
import uuid

import pytest
import ray
import sqlalchemy as sa
from fastapi.testclient import TestClient

from validation_service.config import Settings, ckval_env
from validation_service.registry.registry import Registry
from validation_service.secrets import WITHHELD_VAR, mask_url, public_settings
from validation_service.service import ValidationService

PASSWORD = "pw-" + uuid.uuid4().hex[:12]
KEY = "key-" + uuid.uuid4().hex[:12]
STORAGE_SECRET = "storage-" + uuid.uuid4().hex[:12]
SECRETS = (PASSWORD, KEY, STORAGE_SECRET)


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
    tasks = [event.SerializeToString() for event in state._get_all_task_events()]
    assert any(b"settings_seen_by_a_worker" in task for task in tasks)
    return [*actors, *jobs, *tasks]


@ray.remote(num_cpus=0)
def settings_seen_by_a_worker() -> dict:
    """What trainer_integration resolves in a Ray worker started with ckval_env()."""
    from trainer_integration._reporter import resolve_settings

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
    monkeypatch.setenv("CKVAL_STORAGE_OPTIONS", json.dumps({"secret": STORAGE_SECRET}))
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
    assert public["storage_options"] == {"secret": "***"}
    status = handle.status()
    assert not any(secret in json.dumps(status, default=str) for secret in SECRETS)


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
