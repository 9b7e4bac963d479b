"""RunStatusCallback: marks the ckval run FINISHED or FAILED when its Ray Train run ends.

Ray Train's ``UserCallback`` has hooks for reports and for worker exceptions only,
and a worker exception may be followed by a restart (``FailureConfig(max_failures=...)``)
in which the run goes on: it does not end the run. The controller calls
``after_controller_finish(result)`` once, with the final ``Result``, when the run is over;
this callback implements that hook of Ray Train's ``ControllerCallback`` (an internal
class: ``validation_service._ray_compat``). An abort (Ctrl-C on the driver) is seen as the
controller's move to its ABORTED state, which every supported release reports.
``RunConfig(callbacks=[...])`` accepts any Ray Train callback and hands those that are
not ``UserCallback``s to the controller, which runs on the driver's node.

    trainer = TorchTrainer(..., run_config=RunConfig(name="r", callbacks=[RunStatusCallback()]))

Without changing the training script, set in the driver's environment
``RAY_TRAIN_CALLBACKS=trainer_integration.run_status.RunStatusCallback``: Ray Train then
adds it to every trainer.
"""

from __future__ import annotations

import logging

from trainer_integration._service_link import resolve_settings
from validation_service import _ray_compat
from validation_service.config import Settings
from validation_service.errors import RunNotFound
from validation_service.jobs import RunStatus

logger = logging.getLogger(__name__)


class RunStatusCallback(_ray_compat.controller_callback_base()):
    """Ends the ckval run of a Ray Train run: FINISHED when ``fit()`` succeeds, FAILED when
    it fails or is aborted. A restart after a worker failure ends nothing: reports go on in
    the same run attempt.

    ``settings``: the registry to write to; by default the driver's CKVAL_* settings,
    read when the callback is made (the controller is another process).
    """

    def __init__(self, settings: Settings | None = None):
        self._settings = settings or resolve_settings()
        self._run: str | None = None
        self._ended = False

    def after_controller_start(self, train_run_context) -> None:
        self._run = train_run_context.get_run_config().name

    def after_controller_finish(self, result) -> None:
        self._end(RunStatus.FAILED if result.error is not None else RunStatus.FINISHED)

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if _ray_compat.is_aborted_state(current_state):
            self._end(RunStatus.FAILED)

    def before_controller_abort(self) -> None:  # Ray 2.55+: before the workers are stopped
        self._end(RunStatus.FAILED)

    def _end(self, status: RunStatus) -> None:
        if self._run is None or self._ended:
            return
        self._ended = True
        from trainer_integration._reporter import RunReporter

        # Opening a reporter of the run first registers the SYNC reports its workers stored
        # and did not live to register (a train function that raised right after one).
        reporter = RunReporter(self._run, self._settings, start_service=False)
        try:
            reporter.writer.ledger.finish_run(self._run, status)
        except RunNotFound:
            pass  # it reported no checkpoint (an earlier, ended attempt is left as it is)
        except Exception:  # noqa: BLE001 - training's outcome stands; say why the run did not end
            logger.exception("could not mark ckval run %r %s", self._run, status.value)
        finally:
            reporter.close()
