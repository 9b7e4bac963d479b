"""HTTP API (FastAPI) over the Registry and the running service: runs, checkpoints, jobs.

Access control is one ASGI middleware, ``ApiGuard``, around the whole app: it checks the
Host header, the Bearer token (``CKVAL_API_TOKEN``), cross-site requests and the body type
of mutating requests before any route runs. Being app-wide, it covers every route on the
app, also those added after ``create_app`` returns (``@app.get``, ``app.include_router``,
``app.mount``): a later router needs nothing of its own. Only ``PUBLIC_PATHS`` are open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import http
import ipaddress
import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal
from urllib.parse import quote, urlencode, urlsplit

import ray
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from validation_service.config import Settings, get_settings
from validation_service.dashboard import dashboard_router, metrics_router
from validation_service.errors import (
    CkvalError,
    InvalidInput,
    JobNotFound,
    RetryLimitReached,
    RunNotFound,
    UnknownMetric,
)
from validation_service.metrics import encode_non_finite
from validation_service.registry.registry import Registry
from validation_service.service import ValidationService
from validation_service.views import checkpoint_json, job_json, run_json, tell_service

logger = logging.getLogger(__name__)

# How long GET /service waits for the service actor to answer before giving up with a 503.
SERVICE_STATUS_TIMEOUT_S = 10.0

# Largest k of a best-k request, and largest id: ids are 64-bit signed integers in the
# database, and a larger number would reach the driver and fail there (a 500).
MAX_K = 10_000
MAX_ID = 2**63 - 1

# Paths open without a token and from any Host: a liveness probe sends the pod's IP as
# Host, and /healthz tells nothing but ok / not ok.
PUBLIC_PATHS = frozenset({"/healthz"})
# GET <UI_PREFIX>...?token=T sets the TOKEN_COOKIE, so that a browser can open the dashboard.
UI_PREFIX = "/ui"
TOKEN_COOKIE = "ckval_token"
TOKEN_COOKIE_MAX_AGE_S = 12 * 3600
MIN_TOKEN_LENGTH = 16
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Bind addresses that mean "every interface": not a name a client sends as Host.
_WILDCARD_BIND = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_WWW_AUTHENTICATE = 'Bearer realm="ckval"'

_ERROR_STATUS: dict[type[CkvalError], int] = {
    RunNotFound: 404,
    JobNotFound: 404,
    UnknownMetric: 404,
    RetryLimitReached: 409,
    InvalidInput: 422,
}


class NonFiniteJSONResponse(JSONResponse):
    """JSON with NaN and infinite metric values as the strings "NaN", "Infinity", "-Infinity".

    Plain JSON has no such numbers: FastAPI's encoder fails on them or turns them into null.
    """

    def render(self, content: Any) -> bytes:
        return json.dumps(
            encode_non_finite(content),
            allow_nan=False,
            ensure_ascii=False,
            separators=(",", ":"),
            default=str,
        ).encode("utf-8")


@dataclasses.dataclass
class Ranking:
    """The query parameters of a best-k request."""

    metric: str = Query(..., description="Metric to rank by.")
    mode: Literal["max", "min"] = Query("max", description="Higher or lower is better.")
    k: int = Query(1, ge=1, le=MAX_K, description=f"How many checkpoints (at most {MAX_K}).")

    def best(self, registry: Registry, run: str | None) -> list[dict[str, Any]]:
        records = registry.best_checkpoint_records(run, self.metric, self.mode, self.k)
        return [checkpoint_json(record) for record in records]


def create_app(settings: Settings | None = None, registry: Registry | None = None) -> FastAPI:
    """The HTTP API over ``registry`` (else a Registry opened from ``settings``).

    A registry opened here is closed when the app shuts down; one passed in is left open.
    The API serves the runs and jobs of ``settings.namespace`` (a registry passed in must
    be of that namespace). Every route, also one added to the returned app later, needs
    ``Authorization: Bearer <settings.api_token>`` when a token is set; see ApiGuard.
    """
    if settings is None:
        settings = registry.settings if registry is not None else get_settings()
        if registry is not None:
            settings = settings.model_copy(update={"namespace": registry.namespace})
    if registry is not None and registry.namespace != settings.namespace:
        raise InvalidInput(
            f"The registry serves namespace {registry.namespace!r} but the API's settings "
            f"name namespace {settings.namespace!r}: open the Registry with "
            f"namespace={settings.namespace!r}, or set CKVAL_NAMESPACE to "
            f"{registry.namespace!r}."
        )
    token = checked_api_token(settings)
    owns_registry = registry is None
    if registry is None:
        registry = Registry(settings=settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_registry:
            registry.close()

    app = FastAPI(
        title="ckval",
        summary="Asynchronous checkpoint validation: runs, checkpoints, best-k, jobs.",
        default_response_class=NonFiniteJSONResponse,
        lifespan=lifespan,
    )
    app.state.registry = registry
    app.state.settings = settings
    app.add_middleware(ApiGuard, token=token, hosts=allowed_hosts(settings))
    _add_error_handlers(app)

    # Handlers are plain `def`: Registry and Ray calls block, so FastAPI runs them in
    # its thread pool instead of on the event loop.
    _add_query_routes(app, registry, settings)
    _add_job_routes(app, registry, settings)
    _add_service_route(app, settings)
    # Aliases, tags, search, retention (dry run) and run status.
    from validation_service.api_registry import registry_router

    app.include_router(registry_router(registry, settings))
    app.include_router(dashboard_router(registry, settings))
    app.include_router(metrics_router(registry, settings))
    return app


# A job id in a path: at most MAX_ID, so that a huge one is a 422, not a driver error.
JobId = Annotated[int, Path(ge=1, le=MAX_ID, description=f"A validation job's id (1 to {MAX_ID}).")]


def _add_query_routes(app: FastAPI, registry: Registry, settings: Settings) -> None:
    @app.get("/healthz")
    def healthz() -> JSONResponse:
        # Open to anyone (PUBLIC_PATHS): ok or not, nothing about the database or version.
        try:
            registry.schema_revision()
        except Exception as exc:  # the database is unreachable: report it, do not crash
            # The class only: a driver's message may carry the database URL.
            logger.warning("health check failed: %s", type(exc).__name__)
            return _json({"ok": False}, status_code=503)
        return _json({"ok": True})

    @app.get("/runs")
    def list_runs() -> JSONResponse:
        return _json([run_json(summary) for summary in registry.run_summaries()])

    @app.get("/runs/{run}/checkpoints")
    def list_checkpoints(run: str) -> JSONResponse:
        return _json([checkpoint_json(record) for record in registry.checkpoints(run)])

    @app.get("/runs/{run}/best")
    def best_of_run(run: str, ranking: Ranking = Depends()) -> JSONResponse:
        return _json(ranking.best(registry, run))

    @app.get("/best")
    def best_of_namespace(ranking: Ranking = Depends()) -> JSONResponse:
        return _json(ranking.best(registry, None))

    @app.get("/runs/{run}/validations")
    def list_validations(run: str) -> JSONResponse:
        return _json([job_json(job) for job in registry.validations(run)])

    @app.get("/jobs/{job_id}")
    def get_job(job_id: JobId) -> JSONResponse:
        return _json(job_json(registry.get_job(job_id, namespace=settings.namespace)))


def _add_job_routes(app: FastAPI, registry: Registry, settings: Settings) -> None:
    """Cancel and retry, by job or by run; the running service is told at once.

    A job of another namespace is a 404, like a missing one. A retry grants the job a
    fresh budget of max_attempts, but never beyond max_attempts x (1 +
    settings.max_manual_retries) attempts in all: a job that made them is a 409.
    """

    def changed(jobs: list[int], what: str) -> JSONResponse:
        if jobs:
            tell_service(settings, what)
        return _json({"jobs": jobs})

    def job_of_namespace(job_id: int) -> int:
        # 404 for an id that is unknown or of another namespace, rather than an empty answer.
        return registry.get_job(job_id, namespace=settings.namespace).id

    reason = "cancelled through the HTTP API"
    max_retries = settings.max_manual_retries

    @app.post("/jobs/{job_id}/cancel")
    def cancel_job(job_id: JobId) -> JSONResponse:
        job_ids = [job_of_namespace(job_id)]
        return changed(registry.cancel_jobs(job_ids, reason=reason), "check_leases")

    @app.post("/runs/{run}/cancel")
    def cancel_run(run: str) -> JSONResponse:
        return changed(registry.cancel_jobs(run=run, reason=reason), "check_leases")

    @app.post("/jobs/{job_id}/retry")
    def retry_job(job_id: JobId) -> JSONResponse:
        job_ids = [job_of_namespace(job_id)]
        return changed(registry.retry_jobs(job_ids, max_retries=max_retries), "nudge")

    @app.post("/runs/{run}/retry")
    def retry_run(run: str) -> JSONResponse:
        return changed(registry.retry_jobs(run=run, max_retries=max_retries), "nudge")


def _add_service_route(app: FastAPI, settings: Settings) -> None:
    @app.get("/service")
    def service_status() -> JSONResponse:
        # Never ray.init() from a request: an API without Ray must not start a local cluster.
        if not ray.is_initialized():
            return _error(
                503,
                "ServiceUnavailable",
                "Ray is not initialized in this API process, so the validation service "
                "cannot be reached. Serve the API with `ckval serve`, which connects to Ray "
                "and starts the service.",
            )
        handle = ValidationService.get(settings)
        if handle is None:
            return _error(
                503,
                "ServiceUnavailable",
                f"No ckval service named {settings.service_name!r} runs in Ray namespace "
                f"{settings.ray_namespace!r} of this Ray cluster. Start it with `ckval serve`.",
            )
        try:
            return _json(handle.status(timeout_s=SERVICE_STATUS_TIMEOUT_S))
        except Exception as exc:  # a dead or busy actor is unavailable, not a server error
            return _error(
                503,
                "ServiceUnavailable",
                f"The ckval service {settings.service_name!r} did not answer within "
                f"{SERVICE_STATUS_TIMEOUT_S:g}s: {type(exc).__name__}: {exc}",
            )


# ------------------------------------------------------------------ access control
def checked_api_token(settings: Settings) -> str | None:
    """The API token of ``settings`` (None when unset); InvalidInput when too short to guess."""
    if settings.api_token is None:
        return None
    token = settings.api_token.get_secret_value()
    if len(token) < MIN_TOKEN_LENGTH:
        raise InvalidInput(
            f"CKVAL_API_TOKEN has {len(token)} characters; use at least {MIN_TOKEN_LENGTH} "
            "random ones, e.g. the output of "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`."
        )
    return token


def allowed_hosts(settings: Settings) -> frozenset[str] | None:
    """The host names the API answers in the Host header (lower case); None: any."""
    if settings.api_hosts is None:
        hosts = set(LOOPBACK_HOSTS)
        if settings.http_host not in _WILDCARD_BIND:
            hosts.add(settings.http_host)
    else:
        hosts = set(settings.api_hosts)
    if "*" in hosts:
        return None
    return frozenset(_host_name(host) for host in hosts)


def check_bind(settings: Settings, host: str | None = None) -> None:
    """Refuses to serve the API on ``host`` (default ``settings.http_host``) when that
    reaches beyond this machine and no token guards it; also checks the token itself.

    ``ckval serve`` calls this before it starts anything.
    """
    host = settings.http_host if host is None else host
    if checked_api_token(settings) is not None or _is_loopback(host):
        return
    raise InvalidInput(
        f"Refusing to serve the HTTP API on {host!r} without a token: anyone who can reach "
        "that address could read every run and cancel or retry its validations. Set "
        "CKVAL_API_TOKEN to a long random secret (clients then send "
        "`Authorization: Bearer <token>`), or bind to 127.0.0.1 (--host / CKVAL_HTTP_HOST)."
    )


# Sent with every answer of a guarded route: no framing by another site (clickjacking of
# the dashboard's buttons), no MIME sniffing, and no URL (which may carry ?token=) in the
# Referer of links followed from a page.
SECURITY_HEADERS = (
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)


def _with_security_headers(send: Send) -> Send:
    async def send_with_headers(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
        await send(message)

    return send_with_headers


def _is_loopback(host: str) -> bool:
    name = _host_name(host)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a DNS name other than localhost may resolve anywhere


def _host_name(host: str) -> str:
    """The name in a Host header or address: without port and IPv6 brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        return host.partition(":")[0]
    return host


def _dashboard_cookie(token: str) -> str:
    # The cookie holds a value derived from the token, not the token: a leaked cookie is
    # not a Bearer token, and it stops working when the token is rotated.
    return hmac.new(token.encode(), b"ckval dashboard cookie", hashlib.sha256).hexdigest()


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


class ApiGuard:
    """ASGI middleware around the whole API: Host allow-list, token, CSRF, body type.

    In order, for every HTTP request but PUBLIC_PATHS:

    1. Host must be one of ``hosts`` (400): a page on another name that a DNS rebinding
       points at this server is refused.
    2. A mutating request (any method but GET, HEAD, OPTIONS) from another origin is
       refused (403): its Origin must match Host, and Sec-Fetch-Site, when a browser
       sends it, must say same-origin.
    3. With a ``token``: ``Authorization: Bearer <token>``, compared in constant time, else
       401 with ``WWW-Authenticate: Bearer``. A browser cannot send that header when it
       navigates, so ``GET /ui...?token=<token>`` sets an HttpOnly, SameSite=Strict cookie
       and redirects to the same URL without the token; the cookie then stands for the
       token on GET requests, and on a mutating one only together with an
       X-Requested-With header or a JSON body (see ``_cookie_may_mutate``).
    4. A mutating request has no body or a JSON one (415 otherwise): an HTML form can
       only send form or text bodies, so it cannot reach a route at all.
    """

    def __init__(self, app: ASGIApp, *, token: str | None, hosts: frozenset[str] | None):
        self.app = app
        self.token = token
        self.cookie = None if token is None else _dashboard_cookie(token)
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        conn = HTTPConnection(scope)
        refusal = self._refusal(conn)
        if refusal is not None:
            logger.info(
                "refused %s %s from %s: %s",
                scope["method"],
                scope["path"],
                conn.client.host if conn.client else "?",
                refusal.status_code,
            )
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, _with_security_headers(send))

    def _refusal(self, conn: HTTPConnection) -> Response | None:
        host = conn.headers.get("host", "")
        if self.hosts is not None and _host_name(host) not in self.hosts:
            return _error(
                400,
                "BadHost",
                f"Host {host!r} is not one this API answers to. Add it to CKVAL_API_HOSTS "
                "(comma-separated names, or * for any) on the server, or use one of: "
                f"{', '.join(sorted(self.hosts))}.",
            )
        mutating = conn.scope["method"] not in _SAFE_METHODS
        if mutating and not _same_origin(conn, host):
            return _error(
                403,
                "CrossSiteRequest",
                "A cross-site request may not change jobs: its Origin "
                f"({conn.headers.get('origin')!r}) or Sec-Fetch-Site "
                f"({conn.headers.get('sec-fetch-site')!r}) is not this API's own. Call the "
                "API from a script or the command line, not from another site's page.",
            )
        if self.token is not None:
            denied = self._authenticate(conn, mutating)
            if denied is not None:
                return denied
        if mutating:
            return _unsupported_body(conn)
        return None

    def _authenticate(self, conn: HTTPConnection, mutating: bool) -> Response | None:
        assert self.token is not None and self.cookie is not None
        scheme, _, credentials = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            if _same(credentials.strip(), self.token):
                return None
            return _unauthorized(
                "The Bearer token is not this API's token (CKVAL_API_TOKEN on the server).",
                invalid=True,
            )
        path = conn.scope["path"]
        on_ui = path == UI_PREFIX or path.startswith(UI_PREFIX + "/")
        if "token" in conn.query_params and on_ui and conn.scope["method"] == "GET":
            if _same(conn.query_params["token"], self.token):
                return self._cookie_redirect(conn)
            return _unauthorized("The token in the URL is not this API's token.", invalid=True)
        cookie = conn.cookies.get(TOKEN_COOKIE)
        if cookie is not None and _same(cookie, self.cookie):
            if not mutating or _cookie_may_mutate(conn):
                return None
            return _unauthorized(
                "The dashboard cookie alone does not allow changes: send the request with "
                "an X-Requested-With header or a JSON body, or with the Bearer token."
            )
        return _unauthorized(
            "This API needs `Authorization: Bearer <token>`, the token set as "
            "CKVAL_API_TOKEN on the server. In a browser, open "
            f"{UI_PREFIX}/?token=<token> once."
        )

    def _cookie_redirect(self, conn: HTTPConnection) -> Response:
        """Sets the dashboard cookie and sends the browser to the URL without the token,
        so that the token stays out of the address bar, history and Referer headers."""
        assert self.cookie is not None
        query = urlencode([(k, v) for k, v in conn.query_params.multi_items() if k != "token"])
        # A path, never a full URL: the redirect cannot lead off this site (the path
        # starts with UI_PREFIX, so it is not a "//host" URL either).
        location = quote(conn.scope["path"]) + (f"?{query}" if query else "")
        response = RedirectResponse(location, status_code=303)
        response.set_cookie(
            TOKEN_COOKIE,
            self.cookie,
            max_age=TOKEN_COOKIE_MAX_AGE_S,
            path="/",
            secure=conn.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        response.headers["Cache-Control"] = "no-store"
        response.headers["Referrer-Policy"] = "no-referrer"
        return response


def _cookie_may_mutate(conn: HTTPConnection) -> bool:
    """Whether a mutating request authenticated by the cookie alone came from our pages.

    Cookies ride along on requests that other pages make the browser send. SameSite=Strict
    stops cross-site ones, but not same-site ones (another port of this host, a sibling
    subdomain), and Origin is not sent by every client. A custom header or a JSON body
    cannot be sent cross-origin without a CORS preflight, which this API never answers
    with approval (it has no CORS middleware), so either one proves that a script of this
    origin sent the request: the dashboard's fetch() sends X-Requested-With.
    """
    return "x-requested-with" in conn.headers or _media_type(conn) == "application/json"


def _same_origin(conn: HTTPConnection, host: str) -> bool:
    """False when a browser says the request comes from another origin."""
    fetch_site = conn.headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        return False
    origin = conn.headers.get("origin")
    if origin is None:
        return True  # not sent by command-line clients; browsers send it on POST
    try:
        parts = urlsplit(origin)
        given_port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False  # "null": a sandboxed frame, a file:// page, a redirect chain
    default_port = 443 if parts.scheme == "https" else 80
    try:
        expected = urlsplit(f"//{host}")
        expected_port = expected.port
    except ValueError:
        return False
    # The scheme is not compared: behind a TLS-terminating proxy the page is https while
    # this server sees http; Host and port still tell the origin.
    return parts.hostname == (expected.hostname or "") and (given_port or default_port) == (
        expected_port or default_port
    )


def _media_type(conn: HTTPConnection) -> str | None:
    content_type = conn.headers.get("content-type")
    if content_type is None:
        return None
    return content_type.partition(";")[0].strip().lower()


def _unsupported_body(conn: HTTPConnection) -> Response | None:
    media_type = _media_type(conn)
    has_body = conn.headers.get("content-length", "0") != "0" or (
        "transfer-encoding" in conn.headers
    )
    if media_type == "application/json" or (media_type is None and not has_body):
        return None
    return _error(
        415,
        "UnsupportedMediaType",
        f"Content-Type {conn.headers.get('content-type')!r} is not accepted: send no body, "
        "or a JSON one with `Content-Type: application/json`.",
    )


def _unauthorized(detail: str, *, invalid: bool = False) -> Response:
    challenge = _WWW_AUTHENTICATE + (', error="invalid_token"' if invalid else "")
    return _error(401, "Unauthorized", detail, headers={"WWW-Authenticate": challenge})


def _add_error_handlers(app: FastAPI) -> None:
    async def ckval_error(_request: Request, exc: Exception) -> JSONResponse:
        status = next(
            (code for cls, code in _ERROR_STATUS.items() if isinstance(exc, cls)),
            400,
        )
        return _error(status, type(exc).__name__, str(exc))

    async def request_invalid(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        problems = "; ".join(_describe_validation_error(e) for e in exc.errors())
        return _error(422, InvalidInput.__name__, problems)

    async def http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        try:
            name = http.HTTPStatus(exc.status_code).phrase.replace(" ", "").replace("-", "")
        except ValueError:
            name = "HTTPError"
        return _error(exc.status_code, name, str(exc.detail), headers=exc.headers)

    app.add_exception_handler(CkvalError, ckval_error)
    app.add_exception_handler(RequestValidationError, request_invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)


def _describe_validation_error(error: dict[str, Any]) -> str:
    where = " ".join(str(part) for part in error.get("loc", ()))
    text = f"{where}: {error.get('msg', 'invalid')}"
    if error.get("type") != "missing":
        text += f" (got {error.get('input')!r})"
    return text


def _json(content: Any, status_code: int = 200) -> JSONResponse:
    # Returning the response itself skips FastAPI's own encoding, which would turn
    # NaN and infinity into null.
    return NonFiniteJSONResponse(content, status_code=status_code)


def _error(
    status_code: int, error: str, detail: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return NonFiniteJSONResponse(
        {"error": error, "detail": detail}, status_code=status_code, headers=headers
    )
