"""The dashboard's JSON: a page of runs, one run's series, timeline and tables, a comparison.

The pages embed the same JSON their data endpoints return, so the first paint and every
refresh go through one renderer in dashboard.js.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from typing import Any
from urllib.parse import quote

from validation_service.api.views import (
    cost_json,
    iso,
    job_json,
    labelled_checkpoint_json,
    run_record_json,
    stop_decision_json,
    stop_policy_json,
)
from validation_service.errors import InvalidInput
from validation_service.jobs import ACTIVE_JOB_STATUSES, DEFAULT_VALIDATOR, JobStatus
from validation_service.registry.dashboard_reads import DashboardReader
from validation_service.registry.records import CheckpointRecord, ValidationCost
from validation_service.registry.stats import Mode, RunPage, default_mode

# More runs than this in one plot is unreadable; the page says so instead of drawing it.
MAX_COMPARED_RUNS = 20
# A run page holds the values of this many metrics (the first reported) unless asked for
# more (max_metrics=) or for others (metric=), and of at most MAX_METRICS_PER_PAGE: its
# data, refetched every 2 s while validations run, grows with checkpoints x metrics shown.
METRICS_PER_PAGE = 50
MAX_METRICS_PER_PAGE = 500
_ACTIVE = frozenset(status.value for status in ACTIVE_JOB_STATUSES)


def run_url(base: str, run: str) -> str:
    return f"{base}/runs/{quote(run, safe='')}"


def runs_json(page: RunPage, base: str) -> dict[str, Any]:
    rows = []
    for item in page.runs:
        counts = item.job_counts
        rows.append(
            {
                "name": item.run.name,
                "namespace": item.run.namespace,
                "status": item.run.status,
                "checkpoints": item.checkpoints,
                "validated": counts.get(JobStatus.SUCCEEDED.value, 0),
                "queued": counts.get(JobStatus.QUEUED.value, 0),
                "running": counts.get(JobStatus.RUNNING.value, 0),
                "waiting": counts.get(JobStatus.WAITING_FOR_RESOURCES.value, 0),
                "failed": counts.get(JobStatus.FAILED.value, 0)
                + counts.get(JobStatus.TIMED_OUT.value, 0),
                "best": _finite(item.best),
                "last_activity": iso(item.last_activity),
                "url": run_url(base, item.run.name),
            }
        )
    return {
        "page": page.page,
        "per_page": page.per_page,
        "total": page.total,
        "pages": max(1, math.ceil(page.total / page.per_page)),
        "metric": page.metric,
        "mode": page.mode,
        "metrics": page.metrics,
        "active_jobs": page.active_jobs,
        "runs": rows,
    }


@dataclasses.dataclass(frozen=True)
class MetricChoice:
    """Which metrics a run page shows: those named (``metric=``, in that order), else the
    first ``max_metrics`` the run reported."""

    names: tuple[str, ...] = ()
    max_metrics: int = METRICS_PER_PAGE

    def check(self) -> MetricChoice:
        """This choice, or InvalidInput (a 422) naming the cap and what to ask instead."""
        if not 1 <= self.max_metrics <= MAX_METRICS_PER_PAGE:
            raise InvalidInput(
                f"max_metrics={self.max_metrics}: a run page shows at most "
                f"{MAX_METRICS_PER_PAGE} metrics (at least 1; {METRICS_PER_PAGE} unless "
                "asked). Ask for fewer, or name the ones to show with metric=NAME, repeated."
            )
        names = tuple(dict.fromkeys(self.names))
        if len(names) > MAX_METRICS_PER_PAGE:
            raise InvalidInput(
                f"metric= names {len(names)} metrics: a run page shows at most "
                f"{MAX_METRICS_PER_PAGE}. Name at most {MAX_METRICS_PER_PAGE} in one request, "
                "and the others in another."
            )
        return dataclasses.replace(self, names=names)

    def shown(self, names: list[str]) -> list[str]:
        """The run's metrics (``names``) that the page shows."""
        if not self.names:
            return names[: self.max_metrics]
        known = set(names)
        return [name for name in self.names if name in known]


def run_json(
    reader: DashboardReader, run: str, base: str, choice: MetricChoice | None = None
) -> dict[str, Any]:
    """One run: its record, a series per metric shown, its checkpoints and its jobs (with
    the values of the metrics shown), and its stop policy with the latest decision of
    its latest attempt (the plots mark it), and what its validations held
    (``cost``: accelerator-seconds by validator, pool and accelerator type).
    ``metrics_total`` counts the run's metrics, ``metrics_omitted`` names those not shown."""
    choice = (choice or MetricChoice()).check()
    view = reader.run_view(run)  # one read: the record, checkpoints and jobs agree
    checkpoints, jobs = view.checkpoints, view.jobs
    names = metric_names(checkpoints)
    shown = choice.shown(names)
    kept = set(shown)
    return {
        "run": run_record_json(view.record),
        "metrics_total": len(names),
        "metrics_shown": shown,
        "metrics_omitted": [name for name in names if name not in kept],
        "metrics_not_found": [name for name in choice.names if name not in kept],
        "metrics_cap": MAX_METRICS_PER_PAGE,
        "url": run_url(base, run),
        "active_jobs": sum(1 for job in jobs if job.status in _ACTIVE),
        "now": now_iso(),  # running jobs' bars end here on the timeline
        "series": series_by_metric(checkpoints, shown),
        "validators": named_validators(checkpoints),
        "checkpoints": [_with_metrics(labelled_checkpoint_json(c), kept) for c in checkpoints],
        "jobs": [_with_result_metrics(job_json(job), kept) for job in jobs],
        "stop_policy": stop_policy_json(view.stop_policy),
        "stop_decision": stop_decision_json(view.stop_decision),
        "cost": cost_json(ValidationCost.of_jobs(jobs)),
    }


def _with_metrics(checkpoint: dict[str, Any], kept: set[str]) -> dict[str, Any]:
    """A checkpoint's JSON with the values of the ``kept`` metrics only."""
    for key in ("metrics", "reported_metrics", "validated_metrics"):
        if checkpoint[key] is not None:
            checkpoint[key] = {k: v for k, v in checkpoint[key].items() if k in kept}
    evaluations = checkpoint.get("evaluations") or {}
    checkpoint["evaluations"] = {  # "default" is validated_metrics already
        validator: {k: v for k, v in metrics.items() if k in kept}
        for validator, metrics in evaluations.items()
        if validator != DEFAULT_VALIDATOR
    }
    return checkpoint


def named_validators(checkpoints: list[CheckpointRecord]) -> list[str]:
    """The validators other than report()'s own ("default") with results in the run."""
    names: set[str] = set()
    for c in checkpoints:
        names.update(c.evaluations)
    names.discard(DEFAULT_VALIDATOR)
    return sorted(names)


def _with_result_metrics(job: dict[str, Any], kept: set[str]) -> dict[str, Any]:
    """A job's JSON with the validated values of the ``kept`` metrics only."""
    if job["result_metrics"] is not None:
        job["result_metrics"] = {k: v for k, v in job["result_metrics"].items() if k in kept}
    return job


def metric_names(checkpoints: list[CheckpointRecord]) -> list[str]:
    """The names of the checkpoints' metrics, in the order they first appear (reported
    before validated); linear in the checkpoints' metrics."""
    names: dict[str, None] = {}
    for c in checkpoints:
        names.update(dict.fromkeys(c.reported_metrics))
        for metrics in c.evaluations.values():  # "default" (validated) and named ones
            names.update(dict.fromkeys(metrics))
        names.update(dict.fromkeys(c.validated_metrics or {}))
    return list(names)


def series_by_metric(
    checkpoints: list[CheckpointRecord], names: list[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Metric -> the reported and the validated values over report index, aligned on the
    run's report indexes (None where a checkpoint has no finite value), and the best point
    of the merged values; for each of ``names`` (default: the first METRICS_PER_PAGE of
    metric_names) with a finite value somewhere. Linear in checkpoints x names."""
    names = metric_names(checkpoints)[:METRICS_PER_PAGE] if names is None else names
    x = [c.report_index for c in checkpoints]
    series = {}
    for name in names:
        mode = default_mode(name)
        reported = [_finite(c.reported_metrics.get(name)) for c in checkpoints]
        validated = [_finite((c.validated_metrics or {}).get(name)) for c in checkpoints]
        merged = [_finite(c.metrics.get(name)) for c in checkpoints]
        by_validator = _named_values(checkpoints, name)
        if all(v is None for v in (*reported, *validated, *merged)) and not by_validator:
            continue  # nothing to plot: shown in the checkpoints' table only
        best = _best_index(merged, mode)
        series[name] = {
            "mode": mode,
            "x": x,
            "reported": reported,
            "validated": validated,
            "validators": by_validator,
            "best": None if best is None else {"report_index": x[best], "value": merged[best]},
        }
    return series


def _named_values(checkpoints: list[CheckpointRecord], name: str) -> dict[str, list]:
    """Named validator -> its values of the metric over report index, where it has any."""
    found: dict[str, list] = {}
    for i, c in enumerate(checkpoints):
        for validator, metrics in c.evaluations.items():
            value = _finite(metrics.get(name))
            if validator != DEFAULT_VALIDATOR and value is not None:
                found.setdefault(validator, [None] * len(checkpoints))[i] = value
    return dict(sorted(found.items()))


def compare_json(
    reader: DashboardReader, runs_param: str, metric: str | None, mode: Mode | None, base: str
) -> dict[str, Any]:
    """Several runs' values of one metric, aligned on the union of their report indexes."""
    runs = parse_runs(runs_param)
    if not metric:
        raise InvalidInput(
            "compare needs metric=NAME, the metric to plot for runs "
            f"{', '.join(runs)}; open a run's page to see the metrics it recorded."
        )
    series = reader.metric_series(runs, metric)
    x = sorted({point.report_index for points in series.values() for point in points})
    position = {index: i for i, index in enumerate(x)}
    aligned: dict[str, list[float | None]] = {}
    for run, points in series.items():
        values: list[float | None] = [None] * len(x)
        for point in points:
            values[position[point.report_index]] = _finite(point.value)
        aligned[run] = values
    return {
        "metric": metric,
        "mode": mode or default_mode(metric),
        "runs": runs,
        "urls": {run: run_url(base, run) for run in runs},
        "x": x,
        "series": aligned,
        "active_jobs": reader.active_job_count(runs),
    }


def parse_runs(runs_param: str) -> list[str]:
    """``runs=a,b`` as a list of names; at least one, at most MAX_COMPARED_RUNS, no repeats."""
    runs = list(dict.fromkeys(name.strip() for name in runs_param.split(",") if name.strip()))
    if not runs:
        raise InvalidInput(
            f"runs={runs_param!r} names no run: pass run names separated by commas, "
            "e.g. runs=run-a,run-b"
        )
    if len(runs) > MAX_COMPARED_RUNS:
        raise InvalidInput(
            f"runs= names {len(runs)} runs; compare at most {MAX_COMPARED_RUNS} in one plot"
        )
    return runs


def _best_index(values: list[float | None], mode: Mode) -> int | None:
    best = None
    for i, value in enumerate(values):
        if value is None:
            continue
        if best is None or (value > values[best] if mode == "max" else value < values[best]):
            best = i
    return best


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat()
