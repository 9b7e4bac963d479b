"""HTTP API (FastAPI) over the Registry and the running service: runs, checkpoints, jobs.

Access control is one ASGI middleware around the whole app (guard.ApiGuard): it covers
every HTTP and WebSocket route, also those added after ``create_app`` returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http
import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import ray
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from validation_service.api.dashboard import dashboard_router, metrics_router
from validation_service.api.dashboard.router import docs_router

# Re-exported: the guard's names were first defined here.
from validation_service.api.guard import (  # noqa: F401
    MIN_TOKEN_LENGTH,
    PUBLIC_PATHS,
    SECURITY_HEADERS,
    TOKEN_COOKIE,
    UI_PREFIX,
    ApiGuard,
    allowed_hosts,
    check_bind,
    checked_api_token,
)
from validation_service.api.views import checkpoint_json, job_json, run_json, tell_service
from validation_service.config import Settings, get_settings
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

logger = logging.getLogger(__name__)

# How long GET /service waits for the service actor to answer before giving up with a 503.
SERVICE_STATUS_TIMEOUT_S = 10.0

# Largest k of a best-k request, and largest id: ids are 64-bit signed integers in the
# database, and a larger number would reach the driver and fail there (a 500).
MAX_K = 10_000
MAX_ID = 2**63 - 1

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
    validator: str = Query("default", description="Rank by this named evaluation's values.")

    def best(self, registry: Registry, run: str | None) -> list[dict[str, Any]]:
        records = registry.best_checkpoint_records(
            run, self.metric, self.mode, self.k, validator=self.validator
        )
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
        # FastAPI's /docs and /redoc load their scripts from a CDN: ours come from the package.
        docs_url=None,
        redoc_url=None,
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
    from validation_service.api.registry import registry_router

    app.include_router(registry_router(registry, settings))
    # The dashboard and /metrics read through the registry's reader, and nothing else.
    app.include_router(dashboard_router(registry.dashboard, settings))
    app.include_router(metrics_router(registry.dashboard, settings))
    app.include_router(docs_router())
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
        problem = tell_service(settings, what) if jobs else None
        if problem:
            logger.warning("could not tell the ckval service (%s): %s", what, problem)
        return _json({"jobs": jobs})

    def cancel(job_ids: list[int] | None = None, run: str | None = None) -> JSONResponse:
        jobs = registry.cancel_jobs(job_ids, run=run, reason="cancelled through the HTTP API")
        return changed(jobs, "check_leases")

    def retry(job_ids: list[int] | None = None, run: str | None = None) -> JSONResponse:
        jobs = registry.retry_jobs(job_ids, run=run, max_retries=settings.max_manual_retries)
        return changed(jobs, "nudge")

    def of_namespace(job_id: int) -> list[int]:
        # 404 for an id that is unknown or of another namespace, rather than an empty answer.
        return [registry.get_job(job_id, namespace=settings.namespace).id]

    @app.post("/jobs/{job_id}/cancel")
    def cancel_job(job_id: JobId) -> JSONResponse:
        return cancel(of_namespace(job_id))

    @app.post("/jobs/{job_id}/retry")
    def retry_job(job_id: JobId) -> JSONResponse:
        return retry(of_namespace(job_id))

    @app.post("/runs/{run}/cancel")
    def cancel_run(run: str) -> JSONResponse:
        return cancel(run=run)

    @app.post("/runs/{run}/retry")
    def retry_run(run: str) -> JSONResponse:
        return retry(run=run)


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
