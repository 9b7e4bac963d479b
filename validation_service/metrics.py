"""Turning user metrics into what the registry stores: JSON-safe values and rankable floats."""

from __future__ import annotations

import json
import math
import numbers
import re
from typing import Any

MAX_METRICS = 1_000
MAX_METRIC_NAME = 255
MAX_METRICS_JSON_BYTES = 1_000_000


def _invalid_input(message: str) -> Exception:
    # The errors load only when one is raised: the CLI's fast listings import this module
    # (lower_is_better) and the errors would bring SQLAlchemy with them.
    from validation_service.errors import InvalidInput

    return InvalidInput(message)


def to_plain(value: Any) -> Any:
    """Tensors and NumPy scalars (what torchmetrics returns) become Python numbers."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    item = getattr(value, "item", None)
    if callable(item):
        numel = getattr(value, "numel", None) or getattr(value, "size", None)
        size = numel() if callable(numel) else numel
        if size in (None, 1):
            return item()
    if isinstance(value, numbers.Number):
        return float(value)
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    return value


def normalize_metrics(metrics: Any, *, what: str) -> dict[str, Any]:
    """Checks and converts a metrics dict; raises InvalidInput naming what is wrong."""
    if not isinstance(metrics, dict):
        raise _invalid_input(
            f"{what} must be a dict of metric name -> value, got {type(metrics).__name__}: "
            f"{_preview(metrics)}. Return e.g. {{'accuracy': 0.93}}."
        )
    if len(metrics) > MAX_METRICS:
        raise _invalid_input(
            f"{what} has {len(metrics)} entries; at most {MAX_METRICS} are stored per "
            "checkpoint. Keep per-sample or per-class values in the checkpoint files instead."
        )
    plain: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise _invalid_input(f"{what} has a key {key!r}: metric names must be non-empty str.")
        if len(key) > MAX_METRIC_NAME:
            raise _invalid_input(
                f"{what} has a metric name of {len(key)} characters "
                f"({key[:40]!r}...); at most {MAX_METRIC_NAME} are allowed."
            )
        plain[key] = _rankable_if_int(to_plain(value), key, what)
    for text in _texts(plain):
        if "\x00" in text or not _encodes(text):
            raise _invalid_input(
                f"{what} holds the text {text!r} (a metric name, or a name or text inside a "
                "value), which no registry can store: it has a NUL character or a lone "
                "surrogate (as text decoded with errors='surrogateescape' has). Use plain "
                f"text, e.g. {text.encode('utf-8', 'replace').decode().replace(chr(0), '')!r}."
            )
    try:
        encoded = json.dumps(plain, default=_reject)
    except (TypeError, ValueError) as exc:
        raise _invalid_input(f"{what} cannot be stored as JSON: {exc}") from None
    if len(encoded) > MAX_METRICS_JSON_BYTES:
        raise _invalid_input(
            f"{what} is {len(encoded)} bytes as JSON; at most {MAX_METRICS_JSON_BYTES} are "
            "stored per checkpoint. Keep large values in the checkpoint files instead."
        )
    return plain


def _texts(value: Any):
    """Every str in a plain value: dict keys and str values, at any depth."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _texts(key)
            yield from _texts(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _texts(item)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_non_finite(value: Any) -> Any:
    """NaN and infinities as the strings "NaN", "Infinity", "-Infinity", at any depth.

    Plain JSON has no such numbers and PostgreSQL's JSON types reject the tokens.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: encode_non_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_non_finite(v) for v in value]
    return value


def decode_non_finite(value: Any) -> Any:
    """The inverse of encode_non_finite."""
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, dict):
        return {k: decode_non_finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_non_finite(v) for v in value]
    return value


def rankable(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric metrics: the ones best_checkpoints can rank by."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        number = float(value)
        if math.isfinite(number):
            out[key] = number
    return out


def _rankable_if_int(value: Any, key: str, what: str) -> Any:
    """An int metric is ranked as a float: one too large for a float cannot be stored."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            float(value)
        except OverflowError:
            raise _invalid_input(
                f"{what} {key!r} is an int of {value.bit_length()} bits, too large for a "
                "float (the largest is about 1.8e308); report it as a float (inf is "
                "stored but not ranked) or as a str."
            ) from None
    return value


def _reject(value: Any) -> Any:
    raise TypeError(f"value {_preview(value)} of type {type(value).__name__} is not a number")


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Names of metrics where lower is better: ranking one with mode="max" returns the worst.
LOWER_IS_BETTER_WORDS = frozenset(
    {"loss", "error", "err", "mse", "mae", "rmse", "perplexity", "wer", "cer"}
)
# Long enough to mean the same at the end of a longer word ("valloss"); the short ones
# count only as a word of their own ("val_wer", not "power").
_LOWER_IS_BETTER_SUFFIXES = tuple(w for w in LOWER_IS_BETTER_WORDS if len(w) >= 4)


def lower_is_better(metric: str) -> bool:
    """Whether a metric's name says lower is better: a word of LOWER_IS_BETTER_WORDS in
    it (``val_loss``, ``test/error``, ``valLoss``, ``top1-err``), or a long one ending it
    (``valloss``, ``evalperplexity``)."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", metric).lower()
    if any(word in LOWER_IS_BETTER_WORDS for word in re.findall(r"[a-z0-9]+", spaced)):
        return True
    return metric.lower().endswith(_LOWER_IS_BETTER_SUFFIXES)
