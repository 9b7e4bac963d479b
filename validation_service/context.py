"""Which validation is running: the context a validate_fn (or a validator) can ask for."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class ValidationContext:
    """Which validation is running, for validators that name things after it."""

    run: str
    namespace: str
    report_index: int
    job_id: int
    attempt: int
    checkpoint_uri: str
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    # What the validator chose to keep with the attempt (`ckval job N --log`).
    kept_output: list[str] = dataclasses.field(default_factory=list)

    def keep_output(self, text: str) -> None:
        """Keeps ``text`` with the attempt, as its log (its last MAX_LOG_CHARS)."""
        self.kept_output.append(text)

    def stored_checkpoint(self):
        """The checkpoint where it is stored (any node can read it), not a local copy."""
        from validation_service.storage import ray_checkpoint

        return ray_checkpoint(self.checkpoint_uri, self.storage_options)


_current: contextvars.ContextVar[ValidationContext | None] = contextvars.ContextVar(
    "ckval_current_validation", default=None
)


def current_validation() -> ValidationContext | None:
    """The validation this code runs in (inside a validate_fn), else None."""
    return _current.get()


@contextlib.contextmanager
def validation_context(context: ValidationContext) -> Iterator[ValidationContext]:
    """Makes ``context`` the current validation while the block runs."""
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)
