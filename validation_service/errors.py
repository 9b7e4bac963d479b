"""Errors a user can act on: each names the run, checkpoint or job and what to do."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError


class CkvalError(Exception):
    """Base class of every error ckval raises on purpose."""

    def __reduce__(self):
        # ckval's errors cross processes (Ray tasks, Ray Train workers). Pickle rebuilds an
        # exception by calling its class with self.args, which is the message alone, not
        # the arguments of a subclass's __init__: rebuild from the message and the fields.
        return (_rebuild_error, (type(self), str(self), dict(self.__dict__)))


def _rebuild_error(cls: type[CkvalError], message: str, fields: dict) -> CkvalError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(fields)
    return error


class InvalidInput(CkvalError, ValueError):
    """An argument that ckval cannot store or act on; nothing was written."""


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
    def __init__(self, metric: str, run: str | None, known: list[str]):
        self.metric = metric
        self.run = run
        self.known = known
        where = f"run {run!r}" if run else "any run"
        shown = ", ".join(sorted(known)) if known else "none yet"
        super().__init__(
            f"No checkpoint of {where} has a metric named {metric!r}. "
            f"Metrics recorded: {shown}. Pass one of those as metric=."
        )


class JobNotFound(CkvalError, LookupError):
    def __init__(self, job_id: int):
        self.job_id = job_id
        super().__init__(f"No validation job with id {job_id}. List jobs with `ckval jobs RUN`.")


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


class ValidationFnError(CkvalError):
    """A validate_fn raised, or returned something that is not a metrics dict."""

    def __init__(self, job_id: int, message: str, traceback: str = ""):
        self.job_id = job_id
        self.traceback = traceback
        super().__init__(f"validation job {job_id}: {message}")


class PermanentValidationError(CkvalError):
    """Raise this from a validate_fn to fail the job at once, without retries."""


class RegistryUnavailable(CkvalError, DBAPIError):
    """The registry database could not be reached, or stayed locked.

    Raised for lost connections (after a few quick reconnects) and for a database that
    stays busy. It is also a sqlalchemy ``DBAPIError``, so code written against the
    driver's errors keeps catching it; new code should catch this class instead.
    """

    def __init__(self, database: str, cause: BaseException | None = None):
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
        # A lost connection, which a reconnect may cure (the Registry retries those).
        self.disconnect = bool(getattr(cause, "connection_invalidated", False))
        reason = f"{type(orig).__name__}: {orig}".strip() if orig is not None else "unknown"
        self.message = (
            f"The registry database {database} is unavailable ({reason}). Try again "
            "once it is reachable (check CKVAL_DATABASE_URL and the server)."
        )

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return _registry_unavailable, (self.database, self.orig, self.connection_invalidated)


def _registry_unavailable(database: str, orig, connection_invalidated: bool):
    error = RegistryUnavailable(database, orig)
    error.connection_invalidated = connection_invalidated
    return error


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
