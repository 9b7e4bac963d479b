"""Runs reported from one process: each run's one reporter, the run that ``start_run()``
names, the Client that reports outside Ray Train, and the name of a Ray Train run."""

from __future__ import annotations

import dataclasses
import inspect
import threading
from typing import Any

from trainer_integration._reporter import RunReporter
from trainer_integration._request import ReportOptions, prepare_report
from trainer_integration._service_link import resolve_settings
from trainer_integration._stopping import attach, forget
from validation_service.errors import InvalidInput
from validation_service.names import RULE as NAME_RULE
from validation_service.names import check_name, is_safe_name, suggested_name

_reporters: dict[str, RunReporter] = {}
_reporters_lock = threading.Lock()
_current_run: str | None = None


def run_reporter(run: str, settings=None, *, start_service: bool = True) -> RunReporter:
    """The run's reporter in this process, made on first use."""
    check_name("run name", run)
    with _reporters_lock:
        reporter = _reporters.get(run)
        if reporter is None:
            reporter = _reporters[run] = RunReporter(
                run, settings or resolve_settings(), start_service=start_service
            )
        return reporter


def current_run() -> str | None:
    """The run of ``start_run()``, which report() outside Ray Train records into."""
    return _current_run


def ray_train_run_name(context) -> str:
    """The ckval run of a Ray Train run: its RunConfig name, which must be a safe name.

    Ray Train takes any string as ``RunConfig(name=...)`` and makes it a folder of its
    own storage; ckval refuses rather than maps the names it cannot store as one folder
    (with '/', spaces, a leading '.'): the run name is what users query by
    (``registry.checkpoints(name)``, ``ckval runs``, ``/runs/{name}``), and a mapped
    name would not find their run. Ray's default name, ``ray_train_run-<date>_<time>``,
    is valid.
    """
    name = context.get_experiment_name()
    if not is_safe_name(name):
        raise InvalidInput(
            f"Ray Train run name {name!r} (RunConfig(name=...)) cannot name a ckval run: "
            f"use {NAME_RULE}. Rename the run, for example "
            f"RunConfig(name={suggested_name(name)!r}); nothing was stored."
        )
    return name


def start_run(name: str, *, start_service: bool = True, append: bool = False) -> Client:
    """Names the run that report() outside Ray Train records into; returns its Client.

    ``start_service=False`` never connects to Ray from this process: the service, running
    elsewhere, finds the reported validations by polling the registry (within
    CKVAL_POLL_INTERVAL_S). For processes that have no Ray of their own (Dask workers).
    A name whose run ended starts a new attempt, unless ``append`` (see Client). Use the
    Client as a context manager, or close() it, to mark the run FINISHED (FAILED on an
    exception).
    """
    global _current_run
    client = Client(name, start_service=start_service, append=append)
    _current_run = name
    return client


class Client:
    """Reports checkpoints of one run from any Python process (no Ray Train needed).

    The run is RUNNING until close() (or the end of a ``with Client(...)`` block) marks it
    FINISHED, or FAILED when the block raised. A run name used again after its run ended
    starts a new attempt (report indices from 0; best_checkpoints and latest_checkpoint
    read the latest attempt); ``append=True`` keeps adding to the last attempt instead.
    """

    def __init__(
        self, run: str, settings=None, *, start_service: bool = True, append: bool = False
    ):
        self.run = run
        settings = settings or resolve_settings()
        if append and not settings.append:
            settings = settings.model_copy(update={"append": True})
        self._reporter = run_reporter(run, settings, start_service=start_service)
        self._reporter.ensure_run()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    def close(self, *, failed: bool = False) -> None:
        """Delivers what is pending and ends the run: FINISHED, or FAILED when ``failed``
        or when a report could not be delivered (which is raised)."""
        global _current_run
        from validation_service.jobs import RunStatus

        try:
            self.flush()
        except Exception:
            failed = True
            raise
        finally:
            status = RunStatus.FAILED if failed else RunStatus.FINISHED
            self._reporter.writer.ledger.finish_run(self.run, status)
            with _reporters_lock:
                if _reporters.get(self.run) is self._reporter:
                    del _reporters[self.run]  # the next Client of this name starts afresh
            forget(self.run)  # its stop watcher too
            if _current_run == self.run:
                _current_run = None

    @property
    def registry(self):
        return self._reporter.registry

    def report(self, metrics: dict, checkpoint=None, **options: Any) -> int | None:
        """As trainer_integration.report(), with its keyword options; returns the report
        index of the checkpoint (in ASYNC mode once it is reserved)."""
        prepared = prepare_report(metrics, checkpoint, report_options(options))
        if checkpoint is None:
            return None
        attach(self.run, self._reporter)
        index, _ = self._reporter.report(prepared, checkpoint)
        return index

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits for ASYNC uploads to be registered; raises if one failed."""
        self._reporter.flush(timeout_s)

    def wait(
        self, timeout_s: float = 300.0, *, progress: bool = False, raise_on_failure: bool = False
    ) -> None:
        """Waits for every validation of this run to finish (see Registry.wait)."""
        self.flush(timeout_s)
        self._reporter.registry.wait(
            self.run, timeout_s=timeout_s, progress=progress, raise_on_failure=raise_on_failure
        )


def report_options(options: dict[str, Any]) -> ReportOptions:
    """Client.report()'s keyword options, which are report()'s (written once, there)."""
    unknown = sorted(set(options) - {field.name for field in dataclasses.fields(ReportOptions)})
    if unknown:
        raise TypeError(f"Client.report() got an unexpected keyword argument {unknown[0]!r}")
    return ReportOptions(**options)


def sign_client_report(report) -> None:
    """Gives Client.report report()'s signature with ``self``, returning the report index:
    what help(Client.report) shows."""
    front = inspect.signature(report)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    Client.report.__signature__ = front.replace(
        parameters=[this, *front.parameters.values()], return_annotation="int | None"
    )
