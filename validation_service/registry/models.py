"""SQLAlchemy 2.x typed ORM models of the checkpoint registry (created only by migrations/)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from validation_service.jobs import (
    DEFAULT_VALIDATOR,
    AssemblyStatus,
    JobStatus,
    PartStatus,
    RunStatus,
    ValidationStatus,
)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class UTCDateTime(TypeDecorator):
    """Stores naive UTC, returns aware UTC: SQLite keeps no time zone, PostgreSQL would."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the registry; use UTC-aware datetimes")
        return value.astimezone(dt.timezone.utc).replace(tzinfo=None)

    def process_result_value(self, value: dt.datetime | None, dialect) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.timezone.utc)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, dt.datetime: UTCDateTime}


class Run(Base):
    __tablename__ = "runs"
    # A run name reused after the run ended starts a new attempt: a runs row of its own.
    __table_args__ = (
        UniqueConstraint("namespace", "name", "attempt", name="uq_runs_namespace_name_attempt"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    namespace: Mapped[str] = mapped_column(String(255))
    storage_root: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.RUNNING.value)
    tags: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # The report index the next report of this run gets: every reporting process reserves
    # its indices here (an atomic increment), so no two reports share an index or a folder.
    next_report_index: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    ended_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)

    checkpoints: Mapped[list[Checkpoint]] = relationship(back_populates="run")


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "report_index", name="uq_checkpoints_run_report_index"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    report_index: Mapped[int] = mapped_column(Integer)
    step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    uri: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    manifest_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    reported_metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    validated_metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # The merged view: validated keys overwrite reported keys (Ray's rule).
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    validation_status: Mapped[str] = mapped_column(String(16), default=ValidationStatus.NONE.value)
    deleted_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # Added by register(): a folder made outside training, never deleted by retention.
    external: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    run: Mapped[Run] = relationship(back_populates="checkpoints")
    jobs: Mapped[list[ValidationJob]] = relationship(back_populates="checkpoint")


class _CheckpointValue:
    """The columns of a table of named finite values of checkpoints: the checkpoint (first
    in the primary key), the value's name (in the primary key), its run (copied, for
    run-ranged index scans) and the value."""

    checkpoint_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True, sort_order=-1
    )
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    value: Mapped[float] = mapped_column(Float)


class MetricValue(_CheckpointValue, Base):
    """One finite numeric metric of one checkpoint, so best-k by any metric uses an index.

    ``effective`` marks the value the merged view shows: a validated value, or a
    reported one that no validated value of the same name overrides. ``run_id`` is
    copied from the checkpoint so that best-k within a run is one index range scan.
    """

    __tablename__ = "metric_values"
    __table_args__ = (
        Index("ix_metric_values_run_rank", "run_id", "name", "effective", "value"),
        Index("ix_metric_values_rank", "name", "effective", "value"),
    )

    # After the shared columns: the primary key is (checkpoint_id, name, source).
    source: Mapped[str] = mapped_column(String(16), primary_key=True, sort_order=1)
    effective: Mapped[bool] = mapped_column(Boolean, default=True, sort_order=1)


class EvaluationMetric(_CheckpointValue, Base):
    """One finite numeric metric of one checkpoint from a named evaluation (not "default"):
    each validator's values stay apart, and best-k by one of them uses an index."""

    __tablename__ = "evaluation_metrics"
    __table_args__ = (
        Index("ix_evaluation_metrics_run_rank", "run_id", "validator", "name", "value"),
        Index("ix_evaluation_metrics_rank", "validator", "name", "value"),
    )

    validator: Mapped[str] = mapped_column(String(128), primary_key=True)


class ValidationJob(Base):
    __tablename__ = "validation_jobs"
    __table_args__ = (
        Index("ix_validation_jobs_due", "status", "pool", "background", "priority", "not_before"),
        Index("ix_validation_jobs_checkpoint_validator", "checkpoint_id", "validator"),
        Index("ix_validation_jobs_lease", "status", "lease_expires_at"),
        # The dashboard's last activity per run and /metrics' changes since a scrape.
        Index("ix_validation_jobs_run_updated", "run_id", "updated_at"),
        Index("ix_validation_jobs_updated", "updated_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True
    )
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    idempotency_key: Mapped[str] = mapped_column(String(512), unique=True)
    validate_fn_ref: Mapped[str | None] = mapped_column(Text, nullable=True)
    validate_fn_pickle: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    validate_fn_name: Mapped[str] = mapped_column(String(512), default="")
    validate_config: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    executor_kind: Mapped[str] = mapped_column(String(32))
    resources: Mapped[dict[str, Any]] = mapped_column(default=dict)
    pool: Mapped[str] = mapped_column(String(128))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    # The evaluation this job belongs to: "default" is report()'s, others revalidate()'s.
    validator: Mapped[str] = mapped_column(
        String(128), default=DEFAULT_VALIDATOR, server_default=DEFAULT_VALIDATOR
    )
    # Queued over history (revalidate): claimed after the live runs' jobs of its pool.
    background: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # 32: WAITING_FOR_RESOURCES (migration 0009).
    status: Mapped[str] = mapped_column(String(32), default=JobStatus.QUEUED.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    # Attempts made before the last `retry`: each retry grants max_attempts afresh.
    attempts_before_retry: Mapped[int] = mapped_column(Integer, default=0)
    not_before: Mapped[dt.datetime] = mapped_column(default=utcnow)
    lease_owner: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # Fencing token: bumped on every claim; only its holder may finish the job.
    lease_token: Mapped[int] = mapped_column(BigInteger, default=0)
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    timeout_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    retry_on_timeout: Mapped[bool] = mapped_column(Boolean, default=False)
    error_type: Mapped[str | None] = mapped_column(String(255), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    error_traceback: Mapped[str | None] = mapped_column(Text, nullable=True)
    result_metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # What the attempt that finished it warned of (a sink that logged elsewhere).
    warnings: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # While WAITING_FOR_RESOURCES: since when, and what for (the Ray resources its task
    # asks for, and the nodes or node types that could serve it).
    waiting_since: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    waiting_for: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    checkpoint: Mapped[Checkpoint] = relationship(back_populates="jobs")
    attempt_rows: Mapped[list[ValidationAttempt]] = relationship(
        back_populates="job", order_by="ValidationAttempt.attempt"
    )


class ValidationAttempt(Base):
    """One execution of a job: where it ran and when, as reported by the executor."""

    __tablename__ = "validation_attempts"
    __table_args__ = (UniqueConstraint("job_id", "attempt", name="uq_validation_attempts_job"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(
        ForeignKey("validation_jobs.id", ondelete="CASCADE"), index=True
    )
    attempt: Mapped[int] = mapped_column(Integer)
    lease_token: Mapped[int] = mapped_column(BigInteger)
    lease_owner: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.RUNNING.value)
    claimed_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    node_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    worker_pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The attempt's output, when its validator keeps it (a CommandValidator's program).
    log: Mapped[str | None] = mapped_column(Text, nullable=True)
    # What the attempt held while it ran: its node's accelerator type, how many
    # accelerators (GPUs), and for how many seconds (None where nobody saw it run).
    accelerator_type: Mapped[str | None] = mapped_column(String(64), nullable=True)
    accelerators: Mapped[float | None] = mapped_column(Float, nullable=True)
    running_s: Mapped[float | None] = mapped_column(Float, nullable=True)

    job: Mapped[ValidationJob] = relationship(back_populates="attempt_rows")


class CheckpointAlias(Base):
    """A name for one checkpoint of a run ("best", "production"); one row per (run, alias),
    so moving an alias is one upsert."""

    __tablename__ = "checkpoint_aliases"
    __table_args__ = (UniqueConstraint("run_id", "alias", name="uq_checkpoint_aliases_run_alias"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    alias: Mapped[str] = mapped_column(String(255))
    checkpoint_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True
    )
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class TrackedAlias(Base):
    """A rule that keeps an alias on the run's best checkpoint by a metric, re-applied as
    validations finish."""

    __tablename__ = "tracked_aliases"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    alias: Mapped[str] = mapped_column(String(255), primary_key=True)
    metric: Mapped[str] = mapped_column(String(255))
    mode: Mapped[str] = mapped_column(String(8))


class CheckpointTag(Base):
    """A key = value string tag of one checkpoint (as MLflow's tags)."""

    __tablename__ = "checkpoint_tags"
    __table_args__ = (Index("ix_checkpoint_tags_key_value", "key", "value"),)

    checkpoint_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    value: Mapped[str] = mapped_column(String(1000))


class RetentionPolicy(Base):
    """Which checkpoints the service keeps as validations finish, for one run name or
    (``run_name`` empty) for every run of a namespace."""

    __tablename__ = "retention_policies"
    __table_args__ = (
        UniqueConstraint("namespace", "run_name", name="uq_retention_policies_scope"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    namespace: Mapped[str] = mapped_column(String(255))
    run_name: Mapped[str] = mapped_column(String(255))
    metric: Mapped[str] = mapped_column(String(255))
    mode: Mapped[str] = mapped_column(String(8))
    keep_best: Mapped[int] = mapped_column(Integer)
    keep_best_per_run: Mapped[int] = mapped_column(Integer)
    keep_latest: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class StopPolicyRow(Base):
    """The early-stopping policy of one run name (validation_service.stopping.StopPolicy),
    stored by name so that it can be set before the run's first report and applies to
    every attempt of the run."""

    __tablename__ = "stop_policies"
    __table_args__ = (UniqueConstraint("namespace", "run_name", name="uq_stop_policies_run"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    namespace: Mapped[str] = mapped_column(String(255))
    run_name: Mapped[str] = mapped_column(String(255))
    metric: Mapped[str] = mapped_column(String(255))
    mode: Mapped[str] = mapped_column(String(8))
    patience: Mapped[int | None] = mapped_column(Integer, nullable=True)
    min_delta: Mapped[float] = mapped_column(Float)
    threshold: Mapped[float | None] = mapped_column(Float, nullable=True)
    divergence: Mapped[float | None] = mapped_column(Float, nullable=True)
    median_of_runs: Mapped[bool] = mapped_column(Boolean)
    warmup: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class StopDecisionRow(Base):
    """A run attempt's decision to stop: the rule, the checkpoint and the values that
    decided, under the policy of that moment. One per (run, round): the first decision
    stays; a user's override closes the round (``overridden_at``) and the rules may decide
    again, a round later, on checkpoints after ``resumed_after_index``."""

    __tablename__ = "stop_decisions"
    __table_args__ = (UniqueConstraint("run_id", "round", name="uq_stop_decisions_run_round"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    round: Mapped[int] = mapped_column(Integer)
    rule: Mapped[str] = mapped_column(String(32))
    report_index: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(Text)
    policy: Mapped[dict[str, Any]] = mapped_column()
    # [[report index, value], ...] that decided, and what they were compared with.
    metric_values: Mapped[list[Any]] = mapped_column(JSON)
    reference: Mapped[float | None] = mapped_column(Float, nullable=True)
    # [[report index, why], ...]: checkpoints passed over (failed, timed out, no value).
    skipped: Mapped[list[Any]] = mapped_column(JSON)
    decided_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    overridden_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # The last report index reserved when the override came: later rounds look after it.
    resumed_after_index: Mapped[int | None] = mapped_column(Integer, nullable=True)


class ServiceReplica(Base):
    """One replica of a service: who claims from this registry, where, and how fresh its
    last heartbeat is. Written by the replica at start and at every heartbeat."""

    __tablename__ = "service_replicas"
    __table_args__ = (Index("ix_service_replicas_service", "service_name"),)

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    service_name: Mapped[str] = mapped_column(String(255))
    # The lease owner of the replica's current incarnation (its jobs' lease_owner).
    owner: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    hostname: Mapped[str] = mapped_column(String(255))
    node_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    started_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    stopped_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)


class CheckpointAssembly(Base):
    """One report's checkpoint while several ranks store their parts of it.

    The checkpoints row is registered only when the assembly is COMPLETE: until then
    nothing lists, ranks or validates it (see registry/assemblies.py).
    """

    __tablename__ = "checkpoint_assemblies"
    __table_args__ = (
        UniqueConstraint("run_id", "group_key", name="uq_assemblies_run_group"),
        Index("ix_assemblies_run_status", "run_id", "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    # "<worker group>-<report call>": the same on every rank of one report.
    group_key: Mapped[str] = mapped_column(String(128))
    report_index: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default=AssemblyStatus.ASSEMBLING.value)
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    # How many ranks the worker group has: the seal waits until each reported past it.
    world_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    deleted_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)


class RegistryIdentity(Base):
    """The registry's one id, made by its migration: two processes whose registries have
    the same id report into the same database."""

    __tablename__ = "registry_identity"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class ReportProgress(Base):
    """How far one rank of a worker group has reported: its report() calls so far. A
    checkpoint of several ranks waits until every rank has reported past it."""

    __tablename__ = "report_progress"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    worker_group: Mapped[str] = mapped_column(String(128), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    last_call: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class CheckpointPart(Base):
    """One rank's part of an assembly: stored (where its files are and their manifest),
    or failed (``detail`` says why)."""

    __tablename__ = "checkpoint_parts"

    assembly_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoint_assemblies.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default=PartStatus.STORED.value)
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    location: Mapped[str | None] = mapped_column(Text, nullable=True)
    # relative path -> {"size", "<algorithm>": digest} ("blake3"; "sha256" from earlier
    # releases); for a folder registered in place, the files its rank hashed, or None.
    files: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    reported_metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    registered_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Watch(Base):
    """A folder the service lists for new step folders of a run (Registry.watch).

    Claimed for each listing as a job is, under a lease and a fencing token, so that one
    replica at a time lists it; ``request`` and the two payloads are the validation each
    new step folder gets, signed for the watch (signing.watch_binding).
    """

    __tablename__ = "watches"
    __table_args__ = (
        # Two live watches of one folder into one run would register each step twice.
        Index(
            "uq_watches_live_folder",
            "namespace",
            "run_name",
            "uri",
            unique=True,
            sqlite_where=text("removed_at IS NULL"),
            postgresql_where=text("removed_at IS NULL"),
        ),
        Index("ix_watches_due", "removed_at", "next_listing_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    namespace: Mapped[str] = mapped_column(String(255))
    run_name: Mapped[str] = mapped_column(String(255))
    uri: Mapped[str] = mapped_column(Text)
    validator: Mapped[str] = mapped_column(String(128))
    # The ValidationRequest's fields but the two payloads (validate_fn ref, resources...).
    request: Mapped[dict[str, Any]] = mapped_column()
    validate_fn_pickle: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    validate_config: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    # "auto", "marker:NAME" or "stable:SECONDS" (watching.ReadyRule).
    ready: Mapped[str] = mapped_column(String(300))
    pattern: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # Each step folder copied into ckval's storage before it is registered.
    copy: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    removed_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    next_listing_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    lease_owner: Mapped[str | None] = mapped_column(String(255), nullable=True)
    lease_token: Mapped[int] = mapped_column(BigInteger, default=0)
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    last_listed_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # Why the last listing registered nothing it should have (unreadable, a bad name...).
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)


class WatchedFolder(Base):
    """One step folder a watch has seen: waiting (not ready yet, since ``first_seen_at``),
    copying (copy=True: its report index reserved) or registered. Its primary key makes
    each step folder of a watch registered once, whichever replica lists it."""

    __tablename__ = "watched_folders"

    watch_id: Mapped[int] = mapped_column(
        ForeignKey("watches.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(512), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))
    # What its files looked like at the last listing, and since when they look so.
    fingerprint: Mapped[str] = mapped_column(String(64))
    first_seen_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    changed_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    report_index: Mapped[int | None] = mapped_column(Integer, nullable=True)
    checkpoint_id: Mapped[int | None] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="SET NULL"), nullable=True
    )
    registered_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
