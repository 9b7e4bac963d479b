"""A trial's results for Ray Tune, in report order: each checkpoint's once its validation
ended, its reported metrics merged with the validated ones as the registry merges them.

``TuneResults`` lives in the Ray Train controller of one Tune trial. The controller hands
it each report (``add``, on the controller's loop: it only queues); one daemon thread
takes the reports in order, waits in the registry for the validation of the one at the
head of the line, and hands its result to Tune. A later checkpoint validated first waits
for the earlier ones; a validation that failed, timed out or was cancelled releases the
line and its result carries its status without the validated metrics.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from trainer_integration._resume import read_pointer

logger = logging.getLogger(__name__)

CHECKPOINT_PATH = "checkpoint_path"  # the key of Ray's own callback
STATUS_KEY = "ckval_validation_status"
INDEX_KEY = "ckval_report_index"
# A validation that ended: the checkpoint's row says so (validation_service.jobs).
_ENDED = ("VALIDATED", "FAILED", "TIMED_OUT", "CANCELLED")
_WAITING = ("PENDING", "RUNNING")


@dataclasses.dataclass(frozen=True)
class TrialLink:
    """The Tune trial a Ray Train run belongs to, and what Tune checks of its results."""

    trial_id: str
    experiment: str
    # The metrics Tune's strict check asks of every result (None: not known).
    checked: tuple[str, ...] | None
    strict: bool  # False with TUNE_DISABLE_STRICT_METRIC_CHECKING=1

    @property
    def run_tags(self) -> dict[str, str]:
        return {"tune_trial_id": self.trial_id, "tune_experiment": self.experiment}


@dataclasses.dataclass(frozen=True)
class _Report:
    """One report as Ray Train's controller saw it."""

    metrics: dict[str, Any]  # rank 0's
    index: int | None = None  # the ckval checkpoint's report index its pointer names
    path: str | None = None  # the folder Ray Train holds, when it is no checkpoint of ckval


_NOT_YET = object()  # the report's validation has not ended


class TuneResults:
    """The results of one trial's Ray Train run, handed to Tune in report order."""

    def __init__(
        self,
        run: str,
        trial: TrialLink,
        settings: Any,
        send: Callable[[dict[str, Any]], None],
        *,
        validated_only: bool,
        poll_interval_s: float,
    ):
        self.run = run
        self._trial = trial
        self._settings = settings
        self._send = send
        self._validated_only = validated_only
        self._poll_interval_s = poll_interval_s
        self._line: collections.deque[_Report] = collections.deque()
        self._changed = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._registry = None  # opened on the thread
        self._tagged = False
        self._warned: set[str] = set()
        self.forwarded = 0

    # ------------------------------------------------------- the controller's side
    def add(self, metrics: dict[str, Any], checkpoint) -> None:
        """Queues one report (``checkpoint``: the one Ray Train holds, or None)."""
        report = _report_of(dict(metrics), checkpoint)
        with self._changed:
            self._line.append(report)
            self._changed.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._forward_in_order, name="ckval-tune-results", daemon=True
                )
                self._thread.start()

    def finish(self, warn_every_s: float = 60.0) -> None:
        """Returns once every queued report's result reached Tune (or was held back).

        The run's last validations end after training: Tune must see them before the
        trial's ``fit()`` returns and the trial ends.
        """
        with self._changed:
            while self._line and not self._closed:
                if not self._changed.wait(timeout=warn_every_s) and self._line:
                    logger.warning(
                        "Tune trial %s waits for the validation of %d report(s) of ckval run "
                        "%r (see `ckval jobs %s`): is the ckval service running?",
                        self._trial.trial_id,
                        len(self._line),
                        self.run,
                        self.run,
                    )
        self.close()

    def close(self) -> None:
        """Stops forwarding (the run was aborted, or Tune's trial is gone)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        registry, self._registry = self._registry, None
        if registry is not None:
            registry.close()

    # ---------------------------------------------------------- the thread's side
    def _forward_in_order(self) -> None:
        while True:
            with self._changed:
                while not self._line and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                head = self._line[0]
            try:
                result = self._result_of(head)
            except Exception:  # noqa: BLE001 - the registry may be briefly unreachable
                logger.debug("looking up a report of run %r failed", self.run, exc_info=True)
                result = _NOT_YET
            if result is _NOT_YET:
                with self._changed:
                    self._changed.wait(timeout=self._poll_interval_s)
                continue
            if result is not None and not self._deliver(result):
                self.close()  # Tune's trial is gone: nobody takes results any more
                return
            with self._changed:
                self._line.popleft()
                self._changed.notify_all()

    def _deliver(self, result: dict[str, Any]) -> bool:
        """Hands one result to Tune unless Tune's strict check would refuse it."""
        if not self._accepted_by_tune(result):
            return True
        try:
            self._send(result)
        except Exception:  # noqa: BLE001 - Ray's queue: its trial actor has ended
            logger.debug("Tune trial %s takes no more results", self._trial.trial_id, exc_info=True)
            return False
        self.forwarded += 1
        return True

    def _accepted_by_tune(self, result: dict[str, Any]) -> bool:
        """False for a result without a metric Tune checks, which Tune's strict metric
        check would refuse by ending the whole search; warns once per trial and metric."""
        missing = [name for name in self._trial.checked or () if name not in result]
        for name in missing:
            if name in self._warned:
                continue
            self._warned.add(name)
            status = result.get(STATUS_KEY)
            what = (
                f"the validation of report {result[INDEX_KEY]} ended {status}"
                if status not in (None, "VALIDATED")
                else "neither its validation nor its report gave it"
            )
            held = (
                "is not handed to Tune (Tune's strict metric check would end the search on it)"
                if self._trial.strict
                else "is handed to Tune, whose schedulers skip it"
            )
            logger.warning(
                "Tune trial %s (ckval run %r): a result has no %r, which Tune's scheduler or "
                "search checks: %s. It %s; its keys: %s. Report or validate %r, or set "
                "TuneConfig's metric to one the results carry. Said once per trial.",
                self._trial.trial_id,
                self.run,
                name,
                what,
                held,
                ", ".join(sorted(result)),
                name,
            )
        return not (missing and self._trial.strict)

    def _result_of(self, report: _Report) -> Any:
        """The report's result for Tune, None when it is not forwarded, or _NOT_YET."""
        if report.index is None:
            # No checkpoint of ckval's (or a report of several ranks that never became
            # one): forwarded as Ray's callback does, unless only validated results go
            # to Tune.
            if self._validated_only:
                return None
            if report.path is None:
                return report.metrics
            return {**report.metrics, CHECKPOINT_PATH: report.path}
        record = self._record_of(report)
        if record is None or record.validation_status in _WAITING:
            return _NOT_YET
        self._tag_run()
        if record.validation_status not in _ENDED:  # NONE: reported without a validation
            if self._validated_only:
                return None
        return {
            **report.metrics,
            **record.metrics,
            CHECKPOINT_PATH: record.uri,
            STATUS_KEY: record.validation_status,
            INDEX_KEY: record.report_index,
        }

    def _record_of(self, report: _Report):
        from validation_service.errors import RunNotFound

        try:
            records = self.registry.checkpoints(self.run)
        except RunNotFound:
            return None
        return next((r for r in records if r.report_index == report.index), None)

    @property
    def registry(self):
        if self._registry is None:
            from validation_service.registry.registry import Registry

            self._registry = Registry(settings=self._settings)
        return self._registry

    def _tag_run(self) -> None:
        """Tags the trial's ckval run with its Tune trial and experiment, once."""
        if self._tagged:
            return
        run_id = self.registry.find_run_id(self.run)
        if run_id is not None:
            self.registry.ledger.tag_run(run_id, self._trial.run_tags)
            self._tagged = True


def _report_of(metrics: dict[str, Any], checkpoint) -> _Report:
    """The report: the report index of the ckval checkpoint its pointer names, or (no
    pointer, or the pointer of a report that never became a checkpoint) its folder."""
    if checkpoint is None:
        return _Report(metrics)
    try:
        pointer = read_pointer(checkpoint)
    except (OSError, ValueError):
        pointer = None
    if pointer is None:
        return _Report(metrics, path=checkpoint.path)
    if not pointer.get("complete", True):
        return _Report(metrics)  # no checkpoint came of it: its metrics alone
    return _Report(metrics, index=int(pointer["report_index"]))
