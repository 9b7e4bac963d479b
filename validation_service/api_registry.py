"""HTTP routes over the registry's aliases, tags, search, retention (dry run) and run status.

``create_app`` includes ``registry_router(registry, settings)``. Errors come back as the
rest of the API's do: ``{"error": <class>, "detail": <message>}`` with 404 for what does
not exist and 400/422 for requests that cannot be acted on.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response
from pydantic import BaseModel

from validation_service.config import Settings
from validation_service.errors import (
    AliasNotFound,
    CkvalError,
    InvalidInput,
    InvalidSearch,
    JobNotFound,
    RunNotFound,
    UnknownMetric,
)
from validation_service.metrics import encode_non_finite
from validation_service.registry.records import CheckpointRecord, RunRecord
from validation_service.registry.registry import Registry

_STATUS = {
    RunNotFound: 404,
    AliasNotFound: 404,
    JobNotFound: 404,
    UnknownMetric: 404,
    InvalidInput: 422,
    InvalidSearch: 400,
}


class AliasTarget(BaseModel):
    """Where an alias goes: one checkpoint, or the best by a metric (tracked)."""

    report_index: int | None = None
    track_metric: str | None = None
    mode: Literal["max", "min"] = "max"


class TagValue(BaseModel):
    value: str


class RunEnd(BaseModel):
    status: Literal["FINISHED", "FAILED"]


def _json(content: Any, status_code: int = 200) -> Response:
    # NaN and infinite metric values as the strings "NaN", "Infinity" (plain JSON has none).
    body = json.dumps(encode_non_finite(content), allow_nan=False, default=str)
    return Response(body, status_code=status_code, media_type="application/json")


def _answers_errors(route: Callable[..., Any]) -> Callable[..., Any]:
    """A ckval error becomes the API's error body, whichever app includes the router."""

    @functools.wraps(route)
    def wrapper(*args, **kwargs):
        try:
            return route(*args, **kwargs)
        except CkvalError as exc:
            status = next((code for cls, code in _STATUS.items() if isinstance(exc, cls)), 400)
            return _json({"error": type(exc).__name__, "detail": str(exc)}, status)

    return wrapper


def record_json(record: CheckpointRecord) -> dict[str, Any]:
    from validation_service.cli_registry import record_json as as_json

    return as_json(record)


def attempt_json(run: RunRecord) -> dict[str, Any]:
    return {
        "run": run.name,
        "attempt": run.attempt,
        "status": run.status,
        "created_at": run.created_at.isoformat(),
        "ended_at": run.ended_at.isoformat() if run.ended_at else None,
    }


def registry_router(registry: Registry, settings: Settings) -> APIRouter:
    """Routes: /runs/{run}/aliases..., /runs/{run}/checkpoints/{i}/tags/{key}, /search,
    /retention (dry run: what would be deleted), /runs/{run}/status and /runs/{run}/finish."""
    router = APIRouter()
    _alias_routes(router, registry)
    _tag_routes(router, registry)
    _query_routes(router, registry)
    _run_status_routes(router, registry)
    return router


def _alias_routes(router: APIRouter, registry: Registry) -> None:
    @router.get("/runs/{run}/aliases")
    @_answers_errors
    def list_aliases(run: str) -> Response:
        return _json(registry.aliases(run))

    @router.get("/runs/{run}/aliases/{alias}")
    @_answers_errors
    def get_alias(run: str, alias: str) -> Response:
        return _json(record_json(registry.get_alias_record(run, alias)))

    @router.put("/runs/{run}/aliases/{alias}")
    @_answers_errors
    def put_alias(run: str, alias: str, target: AliasTarget) -> Response:
        if (target.report_index is None) == (target.track_metric is None):
            raise InvalidInput("give either report_index or track_metric (with mode)")
        if target.track_metric is not None:
            index = registry.track_alias(run, alias, target.track_metric, target.mode)
        else:
            registry.set_alias(run, alias, target.report_index)
            index = target.report_index
        return _json({"run": run, "alias": alias, "report_index": index})

    @router.delete("/runs/{run}/aliases/{alias}")
    @_answers_errors
    def delete_alias(run: str, alias: str) -> Response:
        if not registry.remove_alias(run, alias):
            known = list(registry.aliases(run))
            raise AliasNotFound(run, alias, known)
        return _json({"run": run, "alias": alias, "removed": True})


def _tag_routes(router: APIRouter, registry: Registry) -> None:
    @router.put("/runs/{run}/checkpoints/{report_index}/tags/{key}")
    @_answers_errors
    def put_tag(run: str, report_index: int, key: str, body: TagValue) -> Response:
        registry.tag(run, report_index, key, body.value)
        return _json({"run": run, "report_index": report_index, "key": key, "value": body.value})

    @router.delete("/runs/{run}/checkpoints/{report_index}/tags/{key}")
    @_answers_errors
    def delete_tag(run: str, report_index: int, key: str) -> Response:
        registry.tag(run, report_index, key, None)
        return _json({"run": run, "report_index": report_index, "key": key, "removed": True})


def _query_routes(router: APIRouter, registry: Registry) -> None:
    @router.get("/search")
    @_answers_errors
    def search(
        filter: str = Query("", description="e.g. metrics.accuracy > 0.9 and tags.split = 'val'"),
        order_by: list[str] = Query([], description="e.g. metrics.accuracy DESC; repeatable"),
        k: int = Query(100, description="At most this many checkpoints."),
    ) -> Response:
        records = registry.search(filter, order_by=order_by, k=k)
        return _json([record_json(r) for r in records])

    @router.get("/retention")
    @_answers_errors
    def retention_dry_run(
        metric: str = Query(..., description="Metric that ranks the checkpoints."),
        run: str | None = Query(None, description="One run; every run when left out."),
        mode: Literal["max", "min"] = Query("max"),
        keep_best: int = Query(0),
        keep_best_per_run: int = Query(1),
        keep_latest: int = Query(1),
    ) -> Response:
        """The checkpoints a retention run would delete now; nothing is deleted."""
        going = registry.apply_retention(
            run,
            metric=metric,
            mode=mode,
            keep_best=keep_best,
            keep_best_per_run=keep_best_per_run,
            keep_latest=keep_latest,
            dry_run=True,
        )
        return _json([record_json(r) for r in going])


def _run_status_routes(router: APIRouter, registry: Registry) -> None:
    @router.get("/runs/{run}/status")
    @_answers_errors
    def run_status(run: str) -> Response:
        attempts = registry.run_attempts(run)
        return _json({**attempt_json(attempts[-1]), "attempts": len(attempts)})

    @router.get("/runs/{run}/attempts")
    @_answers_errors
    def run_attempts(run: str) -> Response:
        return _json([attempt_json(a) for a in registry.run_attempts(run)])

    @router.post("/runs/{run}/finish")
    @_answers_errors
    def finish_run(run: str, body: RunEnd) -> Response:
        changed = registry.finish_run(run, body.status)
        latest = registry.run_attempts(run)[-1]
        return _json({**attempt_json(latest), "changed": changed})
