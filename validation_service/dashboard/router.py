"""The dashboard's routes: HTML pages under /ui, their JSON under /ui/api, static files."""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from validation_service.config import Settings
from validation_service.dashboard import data
from validation_service.errors import CkvalError, InvalidInput, RunNotFound, UnknownMetric
from validation_service.registry.registry import Registry

PREFIX = "/ui"
# How many runs one page of the runs list shows, and the most a request may ask for.
RUNS_PER_PAGE = 50
MAX_RUNS_PER_PAGE = 500
# Files served from static/ (nothing else: the name comes from the URL).
STATIC_FILES = {
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "LICENSE.uPlot": "text/plain",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
_PAGE_STATUS = {RunNotFound: 404, UnknownMetric: 404, InvalidInput: 422}

ModeParam = Literal["max", "min"] | None


@functools.cache
def _templates() -> Environment:
    return Environment(
        loader=PackageLoader("validation_service.dashboard", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _embedded(content: Any) -> Markup:
    """JSON to embed in a <script type="application/json">: no "</script>" can end it early."""
    text = json.dumps(content, allow_nan=False, separators=(",", ":"))
    return Markup(text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


def _json(content: Any) -> JSONResponse:
    return JSONResponse(content, headers={"Cache-Control": "no-store"})


def dashboard_router(registry: Registry, settings: Settings) -> APIRouter:
    """The dashboard over ``registry``: /ui/ (runs), /ui/runs/{run}, /ui/compare, and the
    JSON they refresh from under /ui/api/. Handlers are plain ``def``: registry calls block,
    so FastAPI runs them in its thread pool."""
    router = APIRouter(prefix=PREFIX, include_in_schema=False)

    def base(request: Request) -> str:
        return request.scope.get("root_path", "") + PREFIX

    def page(request: Request, template: str, title: str, content: Any, **extra: Any) -> Response:
        html = (
            _templates()
            .get_template(template)
            .render(
                title=title,
                base=base(request),
                namespace=registry.namespace,
                database=registry.display_url,
                data=_embedded(content),
                **extra,
            )
        )
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    def error_page(request: Request, exc: CkvalError) -> Response:
        status = next((code for cls, code in _PAGE_STATUS.items() if isinstance(exc, cls)), 400)
        html = (
            _templates()
            .get_template("error.html")
            .render(
                title=type(exc).__name__,
                base=base(request),
                namespace=registry.namespace,
                database=registry.display_url,
                error=type(exc).__name__,
                detail=str(exc),
            )
        )
        return HTMLResponse(html, status_code=status)

    # -------------------------------------------------------------- pages
    @router.get("", response_class=HTMLResponse)
    @router.get("/", response_class=HTMLResponse)
    def runs_page(
        request: Request,
        page_number: int = Query(1, alias="page", ge=1),
        per_page: int = Query(RUNS_PER_PAGE, ge=1, le=MAX_RUNS_PER_PAGE),
        metric: str | None = Query(None, max_length=255),
        mode: ModeParam = None,
    ) -> Response:
        content = _runs(request, page_number, per_page, metric, mode)
        return page(request, "runs.html", "Runs", content)

    @router.get("/runs/{run}", response_class=HTMLResponse)
    def run_page(request: Request, run: str) -> Response:
        try:
            content = data.run_json(registry, run, base(request))
        except CkvalError as exc:
            return error_page(request, exc)
        return page(request, "run.html", run, content, run=run)

    @router.get("/compare", response_class=HTMLResponse)
    def compare_page(
        request: Request,
        runs: str | None = Query(None, max_length=10_000),
        metric: str | None = Query(None, max_length=255),
        mode: ModeParam = None,
    ) -> Response:
        content = None
        if runs is not None:
            try:
                content = data.compare_json(registry, runs, metric, mode, base(request))
            except CkvalError as exc:
                return error_page(request, exc)
        return page(
            request, "compare.html", "Compare runs", content, runs=runs or "", metric=metric or ""
        )

    # ------------------------------------------------------- JSON they poll
    def _runs(request: Request, page_number: int, per_page: int, metric, mode) -> dict:
        result = registry.run_page(page=page_number, per_page=per_page, metric=metric, mode=mode)
        return data.runs_json(result, base(request))

    @router.get("/api/runs")
    def runs_data(
        request: Request,
        page_number: int = Query(1, alias="page", ge=1),
        per_page: int = Query(RUNS_PER_PAGE, ge=1, le=MAX_RUNS_PER_PAGE),
        metric: str | None = Query(None, max_length=255),
        mode: ModeParam = None,
    ) -> JSONResponse:
        return _json(_runs(request, page_number, per_page, metric, mode))

    @router.get("/api/runs/{run}")
    def run_data(request: Request, run: str) -> JSONResponse:
        return _json(data.run_json(registry, run, base(request)))

    @router.get("/api/compare")
    def compare_data(
        request: Request,
        runs: str = Query(..., max_length=10_000),
        metric: str | None = Query(None, max_length=255),
        mode: ModeParam = None,
    ) -> JSONResponse:
        return _json(data.compare_json(registry, runs, metric, mode, base(request)))

    # --------------------------------------------------------------- static
    static = resources.files("validation_service.dashboard") / "static"

    @router.get("/static/{name}")
    def static_file(name: str) -> Response:
        if name not in STATIC_FILES:
            raise HTTPException(
                404,
                f"No dashboard file named {name!r}; the dashboard serves "
                f"{', '.join(sorted(STATIC_FILES))}.",
            )
        with resources.as_file(static / name) as path:
            return FileResponse(
                path,
                media_type=STATIC_FILES[name],
                headers={"Cache-Control": "public, max-age=3600"},
            )

    return router
