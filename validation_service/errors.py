"""Errors a user can act on: each names the run, checkpoint or job and what to do."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any


class CkvalError(Exception):
    """Base class of every error ckval raises on purpose."""

    def __reduce__(self):
        # ckval's errors cross processes (Ray tasks, Ray Train workers). Pickle rebuilds an
        # exception by calling its class with self.args, which is the message alone, not
        # the arguments of a subclass's __init__: rebuild from the message and the fields.
        return (_rebuild_error, (type(self), str(self), dict(self.__dict__)))


def on_ckval_error(answer: Callable[[CkvalError], Any]) -> Callable:
    """A decorator: a CkvalError the function raises becomes ``answer(error)``, for the
    front ends that turn it into their own answer (an HTTP error body, a CLI exit)."""

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except CkvalError as exc:
                return answer(exc)

        return wrapper

    return decorate


def _rebuild_error(cls: type[CkvalError], message: str, fields: dict) -> CkvalError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(fields)
    return error


class InvalidInput(CkvalError, ValueError):
    """An argument that ckval cannot store or act on; nothing was written."""


class InvalidSettings(InvalidInput):
    """A CKVAL_* setting (or the argument given in its place) that ckval cannot use.

    The message names each bad variable and what it must be; nothing was written.
    """


class RegistryRejected(CkvalError, ValueError):
    """The registry database refused a statement for its values or its schema.

    Not an outage: running the statement again gives the same answer, so it is never
    retried. Raised for values a column cannot hold, a schema the statement does not
    match, and constraint violations other than a repeated report.
    """

    def __init__(self, database: str, cause: BaseException):
        orig = getattr(cause, "orig", None) or cause
        self.database = database
        self.reason = f"{type(orig).__name__}: {one_line(str(orig))}"
        super().__init__(
            f"The registry database {database} refused the statement ({self.reason}). "
            "This is not an outage and is not retried: check the values stored (a name "
            "or number too large for its column), or run `ckval db upgrade` if the "
            "schema is out of date."
        )


class SchemaOutOfDate(CkvalError, RuntimeError):
    """The registry database's schema is not the one this ckval needs (migrate it)."""


def one_line(text: str) -> str:
    """A driver's message (often several indented lines) as one line."""
    return " ".join(text.split())


class RunNotFound(CkvalError, LookupError):
    def __init__(self, run: str, namespace: str, known: list[str] | None = None):
        self.run = run
        self.namespace = namespace
        hint = ""
        if known:
            shown = ", ".join(sorted(known)[:10])
            hint = f" Known runs: {shown}."
        super().__init__(
            f"No run named {run!r} in namespace {namespace!r} of this registry.{hint} "
            "Check the run name (inside Ray Train it is RunConfig(name=...)) and the "
            "database URL (CKVAL_DATABASE_URL)."
        )


class UnknownMetric(CkvalError, LookupError):
    def __init__(
        self, metric: str, run: str | None, known: list[str], *, validator: str | None = None
    ):
        self.metric = metric
        self.run = run
        self.known = known
        self.validator = validator
        where = f"run {run!r}" if run else "any run"
        by = f" from validator {validator!r}" if validator else ""
        shown = ", ".join(sorted(known)) if known else "none yet"
        super().__init__(
            f"No checkpoint of {where} has a metric named {metric!r}{by}. "
            f"Metrics recorded{by}: {shown}. Pass one of those as metric=."
        )


class JobNotFound(CkvalError, LookupError):
    def __init__(self, job_id: int):
        self.job_id = job_id
        super().__init__(f"No validation job with id {job_id}. List jobs with `ckval jobs RUN`.")


class RetryLimitReached(CkvalError):
    """A retry was refused: the job has made all the attempts its retries may grant."""

    def __init__(self, job_ids: list[int], max_retries: int):
        self.job_ids = job_ids
        self.max_retries = max_retries
        ids = ", ".join(str(job_id) for job_id in job_ids)
        super().__init__(
            f"Validation job(s) {ids} used up their retries: with {max_retries} retries "
            f"(CKVAL_MAX_MANUAL_RETRIES) a job makes at most max_attempts x "
            f"(1 + {max_retries}) attempts in all, and these made them. Nothing was retried. "
            "See why they fail (`ckval job ID` or GET /jobs/ID shows the traceback), then "
            "report the checkpoint again, or raise CKVAL_MAX_MANUAL_RETRIES."
        )


class RayClusterNotFound(CkvalError, ConnectionError):
    """No Ray cluster runs where ckval looked for one; nothing was started."""

    def __init__(self, address: str | None = None, source: str | None = None):
        self.address = address
        self.source = source
        if address is None:
            self.reason = "no Ray cluster found"
        else:
            self.reason = f"no Ray cluster answers at {address}" + (
                f", from {source}" if source else ""
            )
        super().__init__(
            f"{self.reason}. Start the service with `ckval serve`, or point CKVAL_RAY_ADDRESS "
            "(or RAY_ADDRESS) at the cluster that runs it."
        )


class CheckpointNotFound(CkvalError, FileNotFoundError):
    """The checkpoint (or its manifest) is not where the registry says it is."""

    def __init__(self, uri: str, detail: str = ""):
        self.uri = uri
        extra = f": {detail}" if detail else ""
        super().__init__(
            f"Checkpoint not found at {uri}{extra}. It was deleted or moved after it was "
            "reported; this validation cannot succeed and is not retried."
        )


class CheckpointCorrupt(CkvalError, ValueError):
    """The checkpoint's files do not match the manifest written when it was reported."""

    def __init__(self, uri: str, detail: str):
        self.uri = uri
        super().__init__(
            f"Checkpoint at {uri} does not match its manifest: {detail}. It was changed "
            "after it was reported; this validation cannot succeed and is not retried."
        )


class CheckpointExists(CkvalError, FileExistsError):
    """A checkpoint folder is already where a new report was to be stored."""

    def __init__(self, uri: str):
        self.uri = uri
        super().__init__(
            f"A checkpoint folder already exists at {uri}; nothing was overwritten and this "
            "report was not stored. The registry does not know it at this report index: was "
            "the registry database replaced while the storage was kept? Point CKVAL_STORAGE "
            "(or CKVAL_NAMESPACE) at a fresh location, or move the folder away."
        )


class ReportIndexTaken(CkvalError):
    """A report index that another checkpoint of the run already holds."""

    def __init__(self, run: str, report_index: int, uri: str, existing_uri: str):
        self.run = run
        self.report_index = report_index
        self.uri = uri
        self.existing_uri = existing_uri
        super().__init__(
            f"Report index {report_index} of run {run} already holds the checkpoint at "
            f"{existing_uri}; {uri} was not registered. Report indices come from "
            "Registry.ledger.reserve_report_index(run_id): reserve one per report instead of "
            "choosing it."
        )


class AssemblyGivenUp(CkvalError):
    """A sharded report's assembly ended INCOMPLETE before its sealing rank registered it."""

    def __init__(self, run: str, report_index: int, detail: str | None):
        self.run = run
        self.report_index = report_index
        self.detail = detail
        reason = f" ({detail})" if detail else ""
        super().__init__(
            f"Report {report_index} of run {run} was given up before it was sealed{reason}: "
            "its checkpoint was not registered, and retention removes its parts. Its ranks "
            "stored their parts more than an hour before the seal, or the run was ended "
            "meanwhile; report the step again."
        )


class ValidationFnError(CkvalError):
    """A validate_fn raised, or returned something that is not a metrics dict."""

    def __init__(self, job_id: int, message: str, traceback: str = ""):
        self.job_id = job_id
        self.traceback = traceback
        super().__init__(f"validation job {job_id}: {message}")


class PermanentValidationError(CkvalError):
    """Raise this from a validate_fn to fail the job at once, without retries."""


def not_to_be_retried(exc: BaseException) -> BaseException:
    """Marks a validate_fn's own exception to fail its job at once, keeping its type and
    message in the job's record (Ray's ``retry_exceptions=[...]`` rule: the others end the
    task). An exception that takes no attribute is wrapped instead."""
    try:
        setattr(exc, NOT_RETRIED, True)
    except AttributeError:
        wrapped = PermanentValidationError(f"{type(exc).__name__}: {exc}")
        wrapped.__cause__ = exc
        return wrapped
    return exc


def is_not_to_be_retried(exc: BaseException) -> bool:
    return isinstance(exc, PermanentValidationError) or getattr(exc, NOT_RETRIED, False) is True


# The attribute not_to_be_retried sets on an exception.
NOT_RETRIED = "_ckval_not_retried"


class ValidationTimedOut(PermanentValidationError):
    """A validator's own time limit ran out (a CommandValidator's program was killed):
    the job ends TIMED_OUT, or runs again if it was queued with retry_on_timeout."""


def __getattr__(name: str):
    # RegistryUnavailable is also a sqlalchemy DBAPIError: the class is made on first
    # use, so that importing this module (every ckval error) does not import SQLAlchemy,
    # which the CLI's fast listings never load.
    if name == "RegistryUnavailable":
        return _registry_unavailable_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_class_lock = threading.Lock()


def _registry_unavailable_class() -> type:
    # SQLAlchemy comes in under the import lock of a training process's threads (one of
    # them may be importing it for the registry now), and before this module's lock: a
    # thread that holds the import lock may ask for this class as it imports.
    from validation_service.imports import import_once

    import_once("sqlalchemy.exc")
    with _class_lock:
        made = globals().get("RegistryUnavailable")
        if made is None:
            made = globals()["RegistryUnavailable"] = _make_registry_unavailable()
        return made


def _make_registry_unavailable() -> type:
    from sqlalchemy.exc import DBAPIError

    class RegistryUnavailable(CkvalError, DBAPIError):
        """The registry database could not be reached, or stayed locked.

        Raised for lost connections (after a few quick reconnects) and for a database that
        stays busy. It is also a sqlalchemy ``DBAPIError``, so code written against the
        driver's errors keeps catching it; new code should catch this class instead.
        """

        def __init__(
            self,
            database: str,
            cause: BaseException | None = None,
            *,
            source: str = "CKVAL_DATABASE_URL",
        ):
            orig = getattr(cause, "orig", cause)
            DBAPIError.__init__(
                self,
                getattr(cause, "statement", None),
                None,
                orig,  # type: ignore[arg-type]
                hide_parameters=True,
                connection_invalidated=bool(getattr(cause, "connection_invalidated", False)),
            )
            self.database = database
            self.source = source
            # A lost connection, which a reconnect may cure (the Registry retries those).
            self.disconnect = bool(getattr(cause, "connection_invalidated", False))
            reason = (
                f"{type(orig).__name__}: {one_line(str(orig))}" if orig is not None else "unknown"
            )
            self.message = (
                f"The registry database {database} is unavailable ({reason}). Try again "
                f"once it is reachable (check {source} and the server)."
            )

        def __str__(self) -> str:
            return self.message

        def __reduce__(self):
            return _registry_unavailable, (
                self.database,
                self.orig,
                self.connection_invalidated,
                self.source,
            )

    RegistryUnavailable.__module__ = __name__
    RegistryUnavailable.__qualname__ = "RegistryUnavailable"
    return RegistryUnavailable


def _registry_unavailable(
    database: str, orig, connection_invalidated: bool, source: str = "CKVAL_DATABASE_URL"
):
    error = _registry_unavailable_class()(database, orig, source=source)
    error.connection_invalidated = connection_invalidated
    return error


class PayloadSignatureError(CkvalError, PermissionError):
    """A stored validate_fn or validate_config whose signature does not verify.

    The payload is never unpickled: its job fails at once, without retries.
    """

    def __init__(self, job_id: int | None, kind: str, reason: str):
        self.job_id = job_id
        self.kind = kind
        where = f"validation job {job_id}: " if job_id is not None else ""
        super().__init__(
            f"{where}the stored {kind} payload's signature did not verify ({reason}), so it "
            "was not unpickled, nor any validate_fn reference imported. Either the "
            "validation_jobs row was changed after it was reported (a tampered database: "
            "investigate before anything else), or the "
            "process that reported it and the service use different CKVAL_SECRET_KEY values. "
            "Set the same CKVAL_SECRET_KEY on the service and every reporter (during a key "
            "rotation, the old key as CKVAL_SECRET_KEY_PREVIOUS on the service), then "
            "report the checkpoint again."
        )


class ModuleNotAllowed(InvalidInput):
    """A validate_fn reference to a module outside CKVAL_ALLOWED_MODULES."""

    def __init__(self, ref: str, allowed: list[str], reached: str | None = None):
        self.ref = ref
        self.allowed = allowed
        what = "names a module" if reached is None else f"leads to {reached},"
        done = "it was not imported" if reached is None else "nothing of it was called"
        super().__init__(
            f"validate_fn reference {ref!r} {what} outside CKVAL_ALLOWED_MODULES "
            f"({', '.join(allowed)}); {done}. Move the function into one of "
            "those packages, pass the function itself, or add its package to "
            "CKVAL_ALLOWED_MODULES on the service and the reporters."
        )


class SecretsUnavailable(CkvalError, RuntimeError):
    """Settings withheld from Ray's runtime_env that this process could not obtain."""

    def __init__(self, names: list[str], reason: str):
        self.names = names
        super().__init__(
            f"This Ray worker did not get {', '.join(names)}: they hold secrets, so the "
            "driver does not put them in Ray's runtime_env (the state API and dashboard "
            f"show it), and the ckval service could not hand them over ({reason}). Start the "
            "service from the driver before training (ValidationService.start()), or set "
            "those variables on every Ray node (deploy/ does)."
        )


class ValidationsFailedWarning(UserWarning):
    """Registry.wait() found validations of the run that FAILED or TIMED_OUT."""


class ValidationsFailed(CkvalError):
    """Validations of a run ended FAILED or TIMED_OUT (``wait(..., raise_on_failure=True)``).

    ``failed`` maps each job id to a one-line reason (its status and error); ``total`` is
    how many validations the run has.
    """

    def __init__(self, run: str, failed: dict[int, str] | None = None, total: int | None = None):
        self.run = run
        self.failed = dict(failed or {})
        self.job_ids = sorted(self.failed)
        self.total = len(self.failed) if total is None else total
        super().__init__(failed_validations_message(run, self.failed, self.total))


def failed_validations_message(run: str, failed: dict[int, str], total: int) -> str:
    """What ValidationsFailed and ValidationsFailedWarning say: which jobs, why, what next."""
    if not failed:
        return f"Validations of run {run!r} failed. List them with `ckval jobs {run}`."
    shown = sorted(failed)[:10]
    lines = "; ".join(f"job {job_id}: {failed[job_id]}" for job_id in shown)
    more = f"; and {len(failed) - len(shown)} more" if len(failed) > len(shown) else ""
    return (
        f"{len(failed)} of {total} validation(s) of run {run!r} failed ({lines}{more}). "
        f"See `ckval job {shown[0]}` for the traceback; after fixing the cause, run them "
        f"again with `ckval retry --failed --run {run}`."
    )


class AliasNotFound(CkvalError, LookupError):
    def __init__(self, run: str, alias: str, known: list[str]):
        self.run = run
        self.alias = alias
        shown = ", ".join(known) if known else "none"
        super().__init__(
            f"Run {run!r} has no alias {alias!r} (its aliases: {shown}). Set one with "
            f"registry.set_alias({run!r}, {alias!r}, report_index) or `ckval alias`."
        )


class InvalidSearch(CkvalError, ValueError):
    """A search filter or order_by that does not parse; says where and what was expected."""

    def __init__(self, text: str, position: int, expected: str):
        self.text = text
        self.position = position
        self.expected = expected
        pointer = " " * position + "^" if isinstance(position, int) else ""
        super().__init__(
            f"Invalid search at position {position}: expected {expected}.\n  {text}\n  {pointer}"
        )
