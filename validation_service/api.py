"""HTTP API (FastAPI) over the Registry and the running service: runs, checkpoints, jobs."""

from __future__ import annotations

import contextlib
import datetime as dt
import http
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

import ray
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from validation_service.config import Settings, get_settings
from validation_service.errors import (
    CkvalError,
    InvalidInput,
    JobNotFound,
    RunNotFound,
    UnknownMetric,
)
from validation_service.jobs import JobStatus
from validation_service.registry._engine import _encode_non_finite
from validation_service.registry.records import (
    AttemptRecord,
    CheckpointRecord,
    JobRecord,
    RunRecord,
)
from validation_service.registry.registry import Registry
from validation_service.service import ValidationService

logger = logging.getLogger(__name__)

# How long GET /service waits for the service actor to answer before giving up with a 503.
SERVICE_STATUS_TIMEOUT_S = 10.0

_ERROR_STATUS: dict[type[CkvalError], int] = {
    RunNotFound: 404,
    JobNotFound: 404,
    UnknownMetric: 404,
    InvalidInput: 422,
}


class NonFiniteJSONResponse(JSONResponse):
    """JSON with NaN and infinite metric values as the strings "NaN", "Infinity", "-Infinity".

    Plain JSON has no such numbers: FastAPI's encoder fails on them or turns them into null.
    """

    def render(self, content: Any) -> bytes:
        return json.dumps(
            _encode_non_finite(content),
            allow_nan=False,
            ensure_ascii=False,
            separators=(",", ":"),
            default=str,
        ).encode("utf-8")


def create_app(settings: Settings | None = None, registry: Registry | None = None) -> FastAPI:
    """The HTTP API over ``registry`` (else a Registry opened from ``settings``).

    A registry opened here is closed when the app shuts down; one passed in is left open.
    """
    if settings is None:
        settings = registry.settings if registry is not None else get_settings()
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
    _add_error_handlers(app)

    # Handlers are plain `def`: Registry and Ray calls block, so FastAPI runs them in
    # its thread pool instead of on the event loop.
    @app.get("/healthz")
    def healthz() -> JSONResponse:
        database = registry.engine.url.render_as_string(hide_password=True)
        try:
            revision = registry.schema_revision()
        except Exception as exc:  # the database is unreachable: report it, do not crash
            return _json(
                {"ok": False, "database": database, "error": f"{type(exc).__name__}: {exc}"},
                status_code=503,
            )
        return _json({"ok": True, "database": database, "schema_revision": revision})

    @app.get("/runs")
    def list_runs() -> JSONResponse:
        return _json([_run_json(run, registry.job_counts(run.name)) for run in registry.runs()])

    @app.get("/runs/{run}/checkpoints")
    def list_checkpoints(run: str) -> JSONResponse:
        return _json([_checkpoint_json(record) for record in registry.checkpoints(run)])

    @app.get("/runs/{run}/best")
    def best_of_run(
        run: str,
        metric: str = Query(..., description="Metric to rank by."),
        mode: Literal["max", "min"] = Query("max", description="Higher or lower is better."),
        k: int = Query(1, ge=1, description="How many checkpoints."),
    ) -> JSONResponse:
        records = registry.best_checkpoint_records(run, metric, mode, k)
        return _json([_checkpoint_json(record) for record in records])

    @app.get("/best")
    def best_of_namespace(
        metric: str = Query(..., description="Metric to rank by."),
        mode: Literal["max", "min"] = Query("max", description="Higher or lower is better."),
        k: int = Query(1, ge=1, description="How many checkpoints."),
    ) -> JSONResponse:
        records = registry.best_checkpoint_records(None, metric, mode, k)
        return _json([_checkpoint_json(record) for record in records])

    @app.get("/runs/{run}/validations")
    def list_validations(run: str) -> JSONResponse:
        return _json([_job_json(job) for job in registry.validations(run)])

    @app.get("/jobs/{job_id}")
    def get_job(job_id: int) -> JSONResponse:
        return _json(_job_json(registry.get_job(job_id)))

    @app.post("/jobs/{job_id}/cancel")
    def cancel_job(job_id: int) -> JSONResponse:
        registry.get_job(job_id)  # 404 for an unknown id rather than an empty answer
        cancelled = registry.cancel_jobs([job_id], reason="cancelled through the HTTP API")
        if cancelled:
            _tell_service(settings, "check_leases")
        return _json({"jobs": cancelled})

    @app.post("/runs/{run}/cancel")
    def cancel_run(run: str) -> JSONResponse:
        cancelled = registry.cancel_jobs(run=run, reason="cancelled through the HTTP API")
        if cancelled:
            _tell_service(settings, "check_leases")
        return _json({"jobs": cancelled})

    @app.post("/jobs/{job_id}/retry")
    def retry_job(job_id: int) -> JSONResponse:
        registry.get_job(job_id)
        requeued = registry.retry_jobs([job_id])
        if requeued:
            _tell_service(settings, "nudge")
        return _json({"jobs": requeued})

    @app.post("/runs/{run}/retry")
    def retry_run(run: str) -> JSONResponse:
        requeued = registry.retry_jobs(run=run)
        if requeued:
            _tell_service(settings, "nudge")
        return _json({"jobs": requeued})

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

    return app


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


def _tell_service(settings: Settings, what: str) -> None:
    """Wakes the running scheduler: a requeued job starts now, a cancelled one stops now.

    Best effort: the scheduler also polls the queue and heartbeats its leases.
    """
    if not ray.is_initialized():
        return
    try:
        handle = ValidationService.get(settings)
        if handle is not None:
            getattr(handle, what)()
    except Exception:
        logger.warning("could not reach the ckval service (%s)", what, exc_info=True)


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _run_json(run: RunRecord, job_counts: dict[str, int]) -> dict[str, Any]:
    return {
        "id": run.id,
        "name": run.name,
        "namespace": run.namespace,
        "status": run.status,
        "created_at": _iso(run.created_at),
        "storage_root": run.storage_root,
        "tags": run.tags,
        "jobs": {status.value: job_counts.get(status.value, 0) for status in JobStatus},
    }


def _checkpoint_json(record: CheckpointRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "run": record.run,
        "report_index": record.report_index,
        "step": record.step,
        "epoch": record.epoch,
        "uri": record.uri,
        "size_bytes": record.size_bytes,
        "manifest_sha256": record.manifest_sha256,
        "validation_status": record.validation_status,
        "metrics": record.metrics,
        "reported_metrics": record.reported_metrics,
        "validated_metrics": record.validated_metrics,
        "created_at": _iso(record.created_at),
    }


def _attempt_json(attempt: AttemptRecord) -> dict[str, Any]:
    return {
        "attempt": attempt.attempt,
        "status": attempt.status,
        "lease_owner": attempt.lease_owner,
        "node_id": attempt.node_id,
        "worker_pid": attempt.worker_pid,
        "claimed_at": _iso(attempt.claimed_at),
        "started_at": _iso(attempt.started_at),
        "finished_at": _iso(attempt.finished_at),
        "error": attempt.error_message,
    }


def _job_json(job: JobRecord) -> dict[str, Any]:
    return {
        "id": job.id,
        "run": job.run,
        "checkpoint_id": job.checkpoint_id,
        "report_index": job.report_index,
        "status": job.status,
        "attempt_count": job.attempts,
        "max_attempts": job.max_attempts,
        "priority": job.priority,
        "pool": job.pool,
        "resources": job.resources,
        "executor_kind": job.executor_kind,
        "validate_fn_name": job.validate_fn_name,
        "timeout_s": job.timeout_s,
        "not_before": _iso(job.not_before),
        "lease_owner": job.lease_owner,
        "lease_expires_at": _iso(job.lease_expires_at),
        "result_metrics": job.result_metrics,
        "error_type": job.error_type,
        "error_message": job.error_message,
        "error_traceback": job.error_traceback,
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
        "attempts": [_attempt_json(attempt) for attempt in job.attempt_history],
    }
