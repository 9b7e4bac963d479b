"""Weights & Biases sink: validated metrics against the checkpoint's step, in the training's run.

When report() ran while a W&B run was active (``wandb.init()`` in the training process),
that run is resumed (same id, project and entity) if its entity is one the service allows
(``allowed_entities``: CKVAL_WANDB_ALLOWED_ENTITIES); otherwise, with a warning naming
the job, a run named after ckval's run, with an id derived from it, in ``project``
(default "ckval"). Validations finish out
of order, and a run's own step only grows, so the metrics are plotted against their own
x-axis ``ckval/step`` (``define_metric``). ``mode="offline"`` (or ``WANDB_MODE``) writes
the run under ``dir`` (or ``WANDB_DIR``) for ``wandb sync``. Needs ``pip install
'ckval[wandb]'``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Collection, Sequence
from typing import Any, ClassVar

from validation_service.sinks import STEP_KEY, ValidatedMetrics

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class WandbSink:
    kind: ClassVar[str] = "wandb"

    project: str | None = None
    entity: str | None = None
    prefix: str = ""
    mode: str | None = None
    dir: str | None = None  # wandb.init's own name for it
    allowed_entities: Collection[str] = ()
    # Runs stay open between batches (the dispatcher closes them once idle): each
    # resume of a run is a new session, and offline sessions of one run started in
    # the same second would share, and overwrite, one folder.
    _open: dict[str, Any] = dataclasses.field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        import wandb  # noqa: F401 - fails here, at build time, when the extra is missing

        self.allowed_entities = frozenset(self.allowed_entities)

    def log(self, batch: Sequence[ValidatedMetrics]) -> dict[int, list[str]]:
        """Logs the batch; returns the warnings of the validations logged elsewhere than
        the W&B run their run recorded, by job id (the dispatcher stores them)."""
        by_run: dict[tuple[str, str], list[ValidatedMetrics]] = {}
        for item in batch:
            by_run.setdefault((item.namespace, item.run), []).append(item)
        warnings: dict[int, list[str]] = {}
        for items in by_run.values():
            warning = self._log_run(items)
            if warning is not None:
                for item in items:
                    logger.warning("validation job %s (run %r): %s", item.job_id, item.run, warning)
                    warnings.setdefault(item.job_id, []).append(warning)
        return warnings

    def close(self) -> None:
        """Finishes the open runs (a later batch resumes them)."""
        while self._open:
            _, run = self._open.popitem()
            run.finish()

    def _log_run(self, items: list[ValidatedMetrics]) -> str | None:
        """Logs one ckval run's validations; returns why not into the W&B run it recorded."""
        target, warning = self._target(items[0])
        run = self._open.get(target["id"])
        if run is None:
            run = self._open[target["id"]] = self._start(target)
        for item in sorted(items, key=lambda i: i.step):
            metrics = {self.prefix + name: value for name, value in item.metrics.items()}
            for name in metrics:
                run.define_metric(name, step_metric=STEP_KEY)
            run.log({STEP_KEY: item.step, **metrics})
        return warning

    def _target(self, item: ValidatedMetrics) -> tuple[dict[str, Any], str | None]:
        """wandb.init's arguments for the run that this validation's metrics go to, and
        why not the W&B run that the run recorded (None when they go there, or none was)."""
        training = item.trackers.get("wandb") or {}
        digest = hashlib.sha256(f"{item.namespace}/{item.run}".encode()).hexdigest()
        own_id = f"ckval-{digest[:16]}"
        warning = None
        if training.get("id"):
            entity = training.get("entity") or self.entity
            if self._may_resume(str(training["id"]), entity, own_id):
                recorded = {
                    "id": training["id"],
                    "project": training.get("project") or self.project,
                    "entity": entity,
                }
                return recorded, None
            warning = (
                f"not logged to the W&B run {training['id']!r} of entity {entity!r} that the "
                "run recorded: the entity is not in CKVAL_WANDB_ALLOWED_ENTITIES (or the id "
                "is another ckval run's); logged to the sink's own run instead"
            )
        own = {
            "id": own_id,
            "name": item.run,
            "project": self.project or "ckval",
            "entity": self.entity,
            "tags": ["ckval"],
        }
        return own, warning

    def _may_resume(self, run_id: str, entity: str | None, own_id: str) -> bool:
        """A recorded run is resumed only in an entity the settings allow ("*": any, ""
        for W&B's default entity), and never another ckval run's own run."""
        if run_id.startswith("ckval-") and run_id != own_id:
            return False
        return bool(self.allowed_entities & {"*", entity or ""})

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
