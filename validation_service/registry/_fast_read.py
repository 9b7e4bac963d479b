"""Read-only SQL over Python's ``sqlite3`` for the CLI's registry listings (`ckval runs`,
`checkpoints`, `best`, `jobs`) on an embedded SQLite registry.

Why raw SQL here: the CLI's start-up budget for a listing is 0.3 s, and importing
SQLAlchemy alone takes more than that (pydantic, for Settings, adds to it). So these four
listings read the registry with ``sqlite3`` (opened ``mode=ro``: it can never create or
change a database) and return the same records the Registry returns, by running the
Registry's own statements: the query builders of catalog.py, queue.py and aliases.py,
compiled with the SQLite dialect into _fast_sql.py (a test compiles them again and
compares), with the limits of both from limits.py (BEGIN and ROLLBACK, one read
transaction per listing, are its only SQL of its own). It only reads, and
only SQLite at the newest schema this code knows; the Registry stays the owner of every
write, every migration and every other backend. ``open_reader`` returns None, and any
read raises ``Unavailable``, wherever the Registry could behave differently; the CLI
then takes the Registry path. CKVAL_CLI_FAST_READ=0 always does.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import sqlite3
import types
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import quote

from validation_service import _home
from validation_service.jobs import ACTIVE_JOB_STATUSES, DEFAULT_VALIDATOR, JobStatus, RunStatus
from validation_service.metrics import decode_non_finite
from validation_service.names import is_safe_name
from validation_service.registry import _fast_sql
from validation_service.registry._fast_sql_names import jobs_statement
from validation_service.registry._revisions import declared_heads, migrations_dir
from validation_service.registry.limits import (
    IDS_PER_IN_LIST,
    KNOWN_METRICS_ROWS,
    KNOWN_RUN_NAMES,
)
from validation_service.registry.records import (
    AttemptRecord,
    CheckpointRecord,
    JobRecord,
    RunRecord,
    RunSummary,
    StopDecision,
    ValidationCost,
    costs_by_run,
    run_summaries,
    with_evaluations,
)

FAST_READ_VAR = "CKVAL_CLI_FAST_READ"

# Settings fields (config.py) whose CKVAL_* variable any string satisfies: with only these
# set, Settings() cannot fail, so skipping it changes nothing. A CKVAL_* variable of any
# other Settings field could be invalid (InvalidSettings on the Registry path), so it
# sends the listing to the Registry path. tests/test_cli_fast_read.py keeps the two
# lists equal to Settings' fields.
PLAIN_SETTINGS = frozenset(
    {
        "home",
        "database_url",
        "namespace",  # checked below with the same rule as Settings'
        "storage",
        "ray_address",
        "service_name",
        "ray_namespace",
        "http_host",
        "secret_key",
        "secret_key_previous",
        "api_token",
    }
)
CHECKED_SETTINGS = frozenset(
    {
        "storage_options",
        "pools",
        "replicas",
        "default_pool_size",
        "lease_s",
        "heartbeat_s",
        "poll_interval_s",
        "keep_warm",
        "retry_backoff_s",
        "retry_backoff_max_s",
        "delivery_timeout_s",
        "watch_interval_s",
        "watch_settle_s",
        "http_port",
        "allowed_modules",
        "allowed_commands",
        "max_queued_evaluations",
        "mlflow_allowed_uris",
        "deletable_roots",
        "mlflow_allowed_experiments",
        "wandb_allowed_entities",
        "sinks",
        "sink_attempts",
        "sink_backoff_s",
        "append",
        "shard_conflicts",
        "api_hosts",
        "max_manual_retries",
        "resource_wait_s",
        "node_types",
    }
)

_ACTIVE = sorted(s.value for s in ACTIVE_JOB_STATUSES)
_RUN_STATUSES = frozenset(s.value for s in RunStatus)
_JOB_STATUSES = frozenset(s.value for s in JobStatus)


class Unavailable(Exception):
    """This read cannot be answered here exactly as the Registry would: use the Registry."""


def open_reader(database_url: str | None, namespace: str | None) -> FastReader | None:
    """A reader of the registry the CLI would open with these options (None: not given,
    then the CKVAL_* variables), or None where the Registry path must run."""
    if os.environ.get(FAST_READ_VAR, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    # CKVAL_LOG_LEVEL=INFO or DEBUG: the Registry path logs what it does.
    if logging.getLogger("validation_service").getEffectiveLevel() < logging.WARNING:
        return None
    env: dict[str, str] = {}
    for name, value in os.environ.items():
        field = _home.env_field(name.upper())
        if field is None:
            continue
        if name != name.upper() and field in PLAIN_SETTINGS | CHECKED_SETTINGS:
            return None  # pydantic-settings reads names in any case; keep to one rule
        if field in CHECKED_SETTINGS:
            return None
        env[field] = value
    if "home" in env and not env["home"]:
        return None
    if namespace is None:
        namespace = env.get("namespace", "default")
    if not is_safe_name(namespace):
        return None  # the Registry path says what is wrong with it
    home = env.get("home") or _home.default_home()
    url = _home.resolved_database_url(database_url or env.get("database_url"), home)
    path = _sqlite_path(url)
    if path is None or not os.path.isfile(path):
        return None  # not SQLite, or a database the Registry would create first
    try:
        connection = sqlite3.connect(
            f"file:{quote(path)}?mode=ro", uri=True, timeout=30, isolation_level=None
        )
    except sqlite3.Error:
        return None
    reader = FastReader(connection, namespace)
    try:
        if not reader.schema_is_current():
            reader.close()
            return None
    except sqlite3.Error:
        reader.close()
        return None
    return reader


def _sqlite_path(url: str) -> str | None:
    """The file of a plain ``sqlite:///<path>`` URL; None for any other URL (a driver,
    query parameters, escapes, memory) that only SQLAlchemy reads the same way."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        return None
    path = url[len(prefix) :]
    if not path or path == ":memory:" or any(c in path for c in "?%#"):
        return None
    return path


class FastReader:
    """The Registry's listing methods, read-only, over one ``sqlite3`` connection.

    Each method either returns what the Registry's method of the same name would, raises
    the same ckval error, or raises Unavailable.
    """

    def __init__(self, connection: sqlite3.Connection, namespace: str):
        self.connection = connection
        self.namespace = namespace

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> FastReader:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def schema_is_current(self) -> bool:
        """Whether the database is at the one head revision of migrations/versions
        (the revisions stamped read as _migrate.current_revision reads them)."""
        heads = declared_heads(migrations_dir() / "versions")
        if heads is None or len(heads) != 1:
            return False
        rows = self.connection.execute(_fast_sql.SCHEMA_VERSIONS).fetchall()
        return len(rows) == 1 and rows[0][0] == heads[0]

    def _snapshot(self) -> _Snapshot:
        return _Snapshot(self.connection)

    # ------------------------------------------------------------------- runs
    def run_summaries(self, status: str | None = None) -> list[RunSummary]:
        """As Registry.run_summaries: every run attempt of the namespace (only those in
        ``status``) with its live checkpoints and its jobs per status."""
        if status is not None and status not in _RUN_STATUSES:
            raise Unavailable(status)
        with self._snapshot() as db:
            namespace = (self.namespace,)
            runs = [_run_record(row) for row in _named_rows(db.execute(_fast_sql.RUNS, namespace))]
            checkpoints = dict(db.execute(_fast_sql.LIVE_CHECKPOINTS_PER_RUN, namespace).fetchall())
            jobs: dict[int, dict[str, int]] = {}
            for run_id, job_status, count in db.execute(
                _fast_sql.JOBS_PER_RUN_AND_STATUS, namespace
            ):
                jobs.setdefault(run_id, {})[job_status] = count
            decisions = _named_rows(db.execute(_fast_sql.STOP_DECISIONS, namespace))
            stops = {row["run_id"]: _stop_decision(row) for row in decisions}
            spent = costs_by_run(db.execute(_fast_sql.COST_PER_RUN, namespace))
        if status is not None:
            runs = [run for run in runs if run.status == status]
        return run_summaries(runs, checkpoints, jobs, stops, spent)

    def _require_run_id(self, db: sqlite3.Connection, name: str) -> int:
        """As Catalog.require_run_id: the run's latest attempt, else RunNotFound."""
        row = db.execute(_fast_sql.LATEST_RUN_ID, (self.namespace, name, 1, 0)).fetchone()
        if row is not None:
            return row[0]
        # The catalog's statement (no ORDER BY): the same names.
        known = [
            known_name
            for (known_name,) in db.execute(
                _fast_sql.KNOWN_RUN_NAMES, (self.namespace, KNOWN_RUN_NAMES, 0)
            )
        ]
        from validation_service.errors import RunNotFound

        raise RunNotFound(name, self.namespace, known)

    # ------------------------------------------------------------ checkpoints
    def checkpoints(self, run: str) -> list[CheckpointRecord]:
        """As Registry.checkpoints(run): the latest attempt's live checkpoints in report
        order, with their aliases, tags and every validator's metrics."""
        with self._snapshot() as db:
            run_id = self._require_run_id(db, run)
            rows = _named_rows(db.execute(_fast_sql.LIVE_CHECKPOINTS, (run_id,)))
            records = [_checkpoint_record(row, run) for row in rows]
            return _with_evaluations(db, _with_aliases_and_tags(db, records))

    def best_checkpoint_records(
        self, run: str | None, metric: str, mode: str = "max", k: int = 1
    ) -> list[CheckpointRecord]:
        """As Registry.best_checkpoint_records: top-k by the effective values of a metric
        (the metric_values index order), ties to the earlier checkpoint."""
        from validation_service.validation import check_k

        check_k(k)  # the Registry's first check, with its error
        if mode not in ("max", "min"):
            raise Unavailable(mode)
        with self._snapshot() as db:
            run_id = None if run is None else self._require_run_id(db, run)
            by_run = () if run_id is None else (run_id,)
            rows = _named_rows(
                db.execute(_BEST[mode, run_id is not None], (metric, self.namespace, *by_run, k, 0))
            )
            if rows:
                records = [_checkpoint_record(row, row["run_name"]) for row in rows]
                return _with_aliases_and_tags(db, records)
            known = self._known_metrics(db, run_id)
            # As Registry._best: a metric recorded only as NaN/inf or text, or perhaps
            # still to come from a pending validation, is no error.
            if metric in known or self._active_count(db, run_id):
                return []
        from validation_service.errors import UnknownMetric

        raise UnknownMetric(metric, run, sorted(known))

    def _known_metrics(self, db: sqlite3.Connection, run_id: int | None) -> set[str]:
        if run_id is not None:
            rows = db.execute(_fast_sql.RUN_METRIC_NAMES, (run_id, KNOWN_METRICS_ROWS, 0))
        else:
            rows = db.execute(
                _fast_sql.NAMESPACE_METRIC_NAMES, (self.namespace, KNOWN_METRICS_ROWS, 0)
            )
        known: set[str] = set()
        for reported, validated in rows:
            known.update(_json(reported) or {})
            known.update(_json(validated) or {})
        return known

    def _active_count(self, db: sqlite3.Connection, run_id: int | None) -> int:
        """QUEUED and RUNNING jobs of the run (of every run, of every namespace: None),
        as Queue.active_count."""
        if run_id is None:
            return db.execute(_fast_sql.ACTIVE_JOBS, _ACTIVE).fetchone()[0] or 0
        return db.execute(_fast_sql.ACTIVE_JOBS_OF_RUN, (*_ACTIVE, run_id)).fetchone()[0] or 0

    def validation_costs(self, run: str) -> dict[int, ValidationCost]:
        """As Registry.validation_costs: report index -> what its validations held."""
        with self._snapshot() as db:
            run_id = self._require_run_id(db, run)
            return costs_by_run(db.execute(_fast_sql.COST_PER_CHECKPOINT, (run_id,)))

    # ------------------------------------------------------------------- jobs
    def list_jobs(
        self,
        run: str | None = None,
        *,
        statuses: Sequence[str] | None = None,
        pool: str | None = None,
        limit: int | None = None,
    ) -> list[JobRecord]:
        """As Registry.list_jobs: jobs of the namespace (or of the run's latest attempt),
        filtered, the newest ``limit`` of them, in id order, with their attempts."""
        wanted = None if statuses is None else [str(status).upper() for status in statuses]
        if wanted is not None and not set(wanted) <= _JOB_STATUSES:
            raise Unavailable(statuses)
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise Unavailable(limit)
        with self._snapshot() as db:
            run_id = None if run is None else self._require_run_id(db, run)
            name = jobs_statement(
                run_id is not None, bool(wanted), pool is not None, limit is not None
            )
            statement = getattr(_fast_sql, name)
            params: list[Any] = [self.namespace]
            if run_id is not None:
                params.append(run_id)
            if wanted:
                statement = _in_list(statement, "statuses", wanted)
                params += wanted
            if pool is not None:
                params.append(pool)
            if limit is not None:
                params += [limit, 0]
            rows = _named_rows(db.execute(statement, params))
            attempts = self._attempts(db, [row["id"] for row in rows])
        return [_job_record(row, attempts.get(row["id"], ())) for row in reversed(rows)]

    def _attempts(
        self, db: sqlite3.Connection, job_ids: list[int]
    ) -> dict[int, tuple[AttemptRecord, ...]]:
        """As queue.attempts_by_job."""
        found: dict[int, list[AttemptRecord]] = {}
        for start in range(0, len(job_ids), IDS_PER_IN_LIST):
            chunk = job_ids[start : start + IDS_PER_IN_LIST]
            statement = _in_list(_fast_sql.JOB_ATTEMPTS, "ids", chunk)
            for row in _named_rows(db.execute(statement, chunk)):
                found.setdefault(row["job_id"], []).append(_attempt_record(row))
        return {job_id: tuple(rows) for job_id, rows in found.items()}


class _Snapshot:
    """One read transaction (the Registry reads each listing in one session), with any
    sqlite3 error (or a parameter beyond SQLite's 64-bit integers) turned into
    Unavailable."""

    def __init__(self, connection: sqlite3.Connection):
        self.connection = connection

    def __enter__(self) -> sqlite3.Connection:
        try:
            self.connection.execute("BEGIN")
        except sqlite3.Error as exc:
            raise Unavailable(exc) from exc
        return self.connection

    def __exit__(self, exc_type: Any, exc: BaseException | None, _tb: Any) -> None:
        try:
            self.connection.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        if isinstance(exc, (sqlite3.Error, OverflowError)):
            raise Unavailable(exc) from exc
        if isinstance(exc, (ValueError, TypeError)):
            # A value this module cannot decode the way the ORM does.
            raise Unavailable(exc) from exc


# ---------------------------------------------------------------- rows to records
def _fields(cls: type, *, leave_out: Sequence[str] = ()) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name not in leave_out]


_CHECKPOINT_FIELDS = _fields(CheckpointRecord, leave_out=("run", "aliases", "tags", "evaluations"))
_JOB_FIELDS = _fields(JobRecord, leave_out=("run", "report_index", "attempt_history"))
_ATTEMPT_FIELDS = _fields(AttemptRecord)
_RUN_FIELDS = _fields(RunRecord)
# (mode, of one run) -> the catalog's best-k statement: metric, namespace, [run id], k, 0
_BEST = {
    ("max", False): _fast_sql.BEST_MAX,
    ("max", True): _fast_sql.BEST_MAX_OF_RUN,
    ("min", False): _fast_sql.BEST_MIN,
    ("min", True): _fast_sql.BEST_MIN_OF_RUN,
}

_DATETIMES = frozenset(
    {
        "created_at",
        "ended_at",
        "deleted_at",
        "not_before",
        "lease_expires_at",
        "started_at",
        "finished_at",
        "claimed_at",
        "decided_at",
        "overridden_at",
        "waiting_since",
    }
)
_JSONS = frozenset(
    {
        "tags",
        "reported_metrics",
        "validated_metrics",
        "metrics",
        "resources",
        "result_metrics",
        "policy",
        "metric_values",
        "skipped",
        "warnings",
        "waiting_for",
    }
)


def _in_list(statement: str, name: str, values: Sequence[Any]) -> str:
    """A generated statement with its IN list ``name`` given a ``?`` per value."""
    marker = f"__[POSTCOMPILE_{name}]"
    if statement.count(marker) != 1:
        raise Unavailable(statement)
    return statement.replace(marker, ", ".join("?" for _ in values))


def _named_rows(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    """The rows as {column: value}, by the names the statement selects."""
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor]


def _datetime(value: Any) -> dt.datetime | None:
    """As models.UTCDateTime over SQLite's DATETIME: naive UTC text, read back aware."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"not a stored datetime: {value!r}")
    return dt.datetime.fromisoformat(value).replace(tzinfo=dt.timezone.utc)


def _json(value: Any) -> Any:
    """As the registry engine's JSON columns (_engine.json_loads); SQL NULL is None."""
    if value is None:
        return None
    return decode_non_finite(json.loads(value))


def _decoded(names: Sequence[str], row: Sequence[Any]) -> Iterator[tuple[str, Any]]:
    for name, value in zip(names, row, strict=True):
        if name in _DATETIMES:
            yield name, _datetime(value)
        elif name in _JSONS:
            yield name, _json(value)
        else:
            yield name, value


def _run_record(row: dict[str, Any]) -> RunRecord:
    """From a row of the catalog's runs statement (every column of runs)."""
    return RunRecord(**_picked(row, _RUN_FIELDS))


def _stop_decision(row: dict[str, Any]) -> StopDecision:
    """From a row of registry/stopping.py's decisions statement."""
    decoded = types.SimpleNamespace(**_picked(row, list(row)))
    return StopDecision.from_row(decoded, row["run_name"], row["run_attempt"])


def _checkpoint_record(row: dict[str, Any], run: str) -> CheckpointRecord:
    """From a row of the catalog's record columns (best-k's run_name left out)."""
    return CheckpointRecord(**_picked(row, _CHECKPOINT_FIELDS), run=run)


def _picked(row: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """These columns of a named row, decoded as the ORM does."""
    return dict(_decoded(names, [row[name] for name in names]))


def _attempt_record(row: dict[str, Any]) -> AttemptRecord:
    return AttemptRecord(**_picked(row, _ATTEMPT_FIELDS))


def _job_record(row: dict[str, Any], attempts: tuple[AttemptRecord, ...]) -> JobRecord:
    """From a row of queue.list_jobs_query: every column of the job, its checkpoint's
    report index and its run's name."""
    return JobRecord(
        **_picked(row, _JOB_FIELDS),
        run=row["name"],
        report_index=row["report_index"],
        attempt_history=attempts,
    )


def _with_aliases_and_tags(
    db: sqlite3.Connection, records: list[CheckpointRecord]
) -> list[CheckpointRecord]:
    """As aliases.with_aliases_and_tags: aliases in name order, tags in key order."""
    aliases: dict[int, list[str]] = {}
    tags: dict[int, dict[str, str]] = {}
    ids = [record.id for record in records]
    for start in range(0, len(ids), IDS_PER_IN_LIST):
        chunk = ids[start : start + IDS_PER_IN_LIST]
        for checkpoint_id, alias in db.execute(
            _in_list(_fast_sql.CHECKPOINT_ALIASES, "ids", chunk), chunk
        ):
            aliases.setdefault(checkpoint_id, []).append(alias)
        for checkpoint_id, key, value in db.execute(
            _in_list(_fast_sql.CHECKPOINT_TAGS, "ids", chunk), chunk
        ):
            tags.setdefault(checkpoint_id, {})[key] = value
    return [
        dataclasses.replace(
            record, aliases=tuple(aliases.get(record.id, ())), tags=tags.get(record.id, {})
        )
        for record in records
    ]


def _with_evaluations(
    db: sqlite3.Connection, records: list[CheckpointRecord]
) -> list[CheckpointRecord]:
    """As evaluations.by_validator: each named validator's latest SUCCEEDED metrics."""
    found: dict[int, dict[str, Any]] = {}
    ids = [record.id for record in records]
    for start in range(0, len(ids), IDS_PER_IN_LIST):
        chunk = ids[start : start + IDS_PER_IN_LIST]
        statement = _in_list(_fast_sql.CHECKPOINT_EVALUATIONS, "ids", chunk)
        for checkpoint_id, validator, metrics in db.execute(
            statement, (*chunk, DEFAULT_VALIDATOR, JobStatus.SUCCEEDED.value)
        ):
            found.setdefault(checkpoint_id, {})[validator] = _json(metrics) or {}
    return [with_evaluations(record, found.get(record.id, {})) for record in records]
