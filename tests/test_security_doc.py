"""SECURITY.md's trust table keeps up with the API: every route that changes something is
named with what it allows, and so is what a reader of /metrics learns."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.routing import APIRoute

from validation_service.api import create_app
from validation_service.config import Settings
from validation_service.registry.registry import Registry

SECURITY = Path(__file__).resolve().parents[1] / "SECURITY.md"


def token_table() -> str:
    text = SECURITY.read_text()
    start = text.index("What the API token allows")
    return text[start : text.index("\n\n", text.index("| --- |", start))]


def test_the_token_table_names_every_route_that_changes_something(tmp_path):
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    app = create_app(Settings(), registry)
    changing = {
        route.path
        for route in app.routes
        if isinstance(route, APIRoute) and route.methods & {"POST", "PUT", "DELETE", "PATCH"}
    }
    registry.close()
    table = token_table()
    assert changing, "the API has routes that change something"
    assert sorted(path for path in changing if path not in table) == []
    for power in ("production", "finish", "tag", "cancel", "retry"):
        assert re.search(rf"\b{power}", table), power


def test_the_token_table_says_what_metrics_tell_across_namespaces():
    [row] = [line for line in token_table().splitlines() if line.startswith("| read `/metrics`")]
    for fact in ("every** namespace", "pool", "queue depth", "runs by status", "No run name"):
        assert fact in row, fact
