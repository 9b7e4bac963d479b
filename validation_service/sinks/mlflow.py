"""MLflow sink: validated metrics at the checkpoint's step, in the training's MLflow run.

When report() ran inside an active MLflow run (``mlflow.start_run()``, Ray's
``setup_mlflow``), the metrics go into that run if its experiment is one the service
allows (``allowed_experiments``: CKVAL_MLFLOW_ALLOWED_EXPERIMENTS) or the sink made it
for this ckval run, on its tracking server, if that server is one the service allows:
the sink's ``tracking_uri``, else the service's own tracking URI (MLFLOW_TRACKING_URI),
or one of ``allowed_tracking_uris`` (CKVAL_MLFLOW_ALLOWED_URIS).
A run's recorded server is never trusted by itself: the service's MLflow credentials go
only to servers its own settings name, and a validation whose run names another is
logged, with a warning naming the job, to the service's own server instead. Otherwise,
or when this sink is configured with another ``tracking_uri``, they go into a run named
after ckval's run in the experiment ``experiment`` (created on first use, found again by
its ``ckval.run_key`` tag). Needs ``pip install 'ckval[mlflow]'``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Collection, Sequence
from typing import ClassVar

from validation_service.secrets import without_credentials
from validation_service.sinks import ValidatedMetrics

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False, repr=False)  # no repr: a tracking URI may hold a password
class MlflowSink:
    kind: ClassVar[str] = "mlflow"

    tracking_uri: str | None = None
    experiment: str = "ckval"
    prefix: str = ""
    allowed_tracking_uris: Sequence[str] = ()
    allowed_experiments: Collection[str] = ()
    # (tracking URI, recorded run id, namespace, ckval run) -> whether it may be used
    _run_allowed: dict[tuple[str, str, str, str], bool] = dataclasses.field(
        default_factory=dict, init=False
    )
    # (tracking URI, namespace, ckval run) -> the MLflow run named after it
    _named_runs: dict[tuple[str, str, str], str] = dataclasses.field(
        default_factory=dict, init=False
    )

    def __post_init__(self) -> None:
        import mlflow  # noqa: F401 - fails here, at build time, when the extra is missing

        self.allowed_tracking_uris = tuple(self.allowed_tracking_uris)
        self.allowed_experiments = frozenset(self.allowed_experiments)

    def log(self, batch: Sequence[ValidatedMetrics]) -> dict[int, list[str]]:
        """Logs the batch; returns the warnings of the validations logged elsewhere than
        the MLflow run their run recorded, by job id (the dispatcher stores them)."""
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        targets: dict[tuple[str, str], list[Metric]] = {}
        warnings: dict[int, list[str]] = {}
        now_ms = int(time.time() * 1000)
        for item in batch:
            uri, run_id, warning = self._target(item)
            if warning is not None:
                logger.warning("validation job %s (run %r): %s", item.job_id, item.run, warning)
                warnings.setdefault(item.job_id, []).append(warning)
            targets.setdefault((uri, run_id), []).extend(
                Metric(self.prefix + name, value, now_ms, item.step)
                for name, value in item.metrics.items()
            )
        for (uri, run_id), metrics in targets.items():
            if metrics:
                MlflowClient(uri).log_batch(run_id, metrics=metrics)
        return warnings

    def close(self) -> None:
        pass

    def _target(self, item: ValidatedMetrics) -> tuple[str, str, str | None]:
        """(tracking URI, run id) that this validation's metrics are logged to, and why
        not the MLflow run that the run recorded (None when they go there, or none was)."""
        import mlflow

        training = item.trackers.get("mlflow") or {}
        uri = self.tracking_uri or mlflow.get_tracking_uri()
        warning = None
        if training.get("run_id"):
            recorded = training.get("tracking_uri")
            server = uri if recorded is None else self._allowed(recorded)
            if server is not None and (server == uri or not self.tracking_uri):
                if self._may_log_into(server, training["run_id"], item):
                    return server, training["run_id"], None
                warning = (
                    f"not logged to the MLflow run {training['run_id']} that the run "
                    "recorded: ckval did not create it for this run, and its experiment is "
                    "not in CKVAL_MLFLOW_ALLOWED_EXPERIMENTS; logged to the sink's own run "
                    "instead"
                )
            elif server is None and not self.tracking_uri:
                warning = (
                    f"not logged to the MLflow tracking server {without_credentials(recorded)}"
                    " that the run recorded, as this service's settings do not allow it (the "
                    "sink's tracking_uri, MLFLOW_TRACKING_URI, CKVAL_MLFLOW_ALLOWED_URIS); "
                    f"logged to {without_credentials(uri)} instead"
                )
        key = (uri, item.namespace, item.run)
        if key not in self._named_runs:
            self._named_runs[key] = self._named_run(uri, item.namespace, item.run)
        return uri, self._named_runs[key], warning

    def _allowed(self, recorded: str) -> str | None:
        """The tracking URI this service may use (its credentials included) for the
        server a run recorded (stored without credentials); None if none is allowed."""
        import mlflow

        wanted = without_credentials(recorded).rstrip("/")
        for uri in (self.tracking_uri, mlflow.get_tracking_uri(), *self.allowed_tracking_uris):
            if uri and without_credentials(uri).rstrip("/") == wanted:
                return uri
        return None

    def _may_log_into(self, uri: str, run_id: str, item: ValidatedMetrics) -> bool:
        """Whether a recorded MLflow run may get this validation's metrics: one this sink
        made for the same ckval run (its ckval.run_key tag), or one in an experiment the
        settings allow. A reporter's word alone never reaches another team's run."""
        key = (uri, run_id, item.namespace, item.run)
        if key not in self._run_allowed:
            self._run_allowed[key] = self._check_run(uri, run_id, item)
        return self._run_allowed[key]

    def _check_run(self, uri: str, run_id: str, item: ValidatedMetrics) -> bool:
        from mlflow import MlflowClient

        client = MlflowClient(uri)
        try:
            found = client.get_run(run_id)
        except Exception:  # noqa: BLE001 - no such run (or no access): not allowed
            return False
        if found.data.tags.get("ckval.run_key") == _run_key(item.namespace, item.run):
            return True
        experiment_id = found.info.experiment_id
        if self.allowed_experiments & {"*", experiment_id}:
            return True
        return client.get_experiment(experiment_id).name in self.allowed_experiments

    def _named_run(self, uri: str, namespace: str, run: str) -> str:
        from mlflow import MlflowClient

        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name(self.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else client.create_experiment(self.experiment)
        )
        # A hash in the filter: run names may hold quotes that the filter syntax would not.
        run_key = _run_key(namespace, run)
        found = client.search_runs(
            [experiment_id], filter_string=f"tags.`ckval.run_key` = '{run_key}'", max_results=1
        )
        if found:
            return found[0].info.run_id
        created = client.create_run(
            experiment_id,
            run_name=run,
            tags={"ckval.run": run, "ckval.namespace": namespace, "ckval.run_key": run_key},
        )
        # Finished at once: validations keep adding metrics to it as they succeed.
        client.set_terminated(created.info.run_id)
        return created.info.run_id


def _run_key(namespace: str, run: str) -> str:
    """The tag value that marks the MLflow run this sink made for a ckval run."""
    return hashlib.sha256(f"{namespace}/{run}".encode()).hexdigest()[:32]
