"""MLflow sink: validated metrics at the checkpoint's step, in the training's MLflow run.

When report() ran inside an active MLflow run (``mlflow.start_run()``, Ray's
``setup_mlflow``), the metrics go into that run, on its tracking server. Otherwise, or when
this sink is configured with another ``tracking_uri``, they go into a run named after
ckval's run in the experiment ``experiment`` (created on first use, found again by its
``ckval.run_key`` tag). Needs ``pip install 'ckval[mlflow]'``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

from validation_service.sinks import ValidatedMetrics


class MlflowSink:
    kind = "mlflow"

    def __init__(
        self, tracking_uri: str | None = None, experiment: str = "ckval", prefix: str = ""
    ):
        import mlflow  # noqa: F401 - fails here, at build time, when the extra is missing

        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.prefix = prefix
        # (tracking URI, namespace, ckval run) -> the MLflow run named after it
        self._named_runs: dict[tuple[str, str, str], str] = {}

    def log(self, batch: Sequence[ValidatedMetrics]) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        targets: dict[tuple[str, str], list[Metric]] = {}
        now_ms = int(time.time() * 1000)
        for item in batch:
            uri, run_id = self._target(item)
            targets.setdefault((uri, run_id), []).extend(
                Metric(self.prefix + name, value, now_ms, item.step)
                for name, value in item.metrics.items()
            )
        for (uri, run_id), metrics in targets.items():
            if metrics:
                MlflowClient(uri).log_batch(run_id, metrics=metrics)

    def close(self) -> None:
        pass

    def _target(self, item: ValidatedMetrics) -> tuple[str, str]:
        """(tracking URI, run id) that this validation's metrics are logged to."""
        import mlflow

        training = item.trackers.get("mlflow") or {}
        uri = self.tracking_uri or training.get("tracking_uri") or mlflow.get_tracking_uri()
        if training.get("run_id") and training.get("tracking_uri", uri) == uri:
            return uri, training["run_id"]
        key = (uri, item.namespace, item.run)
        if key not in self._named_runs:
            self._named_runs[key] = self._named_run(uri, item.namespace, item.run)
        return uri, self._named_runs[key]

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
        run_key = hashlib.sha256(f"{namespace}/{run}".encode()).hexdigest()[:32]
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
