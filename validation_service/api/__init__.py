"""ckval over HTTP: the API (app.py, `create_app`), the guard around it (guard.py), the
registry's routes (registry.py), the one JSON view of a record (views.py) and the
dashboard under /ui with /metrics (dashboard/).

`from validation_service.api import create_app` loads app.py, and with it FastAPI, on
first use (PEP 562): the command line prints records through views.py without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The names of app.py that this package answers (the guard's were first defined there).
__all__ = [
    "MIN_TOKEN_LENGTH",
    "PUBLIC_PATHS",
    "SECURITY_HEADERS",
    "TOKEN_COOKIE",
    "UI_PREFIX",
    "ApiGuard",
    "allowed_hosts",
    "check_bind",
    "checked_api_token",
    "create_app",
]

if TYPE_CHECKING:
    from validation_service.api.app import create_app


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("validation_service.api.app"), name)
    globals()[name] = value  # later lookups skip this function
    return value
