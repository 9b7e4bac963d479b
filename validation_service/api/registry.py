"""HTTP routes over the registry's aliases, tags, search, retention (dry run), run status
and early stopping (a run's stop policy, its decision and the override).

``create_app`` includes ``registry_router(registry, settings)``. Errors come back as the
rest of the API's do: ``{"error": <class>, "detail": <message>}`` with 404 for what does
not exist and 400/422 for requests that cannot be acted on.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Path, Query
from fastapi.responses import Response
from pydantic import BaseModel, Field

from validation_service.api.views import (
    labelled_checkpoint_json,
    stop_decision_json,
    stop_policy_json,
)
from validation_service.config import Settings
from validation_service.errors import (
    AliasNotFound,
    CkvalError,
    InvalidInput,
    InvalidSearch,
    JobNotFound,
    RunNotFound,
    UnknownMetric,
    on_ckval_error,
)
from validation_service.metrics import encode_non_finite
from validation_service.registry.records import RunRecord
from validation_service.registry.registry import Registry
from validation_service.stopping import StopPolicy
from validation_service.validation import INT32_MAX, MAX_BEST_K, check_evaluation_name

_STATUS = {
    RunNotFound: 404,
    AliasNotFound: 404,
    JobNotFound: 404,
    UnknownMetric: 404,
    InvalidInput: 422,
    InvalidSearch: 400,
}


# A report index is a 32-bit column: a larger number names no checkpoint (a 422, never a
# number that reaches the database driver).
ReportIndex = Annotated[int, Path(ge=0, le=INT32_MAX, description="A report index.")]


class AliasTarget(BaseModel):
    """Where an alias goes: one checkpoint, or the best by a metric (tracked)."""

    report_index: int | None = Field(None, ge=0, le=INT32_MAX)
    track_metric: str | None = None
    mode: Literal["max", "min"] = "max"


class TagValue(BaseModel):
    value: str


class RunEnd(BaseModel):
    status: Literal["FINISHED", "FAILED"]


class Command(BaseModel):
    """An outside program as the validator (CommandValidator)."""

    argv: list[str] = Field(..., min_length=1, max_length=256)
    timeout_s: float | None = Field(None, gt=0, le=7 * 24 * 3600)


class RevalidateBody(BaseModel):
    """POST /runs/{run}/revalidate: a named evaluation over the run's stored checkpoints.
    One of ``validate_fn`` (a "package.module:function" reference) or ``command``."""

    validator: str = Field(..., max_length=128)
    validate_fn: str | None = Field(None, max_length=512)
    command: Command | None = None
    validate_config: dict[str, Any] | None = None
    reports: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(None, max_length=10_000)
    priority: int = Field(0, ge=-(2**31), le=INT32_MAX)
    force: bool = False


def _json(content: Any, status_code: int = 200) -> Response:
    # NaN and infinite metric values as the strings "NaN", "Infinity" (plain JSON has none).
    body = json.dumps(encode_non_finite(content), allow_nan=False, default=str)
    return Response(body, status_code=status_code, media_type="application/json")


def _error_body(exc: CkvalError) -> Response:
    """A ckval error as the API's error body, whichever app includes the router."""
    status = next((code for cls, code in _STATUS.items() if isinstance(exc, cls)), 400)
    return _json({"error": type(exc).__name__, "detail": str(exc)}, status)


_answers_errors = on_ckval_error(_error_body)


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
    /retention (dry run: what would be deleted), /runs/{run}/status, /runs/{run}/finish,
    /runs/{run}/stop-policy, /runs/{run}/stop-decision, /runs/{run}/resume-despite-stop and
    /runs/{run}/revalidate."""
    router = APIRouter()
    _alias_routes(router, registry)
    _tag_routes(router, registry)
    _query_routes(router, registry)
    _run_status_routes(router, registry)
    _stop_routes(router, registry)
    _evaluation_routes(router, registry, settings)
    return router


def _alias_routes(router: APIRouter, registry: Registry) -> None:
    @router.get("/runs/{run}/aliases")
    @_answers_errors
    def list_aliases(run: str) -> Response:
        return _json(registry.aliases(run))

    @router.get("/runs/{run}/aliases/{alias}")
    @_answers_errors
    def get_alias(run: str, alias: str) -> Response:
        return _json(labelled_checkpoint_json(registry.get_alias_record(run, alias)))

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
    def put_tag(run: str, report_index: ReportIndex, key: str, body: TagValue) -> Response:
        registry.tag(run, report_index, key, body.value)
        return _json({"run": run, "report_index": report_index, "key": key, "value": body.value})

    @router.delete("/runs/{run}/checkpoints/{report_index}/tags/{key}")
    @_answers_errors
    def delete_tag(run: str, report_index: ReportIndex, key: str) -> Response:
        registry.tag(run, report_index, key, None)
        return _json({"run": run, "report_index": report_index, "key": key, "removed": True})


def _query_routes(router: APIRouter, registry: Registry) -> None:
    @router.get("/search")
    @_answers_errors
    def search(
        filter: str = Query("", description="e.g. metrics.accuracy > 0.9 and tags.split = 'val'"),
        order_by: list[str] = Query([], description="e.g. metrics.accuracy DESC; repeatable"),
        k: int = Query(100, ge=1, le=MAX_BEST_K, description="At most this many checkpoints."),
    ) -> Response:
        records = registry.search(filter, order_by=order_by, k=k)
        return _json([labelled_checkpoint_json(r) for r in records])

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
        return _json([labelled_checkpoint_json(r) for r in going])


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
        changed = registry.ledger.finish_run(run, body.status)
        latest = registry.run_attempts(run)[-1]
        return _json({**attempt_json(latest), "changed": changed})


def _stop_routes(router: APIRouter, registry: Registry) -> None:
    @router.get("/runs/{run}/stop-policy")
    @_answers_errors
    def get_stop_policy(run: str) -> Response:
        return _json({"run": run, "policy": stop_policy_json(registry.stop_policy(run))})

    @router.put("/runs/{run}/stop-policy")
    @_answers_errors
    def put_stop_policy(
        run: str,
        body: Any = Body(..., description="StopPolicy's fields, e.g. {metric, patience}."),
    ) -> Response:
        """Stores the run's policy (before its first report too); a bad field is a 422
        naming it, and nothing is stored."""
        policy = registry.set_stop_policy(run, StopPolicy.from_mapping(body))
        return _json({"run": run, "policy": stop_policy_json(policy)})

    @router.delete("/runs/{run}/stop-policy")
    @_answers_errors
    def delete_stop_policy(run: str) -> Response:
        registry.set_stop_policy(run, None)
        return _json({"run": run, "policy": None})

    @router.get("/runs/{run}/stop-decision")
    @_answers_errors
    def get_stop_decision(run: str) -> Response:
        """The latest decision of the run's latest attempt (``stopped`` false once
        overridden), or ``"decision": null``."""
        return _json({"run": run, "decision": stop_decision_json(registry.stop_decision(run))})

    @router.post("/runs/{run}/resume-despite-stop")
    @_answers_errors
    def resume_despite_stop(run: str) -> Response:
        """Overrides the run's stop decision (recorded); 422 when the run is not stopped."""
        decision = registry.resume_despite_stop(run)
        return _json({"run": run, "decision": stop_decision_json(decision)})


def _evaluation_routes(router: APIRouter, registry: Registry, settings: Settings) -> None:
    @router.post("/runs/{run}/revalidate")
    @_answers_errors
    def revalidate(run: str, body: RevalidateBody) -> Response:
        """Queues a named evaluation, within the API's caps: a reference inside
        CKVAL_ALLOWED_MODULES, or a command whose program CKVAL_ALLOWED_COMMANDS names."""
        from validation_service.registry import evaluations
        from validation_service.registry.evaluation_caps import RevalidationCaps

        if (body.validate_fn is None) == (body.command is None):
            raise InvalidInput("give one of validate_fn (a module:function reference) or command")
        check_evaluation_name(body.validator)
        refused = _refusal(body, settings)
        if refused is not None:
            return _json({"error": "Forbidden", "detail": refused}, 403)
        validate_fn: Any = body.validate_fn
        if body.command is not None:
            from validation_service.validators.command import CommandValidator

            validate_fn = CommandValidator(body.command.argv, timeout_s=body.command.timeout_s)
        request = evaluations.evaluation_request(
            validate_fn, body.validate_config, None, body.validator, body.priority
        )
        done = evaluations.revalidate(
            registry,
            run,
            request,
            reports=body.reports,
            force=body.force,
            caps=RevalidationCaps.for_http(settings),
        )
        return _json(
            {
                "job_ids": done.job_ids,
                "already": [index for _run, index in done.already],
                "deleted": [index for _run, index in done.deleted],
                "over_budget": [index for _run, index in done.over_budget],
            }
        )


def _refusal(body: RevalidateBody, settings: Settings) -> str | None:
    """Why the API may not run what ``body`` asks (a 403), or None. A reference must lie
    inside CKVAL_ALLOWED_MODULES and may not be the command runner (a command comes as
    ``command``); a command's program must be one that CKVAL_ALLOWED_COMMANDS names."""
    from validation_service.validate_fn import check_module_allowed, import_validate_fn
    from validation_service.validators.command import REFERENCE, run_command

    if body.command is not None:
        program = body.command.argv[0]
        if program not in (settings.allowed_commands or []):
            allowed = ", ".join(map(repr, settings.allowed_commands or [])) or "none is set"
            return (
                f"the HTTP API runs only the programs CKVAL_ALLOWED_COMMANDS names "
                f"({allowed}), not {program!r}: add it there on the API's host (an "
                "interpreter or a shell allowed there runs any code the caller sends), or "
                "use `ckval revalidate` or Registry.revalidate."
            )
        if settings.allowed_modules:
            check_module_allowed(REFERENCE, settings.allowed_modules)  # the service's list
        return None
    if not settings.allowed_modules:
        return (
            "revalidation over HTTP runs only references inside CKVAL_ALLOWED_MODULES, and "
            "none is set: set it on the API's host, or use `ckval revalidate` or "
            "Registry.revalidate."
        )
    if import_validate_fn(body.validate_fn, settings.allowed_modules) is run_command:
        return (
            f"{body.validate_fn!r} runs an outside program: send it as `command`, which the "
            "API runs only for the programs CKVAL_ALLOWED_COMMANDS names."
        )
    return None
