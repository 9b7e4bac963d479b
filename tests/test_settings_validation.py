"""CKVAL_* settings: a bad value is one InvalidSettings naming the variable, never a
pydantic traceback, and never silently accepted."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from validation_service.cli import main
from validation_service.config import Settings, get_settings
from validation_service.errors import InvalidInput, InvalidSettings

BAD_SETTINGS = [
    ("CKVAL_LEASE_S", "-5", "CKVAL_LEASE_S must be a positive number of seconds, got -5"),
    ("CKVAL_LEASE_S", "0", "CKVAL_LEASE_S must be a positive number of seconds"),
    ("CKVAL_LEASE_S", "nan", "CKVAL_LEASE_S must be a positive number of seconds, got nan"),
    ("CKVAL_LEASE_S", "abc", "CKVAL_LEASE_S: input should be a valid number"),
    ("CKVAL_HEARTBEAT_S", "inf", "CKVAL_HEARTBEAT_S must be a number of seconds, 0 or more"),
    ("CKVAL_HEARTBEAT_S", "-1", "CKVAL_HEARTBEAT_S must be a number of seconds, 0 or more"),
    ("CKVAL_POLL_INTERVAL_S", "-1", "CKVAL_POLL_INTERVAL_S must be a positive number"),
    ("CKVAL_RETRY_BACKOFF_S", "nan", "CKVAL_RETRY_BACKOFF_S must be a number of seconds"),
    ("CKVAL_RETRY_BACKOFF_MAX_S", "-inf", "CKVAL_RETRY_BACKOFF_MAX_S must be a number"),
    ("CKVAL_DELIVERY_TIMEOUT_S", "0", "CKVAL_DELIVERY_TIMEOUT_S must be a positive number"),
    ("CKVAL_DEFAULT_POOL_SIZE", "-1", "CKVAL_DEFAULT_POOL_SIZE must be 0 (paused) or more"),
    ("CKVAL_POOLS", '{"CPU": -3}', "CKVAL_POOLS gives pool 'CPU' the size -3"),
    ("CKVAL_POOLS", "notjson", "CKVAL_POOLS must be a JSON object"),
    ("CKVAL_STORAGE_OPTIONS", "notjson", "CKVAL_STORAGE_OPTIONS must be a JSON object"),
    ("CKVAL_STORAGE_OPTIONS", "[1, 2]", "CKVAL_STORAGE_OPTIONS must be a JSON object"),
    ("CKVAL_HTTP_PORT", "70000", "CKVAL_HTTP_PORT must be a TCP port from 0 to 65535"),
]


@pytest.mark.parametrize(("variable", "value", "message"), BAD_SETTINGS)
def test_a_bad_variable_is_one_error_naming_it(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(InvalidSettings) as raised:
        get_settings()
    text = str(raised.value)
    assert message in text
    assert "pydantic" not in text and "validation error" not in text and "\n" not in text
    assert isinstance(raised.value, InvalidInput)


def test_every_bad_variable_is_listed_and_good_values_are_read(monkeypatch):
    monkeypatch.setenv("CKVAL_LEASE_S", "-5")
    monkeypatch.setenv("CKVAL_DEFAULT_POOL_SIZE", "-2")
    monkeypatch.setenv("CKVAL_POOLS", '{"A10G": 2}')
    monkeypatch.setenv("CKVAL_STORAGE_OPTIONS", '{"anon": true}')
    with pytest.raises(InvalidSettings) as raised:
        Settings()
    text = str(raised.value)
    assert "CKVAL_LEASE_S must be" in text and "CKVAL_DEFAULT_POOL_SIZE must be" in text
    assert "CKVAL_POOLS" not in text and "CKVAL_STORAGE_OPTIONS" not in text

    monkeypatch.setenv("CKVAL_LEASE_S", "5")
    monkeypatch.setenv("CKVAL_DEFAULT_POOL_SIZE", "3")
    settings = get_settings()
    assert settings.lease_s == 5.0
    assert settings.pool_size("A10G") == 2 and settings.pool_size("CPU") == 3
    assert settings.storage_options == {"anon": True}


def test_an_argument_in_place_of_a_variable_is_named_too():
    with pytest.raises(InvalidSettings, match=r"poll_interval_s \(or CKVAL_POLL_INTERVAL_S\)"):
        get_settings(poll_interval_s=float("nan"))


def test_the_cli_prints_a_bad_setting_on_one_line():
    result = CliRunner().invoke(main, ["runs"], env={"CKVAL_STORAGE_OPTIONS": "notjson"})
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: Invalid setting: CKVAL_STORAGE_OPTIONS must be a JSON object")
