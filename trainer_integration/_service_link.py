"""The reporting side's link to the service: the settings a reporting process uses,
finding (or starting) the service actor, warming its workers, and nudging it."""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from trainer_integration._imports import import_once
from validation_service.secrets import worker_settings

if TYPE_CHECKING:
    from validation_service.config import Settings

logger = logging.getLogger(__name__)

# Reports closer together than this share one nudge (adds at most this to dispatch).
NUDGE_GAP_S = 0.02


def resolve_settings() -> Settings:
    """This process's settings: its CKVAL_* variables, completed from the running service
    where Ray's runtime_env withheld secrets or set nothing (secrets.worker_settings)."""
    from validation_service.config import get_settings  # pydantic: on first use

    settings = get_settings()
    return worker_settings(settings, lambda: _service_settings(settings))


def _service_settings(settings: Settings) -> Settings:
    """The running service's full settings, through an actor call (not shown by Ray)."""
    import ray

    from validation_service.config import Settings

    if not ray.is_initialized():
        raise RuntimeError("this process is not connected to Ray")
    actor = ray.get_actor(settings.service_name, namespace=settings.ray_namespace)
    return Settings.model_validate_json(ray.get(actor.reporter_settings_json.remote(), timeout=30))


class ServiceLink:
    """One reporter's way to the service actor: found, or started if none runs (the
    embedded default), on first use; nudged from a daemon thread."""

    def __init__(self, settings: Callable[[], Settings]):
        self._settings = settings
        self._handle = None
        self._lock = threading.Lock()
        self._nudger: _Nudger | None = None

    def handle(self):
        """The running service's handle, starting the service if none runs."""
        with self._lock:
            if self._handle is None:
                ValidationService = import_once("validation_service.service").ValidationService

                settings = self._settings()
                self._handle = ValidationService.get(settings) or ValidationService.start(
                    settings=settings
                )
            return self._handle

    def warm_up(self) -> None:
        """Asks the service for worker processes for a run's first validations, with
        the frameworks this process imported (the service keeps those it allows); not
        waited for."""
        # The executor's modules import SQLAlchemy: through import_once, as every import
        # of it on a reporter's threads.
        handle = self.handle()
        modules = import_once("validation_service.executors.ray_task").WARM_UP_MODULES
        handle.warm_up(name for name in modules if name in sys.modules)

    def nudge(self) -> None:
        """Tells the service there is new work (best effort: it also polls).

        Nudges go out from a background thread, which finds (or starts) the service
        first; reports that arrive faster than one per NUDGE_GAP_S share a nudge, and
        report() never waits for the call. A pending nudge is sent before the process
        exits, so that a script's last reports are not left waiting for a poll.
        """
        with self._lock:
            if self._nudger is None:
                self._nudger = _Nudger(self._send_nudge)
                atexit.register(self._nudger.flush, self._settings().delivery_timeout_s)
        self._nudger.request()

    def _send_nudge(self) -> bool:
        try:
            self.handle().nudge()
            return True
        except Exception:  # noqa: BLE001 - the job is durable; the service will poll it
            logger.warning("could not reach the ckval service to nudge it; it will poll")
            logger.debug("nudge failed", exc_info=True)
            with self._lock:
                self._handle = None
            return False


class _Nudger:
    """Sends the nudges of one reporter from a daemon thread, coalescing bursts."""

    def __init__(self, send: Callable[[], bool]):
        self._send = send
        self._wanted = threading.Event()
        self._idle = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._loop, name="ckval-nudge", daemon=True).start()

    def request(self) -> None:
        with self._lock:
            self._idle.clear()
            self._wanted.set()

    def flush(self, timeout_s: float) -> None:
        """Waits until no nudge is pending (at exit: the service may still be starting)."""
        self._idle.wait(timeout_s)

    def _loop(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            self._send()
            time.sleep(NUDGE_GAP_S)
            with self._lock:
                if not self._wanted.is_set():
                    self._idle.set()
