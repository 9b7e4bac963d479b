"""Delivering reports: the one backoff used by every retry of the reporting side, the
reports under way in the background, and the error raised for those that failed."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, TypeVar

from validation_service.errors import CkvalError

if TYPE_CHECKING:
    from validation_service.errors import RegistryUnavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")


def with_backoff(
    call: Callable[[], T],
    *,
    timeout_s: float,
    first_delay_s: float = 0.5,
    max_delay_s: float = 10.0,
    on_first_retry: Callable[[RegistryUnavailable], None] | None = None,
) -> T:
    """``call()``, tried again with exponential backoff while it raises
    RegistryUnavailable, until ``timeout_s`` would pass; then that error is raised."""
    from validation_service.errors import RegistryUnavailable  # imports SQLAlchemy

    deadline = time.monotonic() + timeout_s
    delay = first_delay_s
    while True:
        try:
            return call()
        except RegistryUnavailable as exc:
            if time.monotonic() + delay > deadline:
                raise
            if delay == first_delay_s and on_first_retry is not None:
                on_first_retry(exc)
            time.sleep(delay)
            delay = min(delay * 2, max_delay_s)


def unavailable_reason(exc: RegistryUnavailable) -> str:
    """The driver's error class behind an unreachable registry, for a log line."""
    return type(exc.orig).__name__ if exc.orig is not None else "unknown"


class ReportNotDelivered(CkvalError):
    """Reports that report() acknowledged but that were never stored or registered."""

    def __init__(self, run: str, failures: list[tuple[int | None, BaseException]]):
        self.run = run
        self.report_indices = [index for index, _ in failures]
        last = failures[-1][1]
        super().__init__(
            f"{len(failures)} report(s) of run {run!r} (report indices "
            f"{self.report_indices}) were not delivered: {type(last).__name__}: {last}. "
            "If the registry was unreachable, their checkpoints are in storage: check "
            "CKVAL_DATABASE_URL and report them again. If storing failed, check the "
            "checkpoint folder and CKVAL_STORAGE."
        )


@dataclasses.dataclass(frozen=True)
class StoredReport:
    """A report whose checkpoint is being copied and registered in the background.

    Its report index is reserved in the registry on the reserving thread: ``index`` and
    ``uri`` wait for that reservation, not for the copy.
    """

    reserved: Future  # of (report index, the URI the checkpoint is stored at)
    stored: Future  # done once training may drop its folder
    registered: Future  # done once the checkpoint is in the registry (validation enqueued)

    @property
    def index(self) -> int:
        return self.reserved.result()[0]

    @property
    def uri(self) -> str:
        return self.reserved.result()[1]

    @classmethod
    def finished(cls, index: int, uri: str) -> StoredReport:
        """A report that was stored and registered before it was returned."""
        return cls(_done((index, uri)), _done(None), _done(None))


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class PendingReports:
    """The background deliveries of one run's reports in this process."""

    def __init__(self, run: str):
        self.run = run
        self._pending: list[tuple[int | Future, Future]] = []
        self._lock = threading.Lock()

    def add(self, index: int | Future, future: Future) -> None:
        """Remembers a delivery under its report index (or its reservation's future)."""
        with self._lock:
            self._pending.append((index, future))

    def raise_undelivered(self) -> None:
        """Raises ReportNotDelivered for background reports that failed for good."""
        failed = []
        with self._lock:
            still_pending = []
            for index, future in self._pending:
                if not future.done():
                    still_pending.append((index, future))
                elif future.exception() is not None:
                    failed.append((_reserved_index(index), future.exception()))
            self._pending = still_pending
        if failed:
            raise ReportNotDelivered(self.run, failed)

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits for every delivery under way; raises if one failed."""
        with self._lock:
            pending = list(self._pending)
        for _, future in pending:
            try:
                future.result(timeout=timeout_s)
            except Exception:  # noqa: BLE001 - collected and raised below
                pass
        self.raise_undelivered()


def _reserved_index(index: int | Future) -> int | None:
    """A report index, or None for a report whose index could not be reserved."""
    if not isinstance(index, Future):
        return index
    return None if index.exception() is not None else index.result()[0]
