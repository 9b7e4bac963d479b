"""Status enums for validation jobs, checkpoints and runs; the one place state names live."""

from __future__ import annotations

import enum

# The evaluation report() asks for; revalidate() queues others under names of their own.
DEFAULT_VALIDATOR = "default"


class JobStatus(str, enum.Enum):
    """Life cycle of one validation job.

    QUEUED -> RUNNING -> SUCCEEDED | FAILED | TIMED_OUT | CANCELLED, and
    RUNNING -> QUEUED on a retry or an expired lease. A claimed job whose Ray task waits
    for resources (a node the autoscaler is adding, GPUs other tasks hold) is
    WAITING_FOR_RESOURCES until the task starts: RUNNING <-> WAITING_FOR_RESOURCES. It
    holds its lease and its pool's slot all along; its timeout_s counts only while it runs.
    """

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    WAITING_FOR_RESOURCES = "WAITING_FOR_RESOURCES"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    TIMED_OUT = "TIMED_OUT"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_JOB_STATUSES


TERMINAL_JOB_STATUSES = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.TIMED_OUT, JobStatus.CANCELLED}
)
# Claimed under a lease: its attempt is launched, and it takes one of its pool's slots.
LEASED_JOB_STATUSES = frozenset({JobStatus.RUNNING, JobStatus.WAITING_FOR_RESOURCES})
ACTIVE_JOB_STATUSES = frozenset({JobStatus.QUEUED, *LEASED_JOB_STATUSES})


class ValidationStatus(str, enum.Enum):
    """What a checkpoint's row says about its validation (mirrors its job)."""

    NONE = "NONE"  # reported without a validate_fn
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    VALIDATED = "VALIDATED"
    FAILED = "FAILED"
    TIMED_OUT = "TIMED_OUT"
    CANCELLED = "CANCELLED"


JOB_TO_VALIDATION_STATUS = {
    JobStatus.QUEUED: ValidationStatus.PENDING,
    JobStatus.RUNNING: ValidationStatus.RUNNING,
    # Its validation has not begun: the checkpoint's says so as for a queued one.
    JobStatus.WAITING_FOR_RESOURCES: ValidationStatus.PENDING,
    JobStatus.SUCCEEDED: ValidationStatus.VALIDATED,
    JobStatus.FAILED: ValidationStatus.FAILED,
    JobStatus.TIMED_OUT: ValidationStatus.TIMED_OUT,
    JobStatus.CANCELLED: ValidationStatus.CANCELLED,
}


class RunStatus(str, enum.Enum):
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"


class AssemblyStatus(str, enum.Enum):
    """A checkpoint written by several ranks, part by part (registry/assemblies.py).

    ASSEMBLING -> SEALING -> COMPLETE (the checkpoint row is registered), and
    ASSEMBLING | SEALING -> INCOMPLETE when a part can no longer come (its rank died:
    the run ended, or a restarted worker group reports on) or sealing failed.
    """

    ASSEMBLING = "ASSEMBLING"
    SEALING = "SEALING"
    COMPLETE = "COMPLETE"
    INCOMPLETE = "INCOMPLETE"


class PartStatus(str, enum.Enum):
    """One rank's part of a report of several ranks (registry/assemblies.py): PENDING
    from its join until it is STORED, or FAILED (its folder could not be stored: the
    report stays INCOMPLETE)."""

    PENDING = "pending"
    STORED = "stored"
    FAILED = "failed"


class MetricSource(str, enum.Enum):
    REPORTED = "reported"
    VALIDATED = "validated"


class ExecutorKind(str, enum.Enum):
    """How one validation runs; the scheduler picks the executor by this."""

    RAY_TASK = "ray_task"


class WatchedFolderState(str, enum.Enum):
    """A step folder a watch has seen (registry/watches.py).

    WAITING -> REGISTERED once it is ready (registered in place), or, for a watch that
    copies, WAITING -> COPYING (its report index reserved) -> REGISTERED.
    """

    WAITING = "WAITING"
    COPYING = "COPYING"
    REGISTERED = "REGISTERED"
