"""The experiment trackers a training process logs to (MLflow, W&B), recorded with its run.

The service's sinks (validation_service.sinks) log validated metrics into the same tracker
runs. Only trackers the training already imported are asked: nothing is imported here.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from validation_service.secrets import without_credentials
from validation_service.sinks import TRACKERS_TAG

__all__ = ["TRACKERS_TAG", "active_trackers"]

logger = logging.getLogger(__name__)


def active_trackers() -> dict[str, dict[str, Any]]:
    """The MLflow and W&B runs active in this thread, as ``{"mlflow": {...}, "wandb": {...}}``.

    MLflow's active run is per thread: call this from the thread that calls report().
    """
    trackers: dict[str, dict[str, Any]] = {}
    try:
        mlflow = sys.modules.get("mlflow")
        run = mlflow.active_run() if mlflow is not None else None
        if run is not None:
            trackers["mlflow"] = {
                "run_id": run.info.run_id,
                "experiment_id": run.info.experiment_id,
                # Stored and served with the run: never with a user, password or token.
                "tracking_uri": without_credentials(mlflow.get_tracking_uri()),
            }
        wandb = sys.modules.get("wandb")
        run = getattr(wandb, "run", None) if wandb is not None else None
        if run is not None:
            trackers["wandb"] = {"id": run.id, "project": run.project, "entity": run.entity}
    except Exception:  # noqa: BLE001 - a tracker's state never fails a report
        logger.debug("reading the active tracker runs failed", exc_info=True)
    return trackers
