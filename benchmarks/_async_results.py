"""What bench_async_validation.py measures and prints: one row per way and run, the
median of repeated runs, the markdown tables, and the checks that make a comparison valid."""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any

from _async_options import SCENARIOS

# ckval's ways and the native way each is held against: Ray's guide calls ASYNC.
COMPARED = {"ckval": "native", "ckval-async": "native"}


@dataclasses.dataclass
class WayResult:
    scenario: str
    way: str
    checkpoints: int
    steps_per_checkpoint: int
    e2e_s: float
    report_blocked_s: float
    inline_validation_s: float
    final_wait_s: float
    until_fit_s: float
    total_validation_s: float
    validations: int
    best_accuracy: float
    mean_train_interval_s: float
    first_report_blocked_s: float = 0.0
    later_report_median_s: float = 0.0  # the median report() after the first
    load_1min: float = 0.0  # the machine's 1-minute load average when the run ended
    checkpoint_mb: float = 0.0
    runs: int = 1
    detail: str = ""

    @property
    def blocked_per_report_s(self) -> float:
        return self.report_blocked_s / max(self.checkpoints, 1)

    @property
    def blocking_s(self) -> float:
        """Time the run was held up by validation (Ray's release-test definition)."""
        return self.report_blocked_s + self.inline_validation_s + self.final_wait_s


def way_result(
    scenario, way, checkpoints, steps, started, ended, timings, validated, available=None
):
    if available is None:  # when the last validate_fn returned
        available = max((m["finished_at"] for m in validated), default=ended)
    return WayResult(
        scenario=scenario,
        way=way,
        checkpoints=checkpoints,
        steps_per_checkpoint=steps,
        e2e_s=ended - started,
        report_blocked_s=sum(timings["report_blocked_s"]),
        inline_validation_s=sum(timings["inline_validation_s"]),
        final_wait_s=max(0.0, available - timings["loop_end"]),
        until_fit_s=ended - timings["loop_end"],
        total_validation_s=sum(m["validation_time"] for m in validated),
        validations=len(validated),
        best_accuracy=max((m["accuracy"] for m in validated), default=float("nan")),
        mean_train_interval_s=sum(timings["train_s"]) / max(len(timings["train_s"]), 1),
        first_report_blocked_s=timings["report_blocked_s"][0] if timings["report_blocked_s"] else 0,
        later_report_median_s=statistics.median(timings["report_blocked_s"][1:] or [0.0]),
        load_1min=os.getloadavg()[0],
    )


def median_result(runs: list[WayResult]) -> WayResult:
    """One row for repeated runs of a way: the median of every measured number."""
    if len(runs) == 1:
        return runs[0]
    numbers = {
        f.name: statistics.median(getattr(r, f.name) for r in runs)
        for f in dataclasses.fields(WayResult)
        if f.type in ("float", float)
    }
    details = "; ".join(f"run {i + 1}: {r.detail}" for i, r in enumerate(runs) if r.detail)
    return dataclasses.replace(
        runs[0],
        **numbers,
        validations=min(r.validations for r in runs),
        runs=len(runs),
        detail=details,
    )


def ckval_latency(jobs) -> str:
    """Where ckval's validation time went, per job: queued, task start, attempt running."""

    def mean(deltas) -> float:
        seconds = [d.total_seconds() for d in deltas]
        return sum(seconds) / max(len(seconds), 1)

    for job in jobs:
        if job.status != "SUCCEEDED":
            print(f"  ckval job {job.report_index}: {job.status} {job.error_message}")
    done = [(job, job.attempt_history[-1]) for job in jobs if job.status == "SUCCEEDED"]
    done = [(j, a) for j, a in done if a.started_at and a.finished_at and j.finished_at]
    if not done:
        return ""
    return (
        f"ckval per job (mean s): queued {mean(a.claimed_at - j.created_at for j, a in done):.2f}"
        f", task start {mean(a.started_at - a.claimed_at for j, a in done):.2f}"
        f", attempt running {mean(a.finished_at - a.started_at for j, a in done):.2f}"
        f", recorded {mean(j.finished_at - a.finished_at for j, a in done):.2f}"
        f"; {len({a.worker_pid for _, a in done})} worker process(es)"
    )


def render_markdown(results: list[WayResult], meta: dict[str, Any]) -> str:
    lines = [
        "# Async validation: inline vs Ray Train native vs ckval",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']}",
        f"- versions: {meta['versions']}",
        f"- load average (1/5/15 min) before: {meta['load_before']}, after: {meta['load_after']}",
        f"- workload: MLP 64-64-10 on sklearn digits, TorchTrainer with {meta['workers']} "
        f"workers, SGD lr {meta['lr']}, batch {meta['batch_size']}, seed {meta['seed']}; "
        "one validation = "
        f"held-out accuracy + accuracy over {meta['noisy_copies']} noised copies of the "
        f"held-out set (torchmetrics), calibrated to ~{meta['validation_seconds']:g} s "
        f"on the driver; {meta['step_ms']:.2f} ms per training step (calibrated)",
        f"- ckval: service pool concurrency {meta['ckval_concurrency']}; native: Ray's "
        "MAX_IN_FLIGHT_VALIDATIONS = 1; both 1 CPU per validation; Ray logical CPUs "
        f"{meta['ray_cpus']}",
        f"- wall time of the whole script: {meta['wall_s']:.0f} s",
        "- warm-up: "
        + (
            "one untimed 2-checkpoint run per way before the measured runs"
            if meta["warmup"]
            else "none (the first run of each way starts cold)"
        ),
        "",
        "Columns: e2e = fit() start until the driver holds every validated metric; report "
        "blocked = sum over reports of the longest time a rank was blocked in report(); in-loop "
        "val = validation inside the"
        " loop (inline only); final wait = training loop end until the last validated metric is"
        " available (native: its last validation task returned, in the controller; ckval: "
        "committed to the registry; inline: 0); until fit() = training loop end until fit() "
        "returned and the driver holds every validated metric (includes Ray Train's shutdown of"
        " the run); blocking = report blocked + in-loop val + final wait; validation = sum of "
        "validate_fn durations; interval = mean training time between checkpoints; first report"
        " = how long the first report() blocked (it includes one-time set-up: Ray Train's own,"
        " and for ckval pickling validate_fn); later reports = the median time one report() after"
        " the first blocked; load = the machine's 1-minute load average at"
        " the end of the run (above 2 on 2 cores means other processes competed for the CPUs)."
        + (f" Medians of {meta['repeats']} runs per row." if meta["repeats"] > 1 else ""),
        "",
    ]
    for scenario in dict.fromkeys(r.scenario for r in results):
        rows = [r for r in results if r.scenario == scenario]
        lines += [
            f"## Scenario `{scenario}` ({SCENARIOS[scenario]:g}x the validation time "
            "between checkpoints)",
            "",
            "| checkpoints | ckpt MB | K steps | way | e2e (s) | report blocked (s) "
            "| per report (ms) | first report (s) "
            "| later reports, median (ms) | in-loop val (s) | final wait (s) | until fit() (s) "
            "| blocking (s) | validation (s) | validated | interval (s) | best accuracy | load |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r.checkpoints} | {r.checkpoint_mb:g} | {r.steps_per_checkpoint} | {r.way} "
                f"| {r.e2e_s:.2f} | {r.report_blocked_s:.3f} "
                f"| {1000 * r.blocked_per_report_s:.1f} | {r.first_report_blocked_s:.3f} "
                f"| {1000 * r.later_report_median_s:.1f} "
                f"| {r.inline_validation_s:.2f} "
                f"| {r.final_wait_s:.2f} | {r.until_fit_s:.2f} | {r.blocking_s:.2f} "
                f"| {r.total_validation_s:.2f} "
                f"| {r.validations}/{r.checkpoints} | {r.mean_train_interval_s:.2f} "
                f"| {r.best_accuracy:.4f} | {r.load_1min:.1f} |"
            )
        details = [f"- {r.checkpoints} checkpoints, {r.way}: {r.detail}" for r in rows if r.detail]
        lines += ["", *ratio_table(rows), "", *details, ""]
    return "\n".join(lines)


def ratio_table(rows: list[WayResult]) -> list[str]:
    lines = [
        "ckval / native in the same run (below 1 is better for ckval); native is Ray's "
        "ASYNC call, as in its guide:",
        "",
        "| checkpoints | ckpt MB | ckval way | e2e | report blocked | later reports "
        "| final wait | until fit() | blocking | final wait native (s) | final wait ckval (s) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, mb in dict.fromkeys((r.checkpoints, r.checkpoint_mb) for r in rows):
        by_way = {r.way: r for r in rows if (r.checkpoints, r.checkpoint_mb) == (n, mb)}
        for way, against in COMPARED.items():
            ckval, native = by_way.get(way), by_way.get(against)
            if native is None or ckval is None:
                continue
            lines.append(
                f"| {n} | {mb:g} | {way} | {_ratio(ckval.e2e_s, native.e2e_s)} "
                f"| {_ratio(ckval.report_blocked_s, native.report_blocked_s)} "
                f"| {_ratio(ckval.later_report_median_s, native.later_report_median_s)} "
                f"| {_ratio(ckval.final_wait_s, native.final_wait_s)} "
                f"| {_ratio(ckval.until_fit_s, native.until_fit_s)} "
                f"| {_ratio(ckval.blocking_s, native.blocking_s)} "
                f"| {native.final_wait_s:.2f} | {ckval.final_wait_s:.2f} |"
            )
    return lines


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def check_results(results: list[WayResult], tolerance: float) -> list[str]:
    """Problems that make the comparison invalid: missing validations, differing scores."""
    problems = []
    for r in results:
        if r.validations != r.checkpoints:
            problems.append(
                f"{r.scenario}/{r.checkpoints}/{r.way}: {r.validations} of "
                f"{r.checkpoints} checkpoints validated"
            )
    groups: dict[tuple, list[WayResult]] = {}
    for r in results:
        groups.setdefault((r.scenario, r.checkpoints, r.checkpoint_mb), []).append(r)
    for (scenario, n, _), rows in groups.items():
        scores = [r.best_accuracy for r in rows]
        if max(scores) - min(scores) > tolerance:
            detail = ", ".join(f"{r.way}={r.best_accuracy:.4f}" for r in rows)
            problems.append(
                f"{scenario}/{n}: best accuracy differs by more than {tolerance}: {detail}"
            )
    return problems
