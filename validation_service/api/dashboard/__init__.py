"""The ckval dashboard: runs, one run's plots and timeline, run comparison, and /metrics."""

from __future__ import annotations

from typing import Any

__all__ = ["dashboard_router", "metrics_router"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: `ckval ui` is registered on the CLI, which must start fast.
    if name == "dashboard_router":
        from validation_service.api.dashboard.router import dashboard_router

        return dashboard_router
    if name == "metrics_router":
        from validation_service.api.dashboard.prometheus import metrics_router

        return metrics_router
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
