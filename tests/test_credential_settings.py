"""Every setting that can hold a credential is withheld from Ray's runtime_env in every
form it accepts and masked wherever settings are shown; secret-looking names follow one
documented rule (secrets.is_secret_name), and stored URLs lose their user info whole."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from validation_service.config import Settings, ckval_env
from validation_service.secrets import (
    CREDENTIAL_FIELDS,
    SECRET_FIELDS,
    WITHHELD_VAR,
    is_secret_name,
    mask_value,
    public_settings,
    without_credentials,
)

PW = "pw-" + uuid.uuid4().hex[:10]
KEY = "key-" + uuid.uuid4().hex[:10]
CONNECTION = f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={KEY};"


@pytest.fixture
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("CKVAL_") and n != "CKVAL_HOME"]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize(
    "name",
    [
        "password", "db_password", "PGPASSWORD", "passwd", "pwd", "passphrase",
        "ssh_passphrase", "secret", "client_secret", "aws_secret_access_key", "token",
        "access_token", "X-Auth-Token", "sessionToken", "sas_token", "key", "api_key",
        "apiKey", "x-api-key", "X-API-KEY", "account_key", "AccountKey", "private_key",
        "credentials", "Authorization", "proxy-authorization", "auth", "connection_string",
        "connectionString", "conn_str", "cookie", "signature", "dsn",
    ],
)  # fmt: skip
def test_secret_looking_names_are_found_by_the_rule(name):
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    ["endpoint_url", "region_name", "kind", "tracking_uri", "experiment_name", "anon",
     "use_ssl", "client_kwargs", "project", "entity", "bucket", "monkey", "keyword"],
)  # fmt: skip
def test_plain_names_are_not_secret(name):
    assert not is_secret_name(name)


@pytest.mark.parametrize(
    ("url", "stored"),
    [
        ("https://TOKEN@host/path", "https://host/path"),
        ("https://alice:PW@host:5000/", "https://host:5000/"),
        ("https://TOKEN@host?token=t&experiment=1", "https://host?experiment=1"),
        ("http://a@b@host/x", "http://host/x"),
        ("postgresql+psycopg://u:Pa/ss@db/x", "postgresql+psycopg://db/x"),
        ("file:///tmp/mlruns", "file:///tmp/mlruns"),
    ],
)
def test_without_credentials_strips_user_info_whole(url, stored):
    assert without_credentials(url) == stored


def test_every_setting_is_classified_as_holding_credentials_or_not():
    """A new setting must be put in CREDENTIAL_FIELDS (or SECRET_FIELDS) or here."""
    plain = {
        "home", "ray_address", "namespace", "service_name", "ray_namespace", "replicas",
        "pools", "default_pool_size", "lease_s", "heartbeat_s", "poll_interval_s",
        "retry_backoff_s", "retry_backoff_max_s", "keep_warm", "delivery_timeout_s",
        "http_host", "http_port", "allowed_modules", "sink_attempts", "sink_backoff_s",
        "append", "api_hosts", "max_manual_retries", "mlflow_allowed_experiments",
        "wandb_allowed_entities", "shard_conflicts", "allowed_commands",
        "max_queued_evaluations", "watch_interval_s", "watch_settle_s", "resource_wait_s",
        "node_types",
    }  # fmt: skip
    classified = plain | set(CREDENTIAL_FIELDS) | set(SECRET_FIELDS)
    assert sorted(set(Settings.model_fields) - classified) == []


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CKVAL_MLFLOW_ALLOWED_URIS", json.dumps([f"https://alice:{PW}@mlflow.example"])),
        ("CKVAL_MLFLOW_ALLOWED_URIS", f"https://h1.example,https://alice:{PW}@h2.example"),
        ("CKVAL_MLFLOW_ALLOWED_URIS", f"https://{PW}@mlflow.example"),
        ("CKVAL_STORAGE_OPTIONS", json.dumps({"connection_string": CONNECTION})),
        ("CKVAL_STORAGE_OPTIONS", json.dumps({"client_kwargs": {"conn": CONNECTION}})),
        ("CKVAL_STORAGE_OPTIONS", json.dumps({"headers": {"Authorization": f"Bearer {PW}"}})),
        ("CKVAL_STORAGE_OPTIONS", json.dumps({"passphrase": PW})),
        ("CKVAL_SINKS", json.dumps([{"kind": "mlflow", "tracking_uri": f"https://{PW}@m"}])),
        ("CKVAL_STORAGE", f"https://{PW}@files.example/ckval"),
    ],
    ids=[
        "allowed-uris-json", "allowed-uris-commas", "allowed-uris-token-as-user",
        "connection-string", "connection-string-nested", "authorization-header",
        "passphrase", "sink-token-as-user", "storage-token-as-user",
    ],
)  # fmt: skip
def test_ckval_env_withholds_credentials_in_every_form(clean_env, variable, value):
    clean_env.setenv(variable, value)
    clean_env.setenv("CKVAL_POOLS", '{"CPU": 2}')

    env = ckval_env()

    assert not any(PW in v or KEY in v for v in env.values()), env
    assert env[WITHHELD_VAR].split(",") == [variable]
    assert env["CKVAL_POOLS"] == '{"CPU": 2}'
    assert ckval_env(include_secrets=True)[variable] == value


def test_public_settings_mask_every_credential_bearing_setting(clean_env):
    clean_env.setenv("CKVAL_MLFLOW_ALLOWED_URIS", json.dumps([f"https://alice:{PW}@m.example"]))
    clean_env.setenv(
        "CKVAL_STORAGE_OPTIONS",
        json.dumps({"connection_string": CONNECTION, "headers": {"x-api-key": KEY}}),
    )
    settings = Settings()

    shown = public_settings(settings).model_dump_json()

    assert PW not in shown and KEY not in shown, shown
    for text in (repr(settings), str(settings)):
        assert PW not in text and KEY not in text
    assert json.loads(shown)["mlflow_allowed_uris"] == ["https://alice:***@m.example"]


def test_a_connection_string_value_is_masked_under_any_name():
    masked = mask_value({"conn": CONNECTION})
    assert KEY not in json.dumps(masked)
    assert "AccountName=acct" in masked["conn"]
