"""Read-only SQL over Python's ``sqlite3`` for the CLI's registry listings (`ckval runs`,
`checkpoints`, `best`, `jobs`) on an embedded SQLite registry.

Why raw SQL here: the CLI's start-up budget for a listing is 0.3 s, and importing
SQLAlchemy alone takes more than that (pydantic, for Settings, adds to it). So these four
listings read the registry with ``sqlite3`` (opened ``mode=ro``: it can never create or
change a database) and return the same records the Registry returns, mirroring its
queries statement for statement (catalog.py, queue.py, aliases.py). It only reads, and
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
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import quote

from validation_service import _home
from validation_service.jobs import ACTIVE_JOB_STATUSES, JobStatus, RunStatus
from validation_service.metrics import decode_non_finite
from validation_service.names import is_safe_name
from validation_service.registry._revisions import declared_heads, migrations_dir
from validation_service.registry.records import (
    AttemptRecord,
    CheckpointRecord,
    JobRecord,
    RunRecord,
    RunSummary,
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
        "default_pool_size",
        "lease_s",
        "heartbeat_s",
        "poll_interval_s",
        "keep_warm",
        "retry_backoff_s",
        "retry_backoff_max_s",
        "delivery_timeout_s",
        "http_port",
        "allowed_modules",
        "sinks",
        "sink_attempts",
        "sink_backoff_s",
        "append",
        "api_hosts",
        "max_manual_retries",
    }
)

_ACTIVE = sorted(s.value for s in ACTIVE_JOB_STATUSES)
_RUN_STATUSES = frozenset(s.value for s in RunStatus)
_JOB_STATUSES = frozenset(s.value for s in JobStatus)
# Ids per IN (...) list, as aliases.py (_CHUNK) and SQLAlchemy's selectinload.
_CHUNK = 500


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
        if not name.upper().startswith(_home.ENV_PREFIX):
            continue
        field = name[len(_home.ENV_PREFIX) :].lower()
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
        """Whether the database is at the one head revision of migrations/versions."""
        heads = declared_heads(migrations_dir() / "versions")
        if heads is None or len(heads) != 1:
            return False
        rows = self.connection.execute("SELECT version_num FROM alembic_version").fetchall()
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
            runs = [
                _run_record(row)
                for row in db.execute(
                    "SELECT runs.id, runs.name, runs.namespace, runs.storage_root, "
                    "runs.created_at, runs.status, runs.tags, runs.attempt, runs.ended_at "
                    "FROM runs WHERE runs.namespace = ? ORDER BY runs.id",
                    (self.namespace,),
                )
            ]
            checkpoints = dict(
                db.execute(
                    "SELECT checkpoints.run_id, count(checkpoints.id) AS count_1 "
                    "FROM checkpoints JOIN runs ON runs.id = checkpoints.run_id "
                    "WHERE runs.namespace = ? AND checkpoints.deleted_at IS NULL "
                    "GROUP BY checkpoints.run_id",
                    (self.namespace,),
                ).fetchall()
            )
            jobs: dict[int, dict[str, int]] = {}
            for run_id, job_status, count in db.execute(
                "SELECT validation_jobs.run_id, validation_jobs.status, "
                "count(validation_jobs.id) AS count_1 "
                "FROM validation_jobs JOIN runs ON runs.id = validation_jobs.run_id "
                "WHERE runs.namespace = ? "
                "GROUP BY validation_jobs.run_id, validation_jobs.status",
                (self.namespace,),
            ):
                jobs.setdefault(run_id, {})[job_status] = count
        if status is not None:
            runs = [run for run in runs if run.status == status]
        return [RunSummary(run, checkpoints.get(run.id, 0), jobs.get(run.id, {})) for run in runs]

    def _require_run_id(self, db: sqlite3.Connection, name: str) -> int:
        """As Catalog.require_run_id: the run's latest attempt, else RunNotFound."""
        row = db.execute(
            "SELECT runs.id FROM runs WHERE runs.namespace = ? AND runs.name = ? "
            "ORDER BY runs.attempt DESC LIMIT ? OFFSET ?",
            (self.namespace, name, 1, 0),
        ).fetchone()
        if row is not None:
            return row[0]
        # The same statement as the catalog's (no ORDER BY): the same 50 names.
        known = [
            known_name
            for (known_name,) in db.execute(
                "SELECT runs.name FROM runs WHERE runs.namespace = ? LIMIT ? OFFSET ?",
                (self.namespace, 50, 0),
            )
        ]
        from validation_service.errors import RunNotFound

        raise RunNotFound(name, self.namespace, known)

    # ------------------------------------------------------------ checkpoints
    def checkpoints(self, run: str) -> list[CheckpointRecord]:
        """As Registry.checkpoints(run): the latest attempt's live checkpoints in report
        order, with their aliases and tags."""
        with self._snapshot() as db:
            run_id = self._require_run_id(db, run)
            rows = db.execute(
                f"SELECT {_CHECKPOINT_COLUMNS} FROM checkpoints "
                "WHERE checkpoints.run_id = ? AND checkpoints.deleted_at IS NULL "
                "ORDER BY checkpoints.report_index",
                (run_id,),
            ).fetchall()
            records = [_checkpoint_record(row, run) for row in rows]
            return _with_aliases_and_tags(db, records)

    def best_checkpoint_records(
        self, run: str | None, metric: str, mode: str = "max", k: int = 1
    ) -> list[CheckpointRecord]:
        """As Registry.best_checkpoint_records: top-k by the effective values of a metric
        (the metric_values index order), ties to the earlier checkpoint."""
        from validation_service.validation import check_k

        check_k(k)  # the Registry's first check, with its error
        if mode not in ("max", "min"):
            raise Unavailable(mode)
        order = "DESC" if mode == "max" else "ASC"
        with self._snapshot() as db:
            run_id = None if run is None else self._require_run_id(db, run)
            params: tuple[Any, ...] = (metric, self.namespace)
            by_run = ""
            if run_id is not None:
                by_run = " AND metric_values.run_id = ?"
                params += (run_id,)
            rows = db.execute(
                f"SELECT {_CHECKPOINT_COLUMNS}, runs.name AS run_name FROM checkpoints "
                "JOIN metric_values ON metric_values.checkpoint_id = checkpoints.id "
                "JOIN runs ON runs.id = metric_values.run_id "
                "WHERE metric_values.name = ? AND metric_values.effective = 1 "
                f"AND runs.namespace = ?{by_run} "
                f"ORDER BY metric_values.value {order}, metric_values.checkpoint_id ASC "
                "LIMIT ? OFFSET ?",
                (*params, k, 0),
            ).fetchall()
            if rows:
                records = [_checkpoint_record(row[:-1], row[-1]) for row in rows]
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
            rows = db.execute(
                "SELECT checkpoints.reported_metrics, checkpoints.validated_metrics "
                "FROM checkpoints WHERE checkpoints.run_id = ? LIMIT ? OFFSET ?",
                (run_id, 10_000, 0),
            )
        else:
            rows = db.execute(
                "SELECT checkpoints.reported_metrics, checkpoints.validated_metrics "
                "FROM checkpoints JOIN runs ON runs.id = checkpoints.run_id "
                "WHERE runs.namespace = ? LIMIT ? OFFSET ?",
                (self.namespace, 10_000, 0),
            )
        known: set[str] = set()
        for reported, validated in rows:
            known.update(_json(reported) or {})
            known.update(_json(validated) or {})
        return known

    def _active_count(self, db: sqlite3.Connection, run_id: int | None) -> int:
        """QUEUED and RUNNING jobs of the run (of every run, of every namespace: None),
        as Queue.active_count."""
        marks = ", ".join("?" for _ in _ACTIVE)
        query = (
            "SELECT count(validation_jobs.id) FROM validation_jobs "
            f"WHERE validation_jobs.status IN ({marks})"
        )
        params: tuple[Any, ...] = tuple(_ACTIVE)
        if run_id is not None:
            query += " AND validation_jobs.run_id = ?"
            params += (run_id,)
        return db.execute(query, params).fetchone()[0] or 0

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
            conditions = ["runs.namespace = ?"]
            params: list[Any] = [self.namespace]
            if run is not None:
                conditions.append("validation_jobs.run_id = ?")
                params.append(self._require_run_id(db, run))
            if wanted:
                conditions.append(f"validation_jobs.status IN ({', '.join('?' for _ in wanted)})")
                params += wanted
            if pool is not None:
                conditions.append("validation_jobs.pool = ?")
                params.append(pool)
            query = (
                f"SELECT {_JOB_COLUMNS}, checkpoints.report_index, runs.name "
                "FROM validation_jobs "
                "JOIN checkpoints ON checkpoints.id = validation_jobs.checkpoint_id "
                "JOIN runs ON runs.id = validation_jobs.run_id "
                f"WHERE {' AND '.join(conditions)} ORDER BY validation_jobs.id DESC"
            )
            if limit is not None:
                query += " LIMIT ? OFFSET ?"
                params += [limit, 0]
            rows = db.execute(query, params).fetchall()
            attempts = self._attempts(db, [row[0] for row in rows])
        return [_job_record(row, attempts.get(row[0], ())) for row in reversed(rows)]

    def _attempts(
        self, db: sqlite3.Connection, job_ids: list[int]
    ) -> dict[int, tuple[AttemptRecord, ...]]:
        found: dict[int, list[AttemptRecord]] = {}
        for start in range(0, len(job_ids), _CHUNK):
            chunk = job_ids[start : start + _CHUNK]
            for row in db.execute(
                f"SELECT validation_attempts.job_id, {_ATTEMPT_COLUMNS} "
                "FROM validation_attempts "
                f"WHERE validation_attempts.job_id IN ({', '.join('?' for _ in chunk)}) "
                "ORDER BY validation_attempts.attempt",
                chunk,
            ):
                found.setdefault(row[0], []).append(_attempt_record(row[1:]))
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


_CHECKPOINT_FIELDS = _fields(CheckpointRecord, leave_out=("run", "aliases", "tags"))
_CHECKPOINT_COLUMNS = ", ".join(f"checkpoints.{name}" for name in _CHECKPOINT_FIELDS)
_JOB_FIELDS = _fields(JobRecord, leave_out=("run", "report_index", "attempt_history"))
_JOB_COLUMNS = ", ".join(f"validation_jobs.{name}" for name in _JOB_FIELDS)
_ATTEMPT_FIELDS = _fields(AttemptRecord)
_ATTEMPT_COLUMNS = ", ".join(f"validation_attempts.{name}" for name in _ATTEMPT_FIELDS)
_RUN_FIELDS = _fields(RunRecord)

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
    }
)
_JSONS = frozenset(
    {"tags", "reported_metrics", "validated_metrics", "metrics", "resources", "result_metrics"}
)


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


def _run_record(row: Sequence[Any]) -> RunRecord:
    return RunRecord(**dict(_decoded(_RUN_FIELDS, row)))


def _checkpoint_record(row: Sequence[Any], run: str) -> CheckpointRecord:
    return CheckpointRecord(**dict(_decoded(_CHECKPOINT_FIELDS, row)), run=run)


def _attempt_record(row: Sequence[Any]) -> AttemptRecord:
    return AttemptRecord(**dict(_decoded(_ATTEMPT_FIELDS, row)))


def _job_record(row: Sequence[Any], attempts: tuple[AttemptRecord, ...]) -> JobRecord:
    *job, report_index, run = row
    return JobRecord(
        **dict(_decoded(_JOB_FIELDS, job)),
        run=run,
        report_index=report_index,
        attempt_history=attempts,
    )


def _with_aliases_and_tags(
    db: sqlite3.Connection, records: list[CheckpointRecord]
) -> list[CheckpointRecord]:
    """As aliases.with_aliases_and_tags: aliases in name order, tags in key order."""
    aliases: dict[int, list[str]] = {}
    tags: dict[int, dict[str, str]] = {}
    ids = [record.id for record in records]
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        marks = ", ".join("?" for _ in chunk)
        for checkpoint_id, alias in db.execute(
            "SELECT checkpoint_aliases.checkpoint_id, checkpoint_aliases.alias "
            f"FROM checkpoint_aliases WHERE checkpoint_aliases.checkpoint_id IN ({marks}) "
            "ORDER BY checkpoint_aliases.alias",
            chunk,
        ):
            aliases.setdefault(checkpoint_id, []).append(alias)
        for checkpoint_id, key, value in db.execute(
            'SELECT checkpoint_tags.checkpoint_id, checkpoint_tags."key", checkpoint_tags.value '
            f"FROM checkpoint_tags WHERE checkpoint_tags.checkpoint_id IN ({marks}) "
            'ORDER BY checkpoint_tags."key"',
            chunk,
        ):
            tags.setdefault(checkpoint_id, {})[key] = value
    return [
        dataclasses.replace(
            record, aliases=tuple(aliases.get(record.id, ())), tags=tags.get(record.id, {})
        )
        for record in records
    ]
