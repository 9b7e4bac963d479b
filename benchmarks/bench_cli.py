"""CLI start-up: each `ckval` command in a fresh process, against `python -c pass`.

    .venv/bin/python benchmarks/bench_cli.py                        # 21 rounds
    .venv/bin/python benchmarks/bench_cli.py --compare-with ../ckval-before
    .venv/bin/python benchmarks/bench_cli.py --compare-env CKVAL_CLI_FAST_READ=0
    .venv/bin/python benchmarks/bench_cli.py --smoke                # 2 rounds, for CI

Every command runs in a new Python process the way the `ckval` console script runs it,
against an embedded SQLite registry (a fresh CKVAL_HOME holding 3 runs of 50 validated
checkpoints). A round runs each command once, in turn, so that load from elsewhere on the
machine falls on all of them alike. Reported per command: the median wall time, the median
wall time above `python -c pass` (the interpreter's own start), and the median CPU time of
the process (user + system), which load from other processes inflates less than wall time.
``--compare-with DIR`` also times the same commands with the code in DIR (a checkout of
another commit) and adds its medians as columns; ``--compare-env NAME=VALUE`` (repeatable)
does so with this code and these variables set instead, e.g. CKVAL_CLI_FAST_READ=0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import command_line, load_average  # noqa: E402

# What the console script `ckval` runs (see pyproject.toml's [project.scripts]).
CKVAL = "import sys; from validation_service.cli import main; sys.exit(main(prog_name='ckval'))"
PYTHON_ONLY = {
    "python -c pass": "pass",
    "import validation_service.cli": "import validation_service.cli",
}
CKVAL_COMMANDS = [
    "ckval --help",
    "ckval runs",
    "ckval checkpoints run-0",
    "ckval best run-0 --metric accuracy -k 3",
    "ckval best --metric accuracy -k 3",
    "ckval jobs run-0",
]
COMMANDS = [(label, ["-c", code]) for label, code in PYTHON_ONLY.items()] + [
    (label, ["-c", CKVAL, *label.split()[1:]]) for label in CKVAL_COMMANDS
]
BASELINE = COMMANDS[0][0]


def populate(home: Path, runs: int, checkpoints: int) -> None:
    """An embedded registry under ``home`` with validated checkpoints in every run."""
    os.environ["CKVAL_HOME"] = str(home)
    for name in ("CKVAL_DATABASE_URL", "CKVAL_STORAGE", "CKVAL_NAMESPACE"):
        os.environ.pop(name, None)
    from validation_service.registry.records import JobOutcome
    from validation_service.registry.registry import Registry
    from validation_service.request import ValidationRequest

    registry = Registry()
    request = ValidationRequest(
        executor_kind="ray_task", pool="CPU", validate_fn_name="v", validate_fn_ref="json:dumps"
    )
    for r in range(runs):
        run_id = registry.ledger.ensure_run(f"run-{r}", storage_root=str(home / "checkpoints"))
        for index in range(checkpoints):
            registry.ledger.register_checkpoint(
                run_id,
                index,
                uri=str(home / "checkpoints" / f"run-{r}" / str(index)),
                size_bytes=1 << 20,
                manifest_sha256=None,
                reported_metrics={"loss": 1.0 / (index + 1), "epoch": index},
                job=request,
            )
    while claimed := registry.job_queue.claim_due_jobs(
        "bench", {"CPU": 64}, lease_s=60, max_jobs=64
    ):
        for job in claimed:
            accuracy = 0.5 + (job.report_index % 37) / 100
            outcome = JobOutcome(succeeded=True, metrics={"accuracy": accuracy})
            registry.job_queue.finish_job(job.job_id, job.lease_token, outcome)
    registry.close()


def time_once(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one fresh process; raises if it fails."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *argv],
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {err}")
    return wall, usage.ru_utime + usage.ru_stime


def measure(
    code: Path, home: Path, repeats: int, cwd: str, extra_env: dict[str, str] | None = None
) -> dict[str, dict[str, float]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKVAL_", "RAY_ADDRESS"))}
    env.update(CKVAL_HOME=str(home), PYTHONPATH=str(code), **(extra_env or {}))
    walls: dict[str, list[float]] = {label: [] for label, _ in COMMANDS}
    cpus: dict[str, list[float]] = {label: [] for label, _ in COMMANDS}
    for _ in range(repeats):
        for label, argv in COMMANDS:
            wall, cpu = time_once(argv, env, cwd)
            walls[label].append(wall)
            cpus[label].append(cpu)
    base = statistics.median(walls[BASELINE])
    return {
        label: {
            "wall": statistics.median(walls[label]),
            "above": statistics.median(walls[label]) - base,
            "cpu": statistics.median(cpus[label]),
        }
        for label, _ in COMMANDS
    }


def table(after: dict, before: dict | None) -> list[str]:
    headers = ["command", "median wall ms", "above `python -c pass` ms", "median CPU ms"]
    if before:
        headers += ["before: median wall ms", "before: median CPU ms"]
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    for label, _ in COMMANDS:
        cells = [f"`{label}`", *(f"{after[label][k] * 1000:.0f}" for k in ("wall", "above", "cpu"))]
        if before:
            cells += [f"{before[label][k] * 1000:.0f}" for k in ("wall", "cpu")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="rounds over the commands")
    parser.add_argument("--checkpoints", type=int, default=50, help="per run (3 runs)")
    parser.add_argument(
        "--compare-with", type=Path, default=None, help="another checkout to time as well"
    )
    parser.add_argument(
        "--compare-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="time this code again with these variables set, as the 'before' columns",
    )
    parser.add_argument("--smoke", action="store_true", help="2 rounds, for CI")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.checkpoints = 2, 5

    workdir = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    home = workdir / "ckval"
    populate(home, runs=3, checkpoints=args.checkpoints)
    load_before = load_average()
    # Run from an empty folder: the interpreter puts the working directory first on
    # sys.path, and only PYTHONPATH must say whose code runs.
    after = measure(ROOT, home, args.repeats, cwd=str(workdir))
    before = None
    compare_env = dict(item.split("=", 1) for item in args.compare_env)
    if args.compare_with or compare_env:
        code = args.compare_with.resolve() if args.compare_with else ROOT
        before = measure(code, home, args.repeats, cwd=str(workdir), extra_env=compare_env)
    lines = [
        f"ckval CLI start-up, median of {args.repeats} fresh processes per command "
        f"({dt.date.today()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average {load_before} before, {load_average()} after):",
        "",
        f"    {command_line()}",
        "",
        *table(after, before),
    ]
    if before:
        settings = " ".join(args.compare_env)
        where = f"the code in {args.compare_with}" if args.compare_with else "this code"
        lines += ["", f"before: {where}" + (f" with {settings}" if settings else "")]
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
