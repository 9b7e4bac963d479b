"""The dashboard's routes: HTML pages under /ui, their JSON under /ui/api, static files."""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from typing import Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from validation_service.api.dashboard import data
from validation_service.config import Settings
from validation_service.errors import CkvalError, InvalidInput, RunNotFound, UnknownMetric
from validation_service.metrics import encode_non_finite
from validation_service.registry.dashboard_reads import DashboardReader

PREFIX = "/ui"
# How many runs one page of the runs list shows, and the most a request may ask for.
RUNS_PER_PAGE = 50
MAX_RUNS_PER_PAGE = 500
# The last page number whose offset a 64-bit integer holds (a larger one is a 422).
MAX_PAGE = (2**63 - 1) // MAX_RUNS_PER_PAGE
# Files served from static/ (nothing else: the name comes from the URL).
STATIC_FILES = {
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "LICENSE.uPlot": "text/plain",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "api-docs.js": "text/javascript",
}
_PAGE_STATUS = {RunNotFound: 404, UnknownMetric: 404, InvalidInput: 422}

ModeParam = Literal["max", "min"] | None


@dataclasses.dataclass
class RunListing:
    """The query parameters of the runs page and of its JSON: which page, and the metric
    whose best value each run shows."""

    page_number: int = Query(1, alias="page", ge=1, le=MAX_PAGE)
    per_page: int = Query(RUNS_PER_PAGE, ge=1, le=MAX_RUNS_PER_PAGE)
    metric: str | None = Query(None, max_length=255)
    mode: ModeParam = None


@functools.cache
def _templates() -> Environment:
    return Environment(
        loader=PackageLoader("validation_service.api.dashboard", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _embedded(content: Any) -> Markup:
    """JSON to embed in a <script type="application/json">: no "</script>" can end it early."""
    text = json.dumps(encode_non_finite(content), allow_nan=False, separators=(",", ":"))
    return Markup(text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


def _json(content: Any) -> JSONResponse:
    return JSONResponse(encode_non_finite(content), headers={"Cache-Control": "no-store"})


def dashboard_router(reader: DashboardReader, settings: Settings) -> APIRouter:
    """The dashboard over the registry's ``reader``: /ui/ (runs), /ui/runs/{run},
    /ui/compare, and the JSON they refresh from under /ui/api/. Handlers are plain
    ``def``: registry reads block, so FastAPI runs them in its thread pool."""
    router = APIRouter(prefix=PREFIX, include_in_schema=False)
    pages = _Pages(reader)
    _add_page_routes(router, pages)
    _add_data_routes(router, pages)
    _add_static_route(router)
    return router


class _Pages:
    """Renders the dashboard's pages over the registry's reader: the page's JSON
    embedded, or the error a person can act on."""

    def __init__(self, reader: DashboardReader) -> None:
        self.reader = reader

    @staticmethod
    def base(request: Request) -> str:
        return request.scope.get("root_path", "") + PREFIX

    def runs(self, request: Request, listing: RunListing) -> dict:
        result = self.reader.run_page(
            page=listing.page_number,
            per_page=listing.per_page,
            metric=listing.metric,
            mode=listing.mode,
        )
        return data.runs_json(result, self.base(request))

    def page(
        self, request: Request, template: str, title: str, content: Any, **extra: Any
    ) -> Response:
        html = self._render(template, request, title=title, data=_embedded(content), **extra)
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    def error_page(self, request: Request, exc: CkvalError) -> Response:
        status = next((code for cls, code in _PAGE_STATUS.items() if isinstance(exc, cls)), 400)
        error = type(exc).__name__
        html = self._render("error.html", request, title=error, error=error, detail=str(exc))
        return HTMLResponse(html, status_code=status)

    def _render(self, template: str, request: Request, **values: Any) -> str:
        return (
            _templates()
            .get_template(template)
            .render(
                base=self.base(request),
                namespace=self.reader.catalog.namespace,
                database=self.reader.db.display_url,
                **values,
            )
        )


def _metric_choice(
    metric: list[str] = Query([]), max_metrics: int = data.METRICS_PER_PAGE
) -> data.MetricChoice:
    """A run page's ``?metric=NAME`` (repeated: those metrics) or ``?max_metrics=N`` (the
    first N), checked against data.MAX_METRICS_PER_PAGE when the page is built."""
    return data.MetricChoice(tuple(metric), max_metrics)


def _add_page_routes(router: APIRouter, pages: _Pages) -> None:
    @router.get("", response_class=HTMLResponse)
    @router.get("/", response_class=HTMLResponse)
    def runs_page(request: Request, listing: RunListing = Depends()) -> Response:
        content = pages.runs(request, listing)
        return pages.page(request, "runs.html", "Runs", content)

    @router.get("/runs/{run}", response_class=HTMLResponse)
    def run_page(
        request: Request, run: str, choice: data.MetricChoice = Depends(_metric_choice)
    ) -> Response:
        try:
            content = data.run_json(pages.reader, run, pages.base(request), choice)
        except CkvalError as exc:
            return pages.error_page(request, exc)
        return pages.page(request, "run.html", run, content, run=run)

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
                content = data.compare_json(pages.reader, runs, metric, mode, pages.base(request))
            except CkvalError as exc:
                return pages.error_page(request, exc)
        return pages.page(
            request, "compare.html", "Compare runs", content, runs=runs or "", metric=metric or ""
        )


def _add_data_routes(router: APIRouter, pages: _Pages) -> None:
    """The JSON the pages poll: the same their first paint embeds."""

    @router.get("/api/runs")
    def runs_data(request: Request, listing: RunListing = Depends()) -> JSONResponse:
        return _json(pages.runs(request, listing))

    @router.get("/api/runs/{run}")
    def run_data(
        request: Request, run: str, choice: data.MetricChoice = Depends(_metric_choice)
    ) -> JSONResponse:
        return _json(data.run_json(pages.reader, run, pages.base(request), choice))

    @router.get("/api/compare")
    def compare_data(
        request: Request,
        runs: str = Query(..., max_length=10_000),
        metric: str | None = Query(None, max_length=255),
        mode: ModeParam = None,
    ) -> JSONResponse:
        return _json(data.compare_json(pages.reader, runs, metric, mode, pages.base(request)))


def _add_static_route(router: APIRouter) -> None:
    static = resources.files("validation_service.api.dashboard") / "static"

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


def docs_router() -> APIRouter:
    """/docs: the HTTP API's reference, drawn from /openapi.json by a script of the
    package. FastAPI's own /docs loads Swagger UI from a CDN; this page loads nothing
    from another site, so it works offline and under the API's Content-Security-Policy."""
    router = APIRouter(include_in_schema=False)

    @router.get("/docs", response_class=HTMLResponse)
    def api_docs(request: Request) -> Response:
        root = request.scope.get("root_path", "")
        html = _templates().get_template("docs.html").render(root=root, base=root + PREFIX)
        return HTMLResponse(html)

    return router
