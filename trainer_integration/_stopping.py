"""should_stop(): the registry's stop decision for a run, watched on a daemon thread of
the process, and given to every rank of a distributed run as rank 0's one answer."""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from trainer_integration._context import started_run as _started_run
from trainer_integration._context import train_context as _ray_train_context
from validation_service.errors import InvalidInput

logger = logging.getLogger(__name__)

# How often a watcher looks at the registry at most, whatever CKVAL_POLL_INTERVAL_S says:
# the service judges a policy as soon as a validation ends, so a slower look only adds lag
# (one indexed read of a few rows; four a second per watching process).
MAX_WATCH_INTERVAL_S = 0.25
# The longest wait between two looks while the registry cannot be read: a decision
# recorded meanwhile reaches training within this of the registry answering again.
MAX_BACKOFF_S = 2.0


class StopWatcher:
    """Polls ``registry.stop_decision(run)`` on a daemon thread and keeps the answer.

    It looks every ``min(CKVAL_POLL_INTERVAL_S, 0.25 s)``, and at once when ``wake()`` is
    called (after each of the run's registrations in this process). The registry is the
    run's reporter's (found or made on this thread when none is given), opened on this
    thread, never on the training thread.
    """

    def __init__(self, run: str, reporter: Any = None) -> None:
        self.run = run
        self._reporter = reporter
        self._stopped = False
        self._looked = threading.Event()
        self._wake = threading.Event()
        self._followed: list[Any] = []
        self._follow_lock = threading.Lock()
        self._closed = threading.Event()
        if reporter is not None:
            self.follow(reporter)
        self._thread = threading.Thread(
            target=self._watch, name=f"ckval-stop-watch-{run}", daemon=True
        )
        self._thread.start()

    @property
    def stopped(self) -> bool:
        """The latest answer: a standing (not overridden) decision to stop the run."""
        return self._stopped

    def follow(self, reporter: Any) -> None:
        """Wakes after each registration of ``reporter`` too (a later Client of the run)."""
        with self._follow_lock:
            if any(followed is reporter for followed in self._followed):
                return
            self._followed.append(reporter)
        reporter.after_registration(self.wake)

    def wake(self) -> None:
        """Looks again now (a registration was delivered)."""
        self._wake.set()

    def wait_for_first_look(self, timeout_s: float) -> bool:
        """Whether the registry was read once within ``timeout_s`` (for tests and tools)."""
        return self._looked.wait(timeout_s)

    def look(self) -> None:
        """One read of the run's decision; an overridden decision reads as not stopped."""
        if self._reporter is None:
            from trainer_integration._client import run_reporter

            self._reporter = run_reporter(self.run)
            self.follow(self._reporter)
        decision = self._reporter.registry.stop_decision(self.run)
        self._stopped = decision is not None and decision.stopped
        self._looked.set()

    def close(self) -> None:
        """Stops watching (the run ended in this process); the last answer stays."""
        self._closed.set()
        self._wake.set()

    def _watch(self) -> None:
        failures = 0
        while not self._closed.is_set():
            try:
                self.look()
                if failures:
                    logger.warning("should_stop(): run %r's stop decision is read again", self.run)
                failures = 0
                interval = min(self._reporter.settings.poll_interval_s, MAX_WATCH_INTERVAL_S)
            except Exception as exc:  # noqa: BLE001 - the next look tries again; training goes on
                if failures == 0:
                    # Said once until a look succeeds: should_stop() keeps its last
                    # answer meanwhile, which is no decision if it never read one.
                    logger.warning(
                        "should_stop() cannot read run %r's stop decision from the registry "
                        "(%s: %s); it answers %s until it can, and tries again every %.0f s",
                        self.run,
                        type(exc).__name__,
                        exc,
                        self._stopped,
                        MAX_BACKOFF_S,
                    )
                logger.debug("reading the stop decision of run %r failed", self.run, exc_info=True)
                failures += 1
                interval = min(0.25 * 2.0**failures, MAX_BACKOFF_S)
            self._wake.wait(interval)
            self._wake.clear()


_watchers: dict[str, StopWatcher] = {}
_watchers_lock = threading.Lock()


def watch(run: str, reporter: Any = None) -> StopWatcher:
    """The run's watcher in this process, started by the first should_stop() of the run;
    it wakes after each registration of the run's reporter."""
    with _watchers_lock:
        watcher = _watchers.get(run)
        if watcher is None:
            watcher = _watchers[run] = StopWatcher(run, reporter)
        elif reporter is not None:
            watcher.follow(reporter)
        return watcher


def attach(run: str, reporter: Any) -> None:
    """After a report: the run's watcher, if should_stop() started one, looks again after
    each registration of ``reporter`` too. Starts none: a process that never asks
    should_stop() never reads the run's decision."""
    with _watchers_lock:
        watcher = _watchers.get(run)
    if watcher is not None:
        watcher.follow(reporter)


def forget(run: str) -> None:
    """Stops the run's watcher, if any: its Client closed the run in this process."""
    with _watchers_lock:
        watcher = _watchers.pop(run, None)
    if watcher is not None:
        watcher.close()


def should_stop(run: str | None = None) -> bool:
    """Whether the run's stop policy has decided that training should stop.

    Answers from what this process already holds: a daemon thread, started by the run's
    first should_stop() (which answers False), reads the registry's decision in the
    background, every ``CKVAL_POLL_INTERVAL_S`` (at most 0.25 s) and after each of the
    run's registrations, so the answer trails the decision by up to 0.25 s. A decision
    overridden with ``resume_despite_stop`` reads as not stopped.

    The run is the Ray Train run's name (``RunConfig(name=...)``) inside a Ray Train
    worker, else ``run=``, else the run of ``start_run()``.

    Every rank gets rank 0's answer: where the ranks form a ``torch.distributed`` process
    group (TorchTrainer, Lightning's and Transformers' DDP, the Dask launcher) through
    ``broadcast_object_list``; in other Ray Train runs (TensorflowTrainer, or no process
    group) through ``ray.train.collective.broadcast_from_rank_zero``. That is a
    collective: **every rank must call should_stop() at the same point of its loop**
    (e.g. right after each report()), or the ranks wait for each other.
    """
    context = _ray_train_context()
    if context is not None:
        return _in_ray_train(context, run)
    run = run or _started_run()
    if run is None:
        raise InvalidInput(
            "should_stop() outside a Ray Train worker needs a run: pass "
            "should_stop(run='my-run'), or call trainer_integration.start_run('my-run') "
            "first (inside a Ray Train worker the run is RunConfig(name=...))."
        )
    rank, world_size = _torch_process_group() or (0, 1)
    answer = watch(run).stopped if rank == 0 else None
    return _torch_broadcast(answer) if world_size > 1 else bool(answer)


def _in_ray_train(context, run: str | None) -> bool:
    from trainer_integration._client import ray_train_run_name

    name = ray_train_run_name(context)
    if run is not None and run != name:
        raise InvalidInput(
            f"should_stop(run={run!r}) inside the Ray Train run {name!r}: there the run "
            "is RunConfig(name=...); leave run= out."
        )
    rank, world_size = context.get_world_rank(), context.get_world_size()
    answer = watch(name).stopped if rank == 0 else None
    if world_size <= 1:
        return bool(answer)
    if _torch_process_group() == (rank, world_size):
        # TorchTrainer (also Lightning's and Transformers' DDP): the ranks' own process
        # group carries the answer.
        return _torch_broadcast(answer)
    from ray.train.collective import broadcast_from_rank_zero

    # On the training thread, where the training code asks: in program order with its
    # reports and its own collectives, on every rank alike.
    return bool(broadcast_from_rank_zero(answer))


def _torch_process_group() -> tuple[int, int] | None:
    """(rank, world size) of the default torch.distributed group, or None without one."""
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def _torch_broadcast(answer: bool | None) -> bool:
    import torch.distributed as dist

    box = [answer]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])
