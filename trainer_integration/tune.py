"""Ray Tune's schedulers on validated metrics: the ``TuneReportCallback`` of a trial's
Ray Train run, which hands Tune each checkpoint's result once its validation ended.

Ray's ``ray.tune.integration.ray_train.TuneReportCallback`` hands Tune the metrics of
each report as it is made, so a metric that a validation measures later never reaches
ASHA, HyperBand, median stopping or PBT. Ray's pattern for Ray Train inside Tune, with one
import changed:

    from trainer_integration.tune import TuneReportCallback

    def train_driver(config):  # one Tune trial
        TorchTrainer(
            train_per_worker,  # calls trainer_integration.report(..., validate_fn=...)
            train_loop_config=config,
            run_config=ray.train.RunConfig(
                name=f"train-trial_id={ray.tune.get_context().get_trial_id()}",
                callbacks=[TuneReportCallback()],
            ),
        ).fit()

See docs/tune.md: what is forwarded when, and the limits.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from trainer_integration._service_link import resolve_settings
from trainer_integration._tune_results import TrialLink, TuneResults
from validation_service import _ray_compat
from validation_service.config import Settings
from validation_service.errors import InvalidInput

__all__ = ["TuneReportCallback"]

_STRICT_CHECK_OFF = "TUNE_DISABLE_STRICT_METRIC_CHECKING"
_DRAIN_TIMEOUT_S = 60.0

logger = logging.getLogger(__name__)


class TuneReportCallback(*_ray_compat.tune_callback_bases()):
    """Hands Ray Tune one result per report of the trial's Ray Train run, in report order.

    A checkpoint reported with a validation (``trainer_integration.report(...,
    validate_fn=...)``, or the drop-in's ``validation=``) reaches Tune once its validation
    ended: the metrics that report carried merged with the validated ones (a validated
    value overrides a reported one of the same name, as the registry shows them), with
    ``checkpoint_path`` (the stored checkpoint, the model files),
    ``ckval_validation_status`` and ``ckval_report_index``. A later checkpoint validated
    first waits for the earlier ones. A validation that failed, timed out or was
    cancelled releases the line; its result carries its status without the validated
    metrics.

    ``validated_only`` (default True): reports without a validation (no checkpoint, or a
    checkpoint without a validate_fn) are not handed to Tune. Their results carry no
    validated metric, and a result without the metric of Tune's scheduler or search
    stops the whole search in Tune's strict metric check. With False they are handed
    over as Ray's callback does, in report order.

    A result without a metric that Tune checks (TuneConfig's, the scheduler's, the search
    algorithm's, read from the experiment's Tuner) is held back, with one warning per
    trial naming the metric; with ``TUNE_DISABLE_STRICT_METRIC_CHECKING=1`` in the
    trial's environment it is handed over, and Tune's schedulers skip it.

    The trial's ckval run (its ``RunConfig(name=...)``) gets the run tags
    ``tune_trial_id`` and ``tune_experiment``:
    ``Registry().best_checkpoints(None, metric, tags={"tune_experiment": name})`` ranks
    the whole search. Made in the trial (outside a Tune session it raises, as Ray's
    does); it works in the Ray Train controller, which waits, before ``fit()`` returns,
    until every report's result has reached Tune.
    """

    def __init__(
        self,
        *,
        validated_only: bool = True,
        poll_interval_s: float = 0.2,
        settings: Settings | None = None,
    ):
        if not isinstance(validated_only, bool):
            raise InvalidInput(f"validated_only must be True or False, got {validated_only!r}")
        if (
            not isinstance(poll_interval_s, (int, float))
            or isinstance(poll_interval_s, bool)
            or not 0 < poll_interval_s <= 60
        ):
            raise InvalidInput(
                f"poll_interval_s must be a number of seconds in (0, 60], got {poll_interval_s!r}"
            )
        import ray.tune
        from ray.tune.integration.ray_train import TuneReportCallback as RayTuneReportCallback

        # Ray's own callback holds the trial's queue to Tune; made first, it raises
        # outside a Tune session exactly as Ray's does.
        self._to_tune = RayTuneReportCallback()
        context = ray.tune.get_context()
        self._trial = TrialLink(
            trial_id=context.get_trial_id(),
            experiment=context.get_experiment_name(),
            checked=_ray_compat.tune_checked_metrics(context.get_storage()),
            strict=os.environ.get(_STRICT_CHECK_OFF, "0") != "1",
        )
        self._settings = settings or resolve_settings()
        self._validated_only = validated_only
        self._poll_interval_s = float(poll_interval_s)
        self._results: TuneResults | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_results"] = None  # threads stay where they run
        return state

    # ------------------------------------------------------ Ray Train's controller
    def after_controller_start(self, train_run_context) -> None:
        self._results = TuneResults(
            train_run_context.get_run_config().name,
            self._trial,
            self._settings,
            self._send,
            validated_only=self._validated_only,
            poll_interval_s=self._poll_interval_s,
        )

    def after_report(self, training_report, metrics: list[dict[str, Any]]) -> None:
        if self._results is not None:
            self._results.add(metrics[0] if metrics else {}, training_report.checkpoint)

    def after_controller_finish(self, result) -> None:
        if self._results is not None:
            self._results.finish()
            # fit() returns next, and the trial's function with it: the last result must
            # have left the trial's queue before Tune's own last result comes.
            if not _ray_compat.wait_tune_queue_drained(self._to_tune, _DRAIN_TIMEOUT_S):
                logger.warning(
                    "Tune trial %s has not taken ckval run %r's last result within %.0f s",
                    self._trial.trial_id,
                    self._results.run,
                    _DRAIN_TIMEOUT_S,
                )

    def before_controller_abort(self) -> None:  # Ray 2.55+: Ctrl-C on the driver
        if self._results is not None:
            self._results.close()

    def _send(self, result: dict[str, Any]) -> None:
        # Ray's callback puts the result on the trial's queue, which Tune reads.
        self._to_tune.after_report(run_context=None, metrics=[result], checkpoint=None)
