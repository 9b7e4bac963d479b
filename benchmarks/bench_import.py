"""Import cost of trainer_integration in a training process: the time ``import
trainer_integration`` takes after ``import ray.train, torch``, in fresh processes.

    .venv/bin/python benchmarks/bench_import.py --runs 5 [--root OTHER_CHECKOUT]

Prints each run's wall and CPU milliseconds and their medians, and the top-level packages
the import loaded (tests/test_import_cost.py pins which it may not). As in an installed
package, the modules' bytecode is cached (in a folder of its own under the temporary
directory, so that no checkout is written to; PYTHONDONTWRITEBYTECODE is ignored): one
untimed run first writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
import json, sys, time
import ray.train, torch
before = set(sys.modules)
wall, cpu = time.perf_counter(), time.process_time()
import trainer_integration
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
loaded = sorted({name.split(".")[0] for name in set(sys.modules) - before})
print(json.dumps({"wall_ms": wall * 1000, "cpu_ms": cpu * 1000, "loaded": loaded}))
"""


def one_run(root: Path) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        PYTHONPYCACHEPREFIX=str(Path(tempfile.gettempdir()) / "ckval-bench-import-pycache"),
    )
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to import from")
    args = parser.parse_args()
    one_run(args.root)  # untimed: writes the bytecode
    runs = [one_run(args.root) for _ in range(args.runs)]
    for number, run in enumerate(runs):
        print(f"run {number}: {run['wall_ms']:.1f} ms wall, {run['cpu_ms']:.1f} ms CPU")
    print(
        f"median of {len(runs)}: {statistics.median(r['wall_ms'] for r in runs):.1f} ms wall, "
        f"{statistics.median(r['cpu_ms'] for r in runs):.1f} ms CPU"
    )
    print("loaded:", ", ".join(runs[-1]["loaded"]))


if __name__ == "__main__":
    main()
