"""Compatibility run: ckval's Ray-facing tests against each Ray release asked, one venv each.

    .venv/bin/python benchmarks/compat.py --ray 2.51.2 2.54.1 2.57.1 2.60.0 --python 3.11
    .venv/bin/python benchmarks/compat.py --ray 2.51.2 --python 3.10 --table docs/x.md

For each Python and Ray release (one after the other: the tests start Ray clusters), the
script creates a venv under ``--root`` (``<root>/py<python>-ray<release>``) with the
repository's own set-up (``.ci/setup`` with CKVAL_VENV and CKVAL_RAY_VERSION, so pip keeps
the release asked), checks that the venv's Ray is that release, runs ``SUITE`` (the tests
of report() in Ray Train, the executors, the Keras callback, the CLI and the dashboard's
API) there with pytest, and prints a markdown row: release | python | passed | failed |
skipped | minutes (the tests; the set-up's minutes are printed apart). ``--table FILE``
appends each row to FILE too. A venv made by an earlier run is reused (the set-up only
adds what is missing). Each run's output lies in ``<root>/<venv name>.log``.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The tests that touch Ray's API or ckval's front doors: report() in Ray Train (SYNC,
# ASYNC, NO_UPLOAD, the journal, Ray's internals and their fallback), the drop-in for Ray's
# validation API (with the program run on Ray and on ckval), the three executors,
# the Keras callback, the CLI's listings and the dashboard's API.
SUITE = (
    "tests/test_report_in_ray_train.py",
    "tests/test_report.py",
    "tests/test_report_journal.py",
    "tests/test_ray_compat.py",
    "tests/test_ray_dropin.py",
    "tests/test_ray_dropin_parity.py",
    "tests/test_validators.py",
    "tests/test_keras.py",
    "tests/test_cli.py",
    "tests/test_api.py",
)
HEADER = (
    "| Ray | Python | passed | failed | skipped | minutes |\n"
    "|-----|--------|-------:|-------:|--------:|--------:|"
)


@dataclass
class Outcome:
    """One release's tests in one Python: the counts pytest wrote and the minutes taken."""

    ray: str
    python: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    minutes: float = 0.0
    note: str = ""

    def row(self) -> str:
        cells = [self.ray, self.python, self.passed, self.failed, self.skipped]
        line = "| " + " | ".join(str(cell) for cell in cells) + f" | {self.minutes:.1f} |"
        return f"{line} {self.note}" if self.note else line


def find_python(version: str) -> str:
    """The interpreter for a version such as 3.11: pyenv's newest patch release of it,
    else python3.11 on PATH."""
    roots = [os.environ.get("PYENV_ROOT", ""), str(Path.home() / ".pyenv"), "/root/.pyenv"]
    for root in filter(None, roots):
        found = sorted(
            glob.glob(f"{root}/versions/{version}.*/bin/python{version}"),
            key=lambda path: int(path.split("/versions/")[1].split("/")[0].split(".")[2]),
        )
        if found:
            return found[-1]
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(directory) / f"python{version}"
        if candidate.is_file():
            return str(candidate)
    raise SystemExit(f"compat: no Python {version} found (pyenv or PATH)")


def clean_env() -> dict[str, str]:
    """This process's environment without what points at another venv or checkout."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    return env


def set_up(venv: Path, python: str, ray: str, log) -> None:
    env = clean_env() | {"PYTHON": python, "CKVAL_VENV": str(venv), "CKVAL_RAY_VERSION": ray}
    subprocess.run(
        ["bash", str(ROOT / ".ci" / "setup")], env=env, stdout=log, stderr=log, check=True
    )
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import ray; print(ray.__version__)"],
        env=clean_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if installed != ray:
        raise SystemExit(f"compat: {venv} holds Ray {installed}, not {ray}")


def run_suite(venv: Path, outcome: Outcome, tests: list[str], log) -> None:
    report = venv.parent / f"{venv.name}.xml"
    started = time.monotonic()
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            *tests,
        ],
        cwd=ROOT,
        env=clean_env(),
        stdout=log,
        stderr=log,
        check=False,
    )
    outcome.minutes = (time.monotonic() - started) / 60
    if not report.exists():
        outcome.note = "(pytest wrote no report: see the log)"
        return
    suite = ET.parse(report).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    total = int(suite.get("tests", 0))
    outcome.failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    outcome.skipped = int(suite.get("skipped", 0))
    outcome.passed = total - outcome.failed - outcome.skipped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ray", nargs="+", required=True, help="Ray releases, e.g. 2.54.1")
    parser.add_argument("--python", nargs="+", default=["3.11"], help="e.g. 3.10 3.11")
    parser.add_argument("--root", type=Path, default=Path("/tmp/ckval-compat"))
    parser.add_argument("--table", type=Path, help="append each markdown row to this file")
    parser.add_argument("--tests", nargs="+", default=list(SUITE), help="instead of SUITE")
    args = parser.parse_args()

    args.root.mkdir(parents=True, exist_ok=True)
    print(HEADER, flush=True)
    failed = False
    for version in args.python:
        python = find_python(version)
        for ray in args.ray:
            venv = args.root / f"py{version}-ray{ray}"
            outcome = Outcome(ray, version)
            with open(venv.parent / f"{venv.name}.log", "a") as log:
                started = time.monotonic()
                try:
                    set_up(venv, python, ray, log)
                except subprocess.CalledProcessError:
                    outcome.note = f"(set-up failed: see {log.name})"
                else:
                    print(
                        f"compat: set-up of {venv.name} took "
                        f"{(time.monotonic() - started) / 60:.1f} min",
                        file=sys.stderr,
                        flush=True,
                    )
                    run_suite(venv, outcome, args.tests, log)
            failed = failed or bool(outcome.failed or outcome.note)
            print(outcome.row(), flush=True)
            if args.table:
                with open(args.table, "a") as table:
                    table.write(outcome.row() + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
