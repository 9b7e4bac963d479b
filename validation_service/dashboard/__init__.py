"""The ckval dashboard: runs, one run's plots and timeline, run comparison, and /metrics."""

from validation_service.dashboard.prometheus import metrics_router
from validation_service.dashboard.router import dashboard_router

__all__ = ["dashboard_router", "metrics_router"]
