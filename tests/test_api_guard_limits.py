"""The API guard on its own, served any way: without a token it answers loopback
clients only, and a dashboard cookie stops working after its lifetime, server-side."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from validation_service.api import create_app
from validation_service.api import guard as api_guard
from validation_service.config import Settings
from validation_service.registry.registry import Registry

TOKEN = "t" * 32


@pytest.fixture
def registry(tmp_path):
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    yield registry
    registry.close()


@pytest.mark.parametrize("peer", ["203.0.113.7", "10.0.0.2", "2001:db8::1"])
def test_without_a_token_the_app_refuses_clients_beyond_loopback(registry, tmp_path, peer):
    app = create_app(Settings(home=tmp_path), registry)
    with TestClient(app, base_url="http://localhost", client=(peer, 4000)) as client:
        refused = client.get("/runs")
        health = client.get("/healthz")
    assert refused.status_code == 403, refused.text
    assert "CKVAL_API_TOKEN" in refused.json()["detail"]
    assert health.status_code == 200


@pytest.mark.parametrize("peer", ["127.0.0.1", "::1"])
def test_without_a_token_loopback_clients_are_served(registry, tmp_path, peer):
    app = create_app(Settings(home=tmp_path), registry)
    with TestClient(app, base_url="http://localhost", client=(peer, 4000)) as client:
        assert client.get("/runs").status_code == 200


def test_with_a_token_any_client_with_it_is_served(registry, tmp_path):
    app = create_app(Settings(home=tmp_path, api_token=TOKEN), registry)
    with TestClient(app, base_url="http://localhost", client=("203.0.113.7", 1)) as client:
        answer = client.get("/runs", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200


def test_the_dashboard_cookie_expires_server_side(registry, tmp_path, monkeypatch):
    app = create_app(Settings(home=tmp_path, api_token=TOKEN), registry)
    with TestClient(app, base_url="http://localhost", follow_redirects=False) as client:
        assert client.get(f"/ui/?token={TOKEN}").status_code == 303
        cookie = client.cookies.get(api_guard.TOKEN_COOKIE)
        assert cookie and TOKEN not in cookie
        assert client.get("/runs").status_code == 200

        later = time.time() + api_guard.TOKEN_COOKIE_MAX_AGE_S + 60
        monkeypatch.setattr(api_guard, "_now", lambda: later, raising=False)
        expired = client.get("/runs")  # the browser still sends it

    assert expired.status_code == 401, expired.text
    assert "cookie has expired" in expired.json()["detail"]


def test_a_cookie_of_another_token_is_refused(registry, tmp_path):
    old = create_app(Settings(home=tmp_path, api_token="o" * 32), registry)
    with TestClient(old, base_url="http://localhost", follow_redirects=False) as client:
        client.get(f"/ui/?token={'o' * 32}")
        cookie = client.cookies.get(api_guard.TOKEN_COOKIE)
    rotated = create_app(Settings(home=tmp_path, api_token=TOKEN), registry)
    with TestClient(rotated, base_url="http://localhost") as client:
        client.cookies.set(api_guard.TOKEN_COOKIE, cookie)
        assert client.get("/runs").status_code == 401
