"""Weights & Biases sink: validated metrics against the checkpoint's step, in the training's run.

When report() ran while a W&B run was active (``wandb.init()`` in the training process),
that run is resumed (same id, project and entity); otherwise a run named after ckval's
run, with an id derived from it, in ``project`` (default "ckval"). Validations finish out
of order, and a run's own step only grows, so the metrics are plotted against their own
x-axis ``ckval/step`` (``define_metric``). ``mode="offline"`` (or ``WANDB_MODE``) writes
the run under ``dir`` (or ``WANDB_DIR``) for ``wandb sync``. Needs ``pip install
'ckval[wandb]'``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from validation_service.sinks import STEP_KEY, ValidatedMetrics


class WandbSink:
    kind = "wandb"

    def __init__(
        self,
        project: str | None = None,
        entity: str | None = None,
        prefix: str = "",
        mode: str | None = None,
        dir: str | None = None,  # noqa: A002 - wandb.init's own name for it
    ):
        import wandb  # noqa: F401 - fails here, at build time, when the extra is missing

        self.project = project
        self.entity = entity
        self.prefix = prefix
        self.mode = mode
        self.dir = dir
        # Runs stay open between batches (the dispatcher closes them once idle): each
        # resume of a run is a new session, and offline sessions of one run started in
        # the same second would share, and overwrite, one folder.
        self._open: dict[str, Any] = {}

    def log(self, batch: Sequence[ValidatedMetrics]) -> None:
        by_run: dict[tuple[str, str], list[ValidatedMetrics]] = {}
        for item in batch:
            by_run.setdefault((item.namespace, item.run), []).append(item)
        for items in by_run.values():
            self._log_run(items)

    def close(self) -> None:
        """Finishes the open runs (a later batch resumes them)."""
        while self._open:
            _, run = self._open.popitem()
            run.finish()

    def _log_run(self, items: list[ValidatedMetrics]) -> None:
        target = self._target(items[0])
        run = self._open.get(target["id"])
        if run is None:
            run = self._open[target["id"]] = self._start(target)
        for item in sorted(items, key=lambda i: i.step):
            metrics = {self.prefix + name: value for name, value in item.metrics.items()}
            for name in metrics:
                run.define_metric(name, step_metric=STEP_KEY)
            run.log({STEP_KEY: item.step, **metrics})

    def _target(self, item: ValidatedMetrics) -> dict[str, Any]:
        """wandb.init's arguments for the run that this validation's metrics go to."""
        training = item.trackers.get("wandb") or {}
        if training.get("id"):
            return {
                "id": training["id"],
                "project": training.get("project") or self.project,
                "entity": training.get("entity") or self.entity,
            }
        digest = hashlib.sha256(f"{item.namespace}/{item.run}".encode()).hexdigest()
        return {
            "id": f"ckval-{digest[:16]}",
            "name": item.run,
            "project": self.project or "ckval",
            "entity": self.entity,
            "tags": ["ckval"],
        }

    def _start(self, target: dict[str, Any]):
        import wandb

        run = wandb.init(
            **target,
            resume="allow",
            reinit="create_new",  # one open run per ckval run, side by side
            mode=self.mode,
            dir=self.dir,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        run.define_metric(STEP_KEY)
        return run
