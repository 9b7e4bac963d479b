"""Access control of the HTTP API over a real SQLite registry: token, cookie, Host, CSRF,
body types, namespaces, the retry cap, out-of-range numbers and the bind check."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray
from click.testing import CliRunner
from fastapi import APIRouter, WebSocket
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from validation_service.api import (
    TOKEN_COOKIE,
    allowed_hosts,
    check_bind,
    create_app,
)
from validation_service.cli import main
from validation_service.config import Settings, ckval_env
from validation_service.errors import InvalidInput, RetryLimitReached
from validation_service.registry.records import JobOutcome, JobRecord
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest
from validation_service.retry import RetryPolicy

TOKEN = secrets.token_urlsafe(32)
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def _request(max_attempts: int = 3) -> ValidationRequest:
    return ValidationRequest(
        executor_kind="ray_task",
        pool="CPU",
        validate_fn_name="f",
        validate_fn_ref="json:dumps",
        max_attempts=max_attempts,
    )


def _report(registry: Registry, tmp_path: Path, run: str, max_attempts: int = 3) -> int:
    """One checkpoint of ``run`` with its QUEUED validation job; returns the job id."""
    run_id = registry.ledger.ensure_run(run, storage_root=str(tmp_path))
    index = registry.ledger.next_report_index(run_id)
    registration = registry.ledger.register_checkpoint(
        run_id,
        index,
        uri=f"{tmp_path}/{registry.namespace}/{run}/checkpoint_{index:06d}",
        size_bytes=1000,
        manifest_sha256=None,
        reported_metrics={"loss": 0.5},
        job=_request(max_attempts),
    )
    return registration.job_id


def _fail_due_jobs(registry: Registry) -> list[int]:
    """Claims every due job as a scheduler would and fails each attempt for good."""
    failed = []
    for claimed in registry.job_queue.claim_due_jobs("security-test", {"CPU": 100}, lease_s=60):
        outcome = JobOutcome(
            succeeded=False,
            error_type="ValueError",
            error_message="bad checkpoint",
            retryable=False,
        )
        assert registry.job_queue.finish_job(claimed.job_id, claimed.lease_token, outcome)
        failed.append(claimed.job_id)
    return failed


@dataclasses.dataclass
class World:
    """A registry with a QUEUED job in run "alpha" of namespace "default", a FAILED job in
    run "beta", and a QUEUED job of run "alpha" in namespace "other"."""

    registry: Registry
    other: Registry
    queued: int
    failed: int
    foreign: int
    client: Callable[..., TestClient]

    def status(self, job_id: int) -> str:
        return self.registry.get_job(job_id).status


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    url = f"sqlite:///{tmp_path}/r.db"
    registry = Registry(url)
    other = Registry(url, namespace="other")
    failed = _report(registry, tmp_path, "beta")
    assert _fail_due_jobs(registry) == [failed]
    queued = _report(registry, tmp_path, "alpha")
    foreign = _report(other, tmp_path, "alpha")
    clients: list[TestClient] = []

    def client(base_url: str = "http://localhost", **settings: object) -> TestClient:
        test_client = TestClient(
            create_app(Settings(**settings), registry),
            base_url=base_url,
            follow_redirects=False,
        )
        clients.append(test_client)
        return test_client

    yield World(registry, other, queued, failed, foreign, client)
    for test_client in clients:
        test_client.close()
    other.close()
    registry.close()


# ------------------------------------------------------------------------- token
def test_every_route_but_healthz_needs_the_token(world: World):
    client = world.client(api_token=TOKEN)
    for method, path in [
        ("get", "/runs"),
        ("get", "/runs/alpha/checkpoints"),
        ("get", "/runs/alpha/validations"),
        ("get", "/best?metric=loss"),
        ("get", f"/jobs/{world.queued}"),
        ("get", "/service"),
        ("get", "/openapi.json"),
        ("get", "/ui/"),
        ("get", "/no/such/route"),
        ("post", f"/jobs/{world.queued}/cancel"),
        ("post", "/runs/alpha/cancel"),
        ("post", f"/jobs/{world.failed}/retry"),
        ("post", "/runs/beta/retry"),
    ]:
        response = client.request(method, path)
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"].startswith("Bearer"), path
        body = response.json()
        assert body["error"] == "Unauthorized", path
        assert "CKVAL_API_TOKEN" in body["detail"], path
    assert world.status(world.queued) == "QUEUED"
    assert world.status(world.failed) == "FAILED"


def test_a_wrong_token_is_401(world: World):
    client = world.client(api_token=TOKEN)
    for headers in [
        {"Authorization": "Bearer not-the-token"},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
    ]:
        response = client.get("/runs", headers=headers)
        assert response.status_code == 401, headers
        assert response.headers["www-authenticate"].startswith("Bearer"), headers
    cancel = client.post(
        f"/jobs/{world.queued}/cancel", headers={"Authorization": "Bearer not-the-token"}
    )
    assert cancel.status_code == 401
    assert 'error="invalid_token"' in cancel.headers["www-authenticate"]
    assert world.status(world.queued) == "QUEUED"


def test_the_right_token_reads_and_changes(world: World):
    client = world.client(api_token=TOKEN)
    runs = client.get("/runs", headers=BEARER)
    assert runs.status_code == 200
    assert sorted(run["name"] for run in runs.json()) == ["alpha", "beta"]
    assert client.get(f"/jobs/{world.queued}", headers=BEARER).json()["status"] == "QUEUED"
    cancel = client.post(f"/jobs/{world.queued}/cancel", headers=BEARER)
    assert cancel.status_code == 200
    assert cancel.json() == {"jobs": [world.queued]}
    assert world.status(world.queued) == "CANCELLED"


def test_routes_added_after_create_app_need_the_token(world: World, tmp_path: Path):
    app = create_app(Settings(api_token=TOKEN), world.registry)
    router = APIRouter()

    @router.get("/extra/page")
    def page() -> dict[str, str]:
        return {"page": "extra"}

    app.include_router(router)

    @app.get("/extra/count")
    def count() -> dict[str, int]:
        return {"runs": len(world.registry.runs())}

    with TestClient(app, base_url="http://localhost") as client:
        # The dashboard and /metrics, included by create_app, and the routes added here.
        for path in ("/ui/", "/metrics", "/extra/page", "/extra/count"):
            assert client.get(path).status_code == 401, path
        assert client.get("/ui/", headers=BEARER).status_code == 200
        assert client.get("/metrics", headers=BEARER).status_code == 200
        assert client.get("/extra/page", headers=BEARER).json() == {"page": "extra"}
        assert client.get("/extra/count", headers=BEARER).json() == {"runs": 2}


def test_a_token_shorter_than_16_characters_is_refused(world: World):
    with pytest.raises(InvalidInput, match=r"CKVAL_API_TOKEN has 5 characters.*at least 16"):
        create_app(Settings(api_token="short"), world.registry)


# ------------------------------------------------------------------------ cookie
def test_token_in_a_dashboard_url_sets_a_cookie_valid_for_reads(world: World):
    client = world.client(api_token=TOKEN)
    response = client.get("/ui/runs/alpha", params={"token": TOKEN, "metric": "loss"})
    assert response.status_code == 303
    assert response.headers["location"] == "/ui/runs/alpha?metric=loss"
    set_cookie = response.headers["set-cookie"]
    assert set_cookie.startswith(f"{TOKEN_COOKIE}=")
    assert "HttpOnly" in set_cookie
    assert "SameSite=strict" in set_cookie
    assert "Path=/" in set_cookie
    cookie = response.cookies[TOKEN_COOKIE]
    assert TOKEN not in cookie  # the cookie is not the token itself
    client.cookies.clear()  # each request below names its credentials

    by_cookie = {"Cookie": f"{TOKEN_COOKIE}={cookie}"}
    runs = client.get("/runs", headers=by_cookie)
    assert runs.status_code == 200
    assert sorted(run["name"] for run in runs.json()) == ["alpha", "beta"]
    # The cookie is not a Bearer token, and a forged cookie is nothing.
    assert client.get("/runs", headers={"Authorization": f"Bearer {cookie}"}).status_code == 401
    assert client.get("/runs", headers={"Cookie": f"{TOKEN_COOKIE}=forged"}).status_code == 401


def test_the_cookie_alone_does_not_allow_changes(world: World):
    client = world.client(api_token=TOKEN)
    cookie = client.get("/ui/", params={"token": TOKEN}).cookies[TOKEN_COOKIE]
    client.cookies.clear()  # each request below names its credentials
    by_cookie = {"Cookie": f"{TOKEN_COOKIE}={cookie}"}

    refused = client.post(f"/jobs/{world.queued}/cancel", headers=by_cookie)
    assert refused.status_code == 401
    assert "X-Requested-With" in refused.json()["detail"]
    assert world.status(world.queued) == "QUEUED"

    # What the dashboard's own script sends: a header no other site can add.
    scripted = client.post(
        f"/jobs/{world.queued}/cancel", headers={**by_cookie, "X-Requested-With": "fetch"}
    )
    assert scripted.status_code == 200
    assert world.status(world.queued) == "CANCELLED"
    as_json = client.post(f"/jobs/{world.queued}/retry", headers=by_cookie, json={})
    assert as_json.status_code == 200
    assert world.status(world.queued) == "QUEUED"


def test_token_in_the_url_counts_only_for_a_dashboard_get(world: World):
    client = world.client(api_token=TOKEN)
    assert client.get("/runs", params={"token": TOKEN}).status_code == 401
    assert client.post(f"/jobs/{world.queued}/cancel", params={"token": TOKEN}).status_code == 401
    wrong = client.get("/ui/", params={"token": "not-the-token"})
    assert wrong.status_code == 401
    assert "set-cookie" not in wrong.headers
    assert world.status(world.queued) == "QUEUED"


# ----------------------------------------------------------------------- healthz
def test_healthz_is_open_and_says_only_ok(world: World):
    client = world.client(api_token=TOKEN)
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"ok": True}
    # A kubelet probe sends the pod's IP as Host.
    probe = client.get("/healthz", headers={"Host": "10.1.2.3:8780"})
    assert probe.status_code == 200
    assert probe.json() == {"ok": True}


def test_healthz_of_an_unreachable_database_shows_no_url(postgres_server_url):
    """The database URL has a password in its query string; PostgreSQL becomes unreachable
    (its connections cut): /healthz says only "not ok"."""
    import sqlalchemy as sa

    from tests.tcp_proxy import TcpProxy

    Registry(postgres_server_url, upgrade=True).close()
    url = sa.engine.make_url(postgres_server_url)
    proxy = TcpProxy(url.host, url.port or 5432)
    proxy.start()
    through_proxy = url.set(
        host="127.0.0.1", port=proxy.port, query={"password": "hunter2-in-query"}
    ).render_as_string(hide_password=False)
    registry = Registry(through_proxy)
    try:
        with TestClient(create_app(Settings(), registry), base_url="http://localhost") as client:
            ok = client.get("/healthz")
            assert (ok.status_code, ok.json()) == (200, {"ok": True})
            proxy.stop()
            down = client.get("/healthz")
            assert down.status_code == 503
            assert down.json() == {"ok": False}
            assert "hunter2" not in down.text and str(proxy.port) not in down.text
    finally:
        proxy.stop()
        registry.close()


# ------------------------------------------------------------- namespace scoping
def test_a_job_of_another_namespace_is_404_like_a_missing_one(world: World):
    client = world.client()
    for method, path in [
        ("get", f"/jobs/{world.foreign}"),
        ("post", f"/jobs/{world.foreign}/cancel"),
        ("post", f"/jobs/{world.foreign}/retry"),
    ]:
        response = client.request(method, path)
        assert response.status_code == 404, path
        body = response.json()
        assert body["error"] == "JobNotFound", path
        assert str(world.foreign) in body["detail"], path
    assert world.other.get_job(world.foreign).status == "QUEUED"

    # Cancelled in its own namespace, it is still not retried from "default".
    world.other.cancel_jobs([world.foreign])
    assert client.post(f"/jobs/{world.foreign}/retry").status_code == 404
    assert world.other.get_job(world.foreign).status == "CANCELLED"


def test_an_api_on_another_namespace_sees_only_its_jobs(world: World):
    app = create_app(Settings(namespace="other"), world.other)
    with TestClient(app, base_url="http://localhost") as client:
        assert client.get(f"/jobs/{world.foreign}").json()["status"] == "QUEUED"
        assert client.get(f"/jobs/{world.queued}").status_code == 404
        assert [run["name"] for run in client.get("/runs").json()] == ["alpha"]


def test_a_registry_of_another_namespace_than_the_settings_is_refused(world: World):
    with pytest.raises(InvalidInput, match=r"namespace 'other'.*namespace 'default'"):
        create_app(Settings(namespace="default"), world.other)


# ------------------------------------------------------------ body type and CSRF
def test_a_form_encoded_post_is_415(world: World):
    client = world.client()
    for kwargs in [
        {"data": {"confirm": "yes"}},  # what an HTML form posts
        {"headers": {"Content-Type": "application/x-www-form-urlencoded"}},  # an empty form
        {"content": b"confirm=yes", "headers": {"Content-Type": "text/plain"}},
        {"files": {"f": ("f.txt", b"x")}},  # multipart
        {"content": b"{}"},  # a body without a Content-Type
    ]:
        response = client.post("/runs/alpha/cancel", **kwargs)
        assert response.status_code == 415, kwargs
        body = response.json()
        assert body["error"] == "UnsupportedMediaType", kwargs
        assert "application/json" in body["detail"], kwargs
    assert world.status(world.queued) == "QUEUED"

    assert client.post("/runs/alpha/cancel", json={}).json() == {"jobs": [world.queued]}
    assert client.post("/runs/alpha/retry").json() == {"jobs": [world.queued]}


def test_a_cross_site_post_is_403(world: World):
    client = world.client()
    for headers in [
        {"Origin": "http://evil.example"},
        {"Origin": "http://localhost:3000"},  # another port of this host is another origin
        {"Origin": "null"},  # a sandboxed frame or a file:// page
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
    ]:
        for path in ("/runs/alpha/cancel", f"/jobs/{world.failed}/retry"):
            response = client.post(path, headers=headers)
            assert response.status_code == 403, (path, headers)
            assert response.json()["error"] == "CrossSiteRequest", (path, headers)
    # The form post of the original finding, with a token set: refused before the token.
    with_token = world.client(api_token=TOKEN)
    form = with_token.post(
        "/runs/alpha/cancel", data={"x": "1"}, headers={"Origin": "http://evil.example"}
    )
    assert form.status_code == 403
    assert world.status(world.queued) == "QUEUED"
    assert world.status(world.failed) == "FAILED"

    # The API's own origin is fine, also behind a proxy that terminates TLS.
    same = client.post(
        "/runs/alpha/cancel",
        headers={"Origin": "http://localhost", "Sec-Fetch-Site": "same-origin"},
    )
    assert same.json() == {"jobs": [world.queued]}
    proxied = world.client(base_url="http://api.example", api_hosts=["api.example"])
    assert (
        proxied.post("/runs/alpha/retry", headers={"Origin": "https://api.example"}).status_code
        == 200
    )
    assert world.status(world.queued) == "QUEUED"


def test_reads_from_another_origin_are_not_refused_as_cross_site(world: World):
    # A GET changes nothing; a browser page on another origin cannot read the answer
    # (no CORS headers), and the Host check still applies.
    response = world.client().get("/runs", headers={"Origin": "http://evil.example"})
    assert response.status_code == 200


# ------------------------------------------------------------------- Host header
def test_another_host_header_is_400_naming_the_setting(world: World):
    client = world.client()
    for host in ("evil.example", "evil.example:8780", "127.0.0.1.evil.example"):
        response = client.get("/runs", headers={"Host": host})
        assert response.status_code == 400, host
        body = response.json()
        assert body["error"] == "BadHost", host
        assert "CKVAL_API_HOSTS" in body["detail"] and repr(host) in body["detail"], host
    assert client.post("/runs/alpha/cancel", headers={"Host": "evil.example"}).status_code == 400
    assert world.status(world.queued) == "QUEUED"
    for host in ("localhost:8780", "127.0.0.1", "[::1]:8780", "LOCALHOST"):
        assert client.get("/runs", headers={"Host": host}).status_code == 200, host


def test_api_hosts_setting(world: World, monkeypatch: pytest.MonkeyPatch):
    named = world.client(api_hosts=["ckval.ml.svc"])
    assert named.get("/runs", headers={"Host": "ckval.ml.svc:8780"}).status_code == 200
    assert named.get("/runs", headers={"Host": "localhost"}).status_code == 400
    anyone = world.client(api_hosts=["*"])
    assert anyone.get("/runs", headers={"Host": "evil.example"}).status_code == 200

    # Default: loopback names and http_host unless it is a wildcard address.
    assert allowed_hosts(Settings(http_host="10.0.0.5")) == {
        "localhost",
        "127.0.0.1",
        "::1",
        "10.0.0.5",
    }
    assert allowed_hosts(Settings(http_host="0.0.0.0")) == {"localhost", "127.0.0.1", "::1"}

    monkeypatch.setenv("CKVAL_API_HOSTS", "ckval, ckval.ml.svc.cluster.local")
    assert Settings().api_hosts == ["ckval", "ckval.ml.svc.cluster.local"]
    monkeypatch.setenv("CKVAL_API_HOSTS", '["ckval", "Ckval.Example"]')
    assert allowed_hosts(Settings()) == {"ckval", "ckval.example"}
    monkeypatch.setenv("CKVAL_API_HOSTS", "*")
    assert allowed_hosts(Settings()) is None


# --------------------------------------------------------------------- retry cap
def test_retry_through_the_api_is_capped(tmp_path: Path):
    """max_attempts 1 and 2 retries: three attempts in all, then 409."""
    registry = Registry(f"sqlite:///{tmp_path}/cap.db")
    job_id = _report(registry, tmp_path, "capped", max_attempts=1)
    app = create_app(Settings(max_manual_retries=2), registry)
    with TestClient(app, base_url="http://localhost") as client:
        for retry in (1, 2):
            assert _fail_due_jobs(registry) == [job_id]
            response = client.post(f"/jobs/{job_id}/retry")
            assert response.json() == {"jobs": [job_id]}, retry
        assert _fail_due_jobs(registry) == [job_id]
        assert registry.get_job(job_id).attempts == 3

        refused = client.post(f"/jobs/{job_id}/retry")
        assert refused.status_code == 409
        body = refused.json()
        assert body["error"] == "RetryLimitReached"
        assert str(job_id) in body["detail"] and "CKVAL_MAX_MANUAL_RETRIES" in body["detail"]
        assert registry.get_job(job_id).status == "FAILED"
        # By run, too: nothing of the run can be retried.
        assert client.post("/runs/capped/retry").status_code == 409
        assert registry.get_job(job_id).status == "FAILED"
        assert registry.job_queue.claim_due_jobs("security-test", {"CPU": 100}, lease_s=60) == []

        # A run retry retries the jobs that have attempts left, and leaves the others.
        fresh = _report(registry, tmp_path, "capped", max_attempts=1)
        assert _fail_due_jobs(registry) == [fresh]
        assert client.post("/runs/capped/retry").json() == {"jobs": [fresh]}
        assert registry.get_job(job_id).status == "FAILED"
    registry.close()


def test_the_last_retry_grants_only_what_is_left(tmp_path: Path):
    """max_attempts 2 and 1 retry: four attempts in all, however they were spent."""
    registry = Registry(f"sqlite:///{tmp_path}/cap.db")
    job_id = _report(registry, tmp_path, "capped", max_attempts=2)
    no_backoff = RetryPolicy(backoff_s=0.0)
    lost = JobOutcome(succeeded=False, error_type="NodeLost", error_message="node lost")

    def attempt_fails_retryably() -> JobRecord:
        [claimed] = registry.job_queue.claim_due_jobs("security-test", {"CPU": 100}, lease_s=60)
        assert registry.job_queue.finish_job(job_id, claimed.lease_token, lost, policy=no_backoff)
        return registry.get_job(job_id)

    app = create_app(Settings(max_manual_retries=1), registry)
    with TestClient(app, base_url="http://localhost") as client:
        # Attempt 1 is cancelled while it runs; the retry grants attempts 2 and 3.
        registry.job_queue.claim_due_jobs("security-test", {"CPU": 100}, lease_s=60)
        assert client.post(f"/jobs/{job_id}/cancel").json() == {"jobs": [job_id]}
        assert client.post(f"/jobs/{job_id}/retry").json() == {"jobs": [job_id]}
        job = attempt_fails_retryably()
        assert (job.attempts, job.status) == (2, "QUEUED")
        job = attempt_fails_retryably()
        assert (job.attempts, job.status) == (3, "FAILED")  # the budget of 2 is spent

        # A second retry would grant 2 more; one is left of the four.
        assert client.post(f"/jobs/{job_id}/retry").json() == {"jobs": [job_id]}
        job = attempt_fails_retryably()
        assert (job.attempts, job.status) == (4, "FAILED")
        refused = client.post(f"/jobs/{job_id}/retry")
        assert refused.status_code == 409
        assert refused.json()["error"] == "RetryLimitReached"
    registry.close()


def test_the_registry_retries_without_a_cap_unless_asked(tmp_path: Path):
    # The operator's own tools (Registry.retry_jobs, `ckval retry`) keep the fresh budget.
    registry = Registry(f"sqlite:///{tmp_path}/uncapped.db")
    job_id = _report(registry, tmp_path, "uncapped", max_attempts=1)
    assert _fail_due_jobs(registry) == [job_id]
    for _ in range(5):
        assert registry.retry_jobs([job_id]) == [job_id]
        assert _fail_due_jobs(registry) == [job_id]
    assert registry.get_job(job_id).attempts == 6
    registry.close()


def test_the_registry_caps_retries_on_sqlite_and_postgresql(registry: Registry, tmp_path: Path):
    """The cap the API asks for, at the registry: max_attempts 2 and 1 retry."""
    job_id = _report(registry, tmp_path, "capped", max_attempts=2)
    registry.job_queue.claim_due_jobs("security-test", {"CPU": 100}, lease_s=60)
    registry.cancel_jobs([job_id])  # attempt 1 cancelled
    assert registry.retry_jobs([job_id], max_retries=1) == [job_id]  # grants 2 and 3
    assert _fail_due_jobs(registry) == [job_id]  # attempt 2 fails for good
    assert registry.retry_jobs([job_id], max_retries=1) == [job_id]  # 2 more: 3 and 4
    lost = JobOutcome(succeeded=False, error_type="NodeLost", error_message="node lost")
    for attempts, status in ((3, "QUEUED"), (4, "FAILED")):
        [claimed] = registry.job_queue.claim_due_jobs("security-test", {"CPU": 100}, lease_s=60)
        policy = RetryPolicy(backoff_s=0.0)
        assert registry.job_queue.finish_job(job_id, claimed.lease_token, lost, policy=policy)
        job = registry.get_job(job_id)
        assert (job.attempts, job.status) == (attempts, status)
    with pytest.raises(RetryLimitReached, match=rf"job\(s\) {job_id} "):
        registry.retry_jobs([job_id], max_retries=1)
    with pytest.raises(RetryLimitReached):
        registry.retry_jobs(run="capped", max_retries=1)
    assert registry.get_job(job_id).status == "FAILED"
    assert registry.retry_jobs([job_id], max_retries=2) == [job_id]  # a higher cap allows it


# ---------------------------------------------------------- out-of-range numbers
def test_huge_numbers_are_422(world: World):
    client = world.client()
    for k in (10**30, 10_001):
        for path in ("/runs/alpha/best", "/best"):
            response = client.get(path, params={"metric": "loss", "k": k})
            assert response.status_code == 422, (path, k)
            body = response.json()
            assert body["error"] == "InvalidInput"
            assert "k" in body["detail"] and "10000" in body["detail"]
    assert client.get("/best", params={"metric": "loss", "k": 10_000}).status_code == 200
    for job_id in (2**70, 2**63):
        for method, path in [
            ("get", f"/jobs/{job_id}"),
            ("post", f"/jobs/{job_id}/cancel"),
            ("post", f"/jobs/{job_id}/retry"),
        ]:
            response = client.request(method, path)
            assert response.status_code == 422, path
            assert "job_id" in response.json()["detail"], path
    assert client.get(f"/jobs/{2**63 - 1}").status_code == 404


def test_huge_report_indices_and_page_numbers_are_422_not_500(world: World):
    client = world.client()
    huge = 10**30
    for method, path, body, where in [
        ("put", f"/runs/alpha/checkpoints/{huge}/tags/k", {"value": "v"}, "report_index"),
        ("delete", f"/runs/alpha/checkpoints/{huge}/tags/k", None, "report_index"),
        ("put", f"/runs/alpha/checkpoints/{2**31}/tags/k", {"value": "v"}, "report_index"),
        ("put", "/runs/alpha/aliases/a", {"report_index": 1e25}, "report_index"),
        ("put", "/runs/alpha/aliases/a", {"report_index": 2**63}, "report_index"),
        ("get", f"/ui/?page={huge}", None, "page"),
        ("get", "/ui/api/runs?page=9223372036854775807&per_page=500", None, "page"),
    ]:
        response = client.request(method, path, json=body)
        assert response.status_code == 422, (path, response.text)
        assert response.json()["error"] == "InvalidInput" and where in response.json()["detail"]
    # Past the last page, within bounds: an empty page.
    response = client.get("/ui/api/runs", params={"page": 10**6, "per_page": 500})
    assert response.status_code == 200 and response.json()["runs"] == []


# ------------------------------------------------------------------- bind check
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "ckval.example.com", ""])
def test_check_bind_refuses_an_open_address_without_a_token(host: str):
    with pytest.raises(InvalidInput, match="CKVAL_API_TOKEN"):
        check_bind(Settings(), host)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost", "[::1]"])
def test_check_bind_accepts_loopback_without_a_token(host: str):
    assert check_bind(Settings(), host) is None


def test_check_bind_accepts_any_address_with_a_token():
    assert check_bind(Settings(api_token=TOKEN), "0.0.0.0") is None
    with pytest.raises(InvalidInput, match="at least 16"):
        check_bind(Settings(api_token="short"), "0.0.0.0")


def test_check_bind_reads_the_http_host_setting(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CKVAL_HTTP_HOST", "0.0.0.0")
    with pytest.raises(InvalidInput, match=r"'0\.0\.0\.0'.*CKVAL_API_TOKEN"):
        check_bind(Settings())
    monkeypatch.setenv("CKVAL_API_TOKEN", f"{TOKEN}\n")  # as read from a file
    assert Settings().api_token.get_secret_value() == TOKEN
    assert check_bind(Settings()) is None


def test_serve_refuses_an_open_address_before_starting_ray(tmp_path: Path):
    ray_was_running = ray.is_initialized()
    result = CliRunner().invoke(
        main,
        ["--database-url", f"sqlite:///{tmp_path}/serve.db", "serve", "--host", "0.0.0.0"],
        env={"CKVAL_API_TOKEN": None, "CKVAL_HTTP_HOST": None},
    )
    assert result.exit_code == 2, result.output
    assert "CKVAL_API_TOKEN" in result.output
    assert "'0.0.0.0'" in result.output
    assert ray.is_initialized() == ray_was_running
    assert not (tmp_path / "serve.db").exists()  # nothing was opened either


# ---------------------------------------------------------- the token stays here
def test_the_token_is_not_handed_on_to_ray(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CKVAL_API_TOKEN", TOKEN)
    monkeypatch.setenv("CKVAL_NAMESPACE", "ns-for-ray")
    settings = Settings()
    assert settings.api_token is not None
    assert ckval_env()["CKVAL_NAMESPACE"] == "ns-for-ray"
    assert "CKVAL_API_TOKEN" not in ckval_env()
    # The service actor gets the settings as JSON; the token is not in it, nor in a repr.
    assert TOKEN not in settings.model_dump_json()
    assert TOKEN not in repr(settings)


def test_guarded_answers_forbid_framing_sniffing_and_referers(world: World):
    app = create_app(Settings(api_token=TOKEN), world.registry)
    with TestClient(app, base_url="http://localhost") as client:
        for path in ("/ui/", "/runs", "/metrics"):
            headers = client.get(path, headers=BEARER).headers
            assert headers["x-frame-options"] == "DENY", path
            assert headers["x-content-type-options"] == "nosniff", path
            assert headers["referrer-policy"] == "no-referrer", path


def test_answers_carry_a_content_security_policy_of_this_origin_only(world: World):
    app = create_app(Settings(api_token=TOKEN), world.registry)
    with TestClient(app, base_url="http://localhost") as client:
        for path in ("/ui/", "/ui/runs/alpha", "/runs", "/metrics", "/docs", "/openapi.json"):
            policy = client.get(path, headers=BEARER).headers["content-security-policy"]
            directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
            assert directives["default-src"] == "'none'", path
            assert directives["script-src"] == "'self'", path
            assert directives["frame-ancestors"] == "'none'", path
            assert "http" not in policy and "unsafe" not in policy, path


def test_docs_are_served_from_the_package_and_name_no_outside_address(world: World):
    client = world.client()
    docs = client.get("/docs")
    assert docs.status_code == 200
    for address in ("http://", "https://", "cdn", "swagger-ui"):
        assert address not in docs.text, address
    script = client.get("/ui/static/api-docs.js")
    assert script.status_code == 200 and "openapi" in script.text
    assert "http://" not in script.text.replace("http://www.w3.org", "")
    assert client.get("/redoc").status_code == 404
    assert "/runs/{run}/checkpoints" in client.get("/openapi.json").json()["paths"]


def test_websocket_routes_added_after_create_app_need_the_token(world: World):
    # Starlette's test client opens WebSockets on the host "testserver".
    app = create_app(Settings(api_token=TOKEN, api_hosts=["testserver"]), world.registry)

    @app.websocket("/extra/feed")
    async def feed(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text(f"{len(world.registry.runs())} runs")
        await websocket.close()

    with TestClient(app) as client:
        for headers in ({}, {"Authorization": "Bearer wrong-token-of-16-chars"}):
            with pytest.raises(WebSocketDisconnect) as refused:
                with client.websocket_connect("/extra/feed", headers=headers) as socket:
                    socket.receive_text()
            assert refused.value.code == 1008
        # The cookie of a page on another site does not open it either.
        cookie = client.get("/ui/", params={"token": TOKEN}, follow_redirects=False).cookies
        client.cookies.clear()
        cross_site = {
            "Cookie": f"{TOKEN_COOKIE}={cookie[TOKEN_COOKIE]}",
            "Origin": "http://evil.example",
        }
        with pytest.raises(WebSocketDisconnect):
            with client.websocket_connect("/extra/feed", headers=cross_site) as socket:
                socket.receive_text()
        with client.websocket_connect("/extra/feed", headers=BEARER) as socket:
            assert socket.receive_text() == "2 runs"
        same_site = {**cross_site, "Origin": "http://testserver"}
        with client.websocket_connect("/extra/feed", headers=same_site) as socket:
            assert socket.receive_text() == "2 runs"
