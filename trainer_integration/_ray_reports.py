"""Hands Ray Train each of ckval's reports off the training thread, in report order.

``ray.train.report`` makes every rank wait for the others (the ranks agree on the
checkpoint's folder name), and in SYNC mode for Ray Train's controller to take the result.
ckval's report() needs neither on the training thread: ckval stores the checkpoint itself
and gives Ray Train a pointer. So the call runs on the worker's checkpoint upload thread,
the one Ray Train's own ASYNC uploads run on: it is a single thread (reports keep their
order), and Ray Train waits for it after the train function returns, before the worker
finishes, so no report is lost when training returns right after its last one.

The parts of Ray Train this needs are internals (``validation_service._ray_compat``).
Where any of them is missing, ``report_line()`` returns None and report() calls
``ray.train.report`` on the training thread in ASYNC mode, Ray Train's public API.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from validation_service import _ray_compat

logger = logging.getLogger(__name__)

# (train context, its line): one Ray Train worker runs one train context at a time.
_current: tuple[Any, RayReportLine] | None = None
_current_lock = threading.Lock()


def report_line() -> RayReportLine | None:
    """This worker's line to Ray Train, or None where Ray Train's internals differ."""
    parts = _ray_compat.upload_line()
    if parts is None:
        return None
    global _current
    with _current_lock:
        if _current is None or _current[0] is not parts.context:
            line = RayReportLine(parts.pool, parts.exceptions)
            parts.callbacks.append(_keep_program_order(line))
            _current = (parts.context, line)
            _listing_waits_for_queued_reports()
        return _current[1]


class RayReportLine:
    """Runs ``ray.train.report`` calls on Ray Train's upload thread, one after another."""

    def __init__(self, pool, exceptions):
        self._pool = pool
        self._exceptions = exceptions
        self._pending = 0
        self._idle = threading.Condition()
        self._inside = threading.local()

    def submit(self, call: Callable[[], None]) -> None:
        """Queues one ``ray.train.report`` call behind the earlier ones; returns at once.

        A call that raises fails the run as Ray Train's failed ASYNC upload does: its
        exception goes to the train function's exception queue.
        """
        with self._idle:
            self._pending += 1
        try:
            self._pool.submit(self._run, call)
        except BaseException:
            self._done()
            raise

    def wait_idle(self) -> None:
        """Returns once every queued call has run (or failed)."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def on_line(self) -> bool:
        """Whether the calling thread is running one of the queued calls."""
        return getattr(self._inside, "active", False)

    def _run(self, call: Callable[[], None]) -> None:
        self._inside.active = True
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - surfaced as Ray Train surfaces its own
            logger.debug("ray.train.report on the upload thread failed", exc_info=True)
            self._exceptions.put(_ray_compat.user_exception(exc))
        finally:
            self._inside.active = False
            self._done()

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()


def _listing_waits_for_queued_reports() -> None:
    """``ray.train.get_all_reported_checkpoints()`` waits for the reports Ray Train has
    been handed; in this worker it first waits for those ckval still has queued, so that
    it lists every report made before it, as with Ray Train's own reports."""
    import ray.train

    listing = getattr(ray.train, "get_all_reported_checkpoints", None)
    if listing is None or getattr(listing, "waits_for_ckval", False):
        return

    @functools.wraps(listing)
    def get_all_reported_checkpoints(*args, **kwargs):
        current = _current
        if current is not None and not current[1].on_line():
            current[1].wait_idle()
        return listing(*args, **kwargs)

    get_all_reported_checkpoints.waits_for_ckval = True
    ray.train.get_all_reported_checkpoints = get_all_reported_checkpoints


def _keep_program_order(line: RayReportLine):
    """A train-context callback: a ``ray.train.report`` made directly by training code
    first waits for ckval's queued ones, so that every rank reports in program order."""
    base = _ray_compat.train_context_callback_base()

    class KeepProgramOrder(base):
        @contextlib.contextmanager
        def on_report(self):
            if not line.on_line():
                line.wait_idle()
            yield

    return KeepProgramOrder()
