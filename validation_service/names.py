"""The one rule for names that become storage path segments: namespaces and run names."""

from __future__ import annotations

import re

MAX_NAME_LENGTH = 128
# '=' is allowed after the first character: Ray's guide names each Tune trial's Ray Train
# run "train-trial_id=<id>", and 'key=value' is a plain segment in paths, URLs and buckets.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.=-]*")
_UNSAFE_CHARACTER = re.compile(r"[^A-Za-z0-9_.=-]")
RULE = (
    f"1 to {MAX_NAME_LENGTH} characters of letters, digits, '-', '_', '.' and '=', "
    "not starting with '.' or '='"
)


def is_safe_name(value: object) -> bool:
    """Whether ``value`` is a valid namespace or run name (see check_name)."""
    return (
        isinstance(value, str)
        and len(value) <= MAX_NAME_LENGTH
        and _SAFE_NAME.fullmatch(value) is not None
    )


def check_name(kind: str, value: object, *, where: str = "") -> str:
    """Returns ``value`` if it may name a namespace or a run; raises InvalidInput if not.

    Both become folders under the storage root (``<root>/<namespace>/<run>/``), so the
    rule keeps them one plain path segment: no '/', no '..', no leading '.', nothing a
    shell, a URL or an object store reads differently. ``kind`` ("namespace", "run
    name") and ``where`` (e.g. "CKVAL_NAMESPACE") name the value in the message.
    """
    if is_safe_name(value):
        return value  # type: ignore[return-value]
    # Imported here: the CLI's fast listings check a namespace without loading the errors.
    from validation_service.errors import InvalidInput

    source = f" ({where})" if where else ""
    raise InvalidInput(
        f"{kind}{source} {value!r} is not allowed: use {RULE}. "
        f"Rename it, for example to {suggested_name(value)!r}."
    )


def suggested_name(value: object) -> str:
    """A valid name close to ``value``: unsafe characters become '_'."""
    text = str(value) if value is not None else ""
    text = _UNSAFE_CHARACTER.sub("_", text).lstrip(".=")[:MAX_NAME_LENGTH]
    return text or "run"
