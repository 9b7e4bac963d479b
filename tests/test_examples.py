"""The demo, every example and the benchmark scripts, run as a user would run them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from validation_service.registry.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.ray


def run(
    args: list[str],
    home: Path,
    timeout: int = 420,
    with_stderr: bool = False,
    unset: tuple[str, ...] = (),
) -> str:
    """Runs a program from the repository root as a user would, with its own CKVAL_HOME.

    ckval's and Ray's variables of this test process are left out, and so are ``unset``.
    """
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("CKVAL_", "RAY_ADDRESS", *unset))
    }
    env.update(CKVAL_HOME=str(home), RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout + done.stderr if with_stderr else done.stdout


def assert_quiet(output: str) -> None:
    """No schema-check chatter, no INFO of ckval's, no traceback for handled conditions."""
    noisy = [
        line
        for line in output.splitlines()
        if "alembic" in line.lower()
        or "setup plugin" in line
        or "Context impl" in line
        or line.startswith(("INFO validation_service", "INFO trainer_integration"))
        or line.startswith("Traceback")
    ]
    assert noisy == [], "\n".join(noisy)


def test_ckval_demo(tmp_path):
    ckval = str(Path(sys.executable).with_name("ckval"))
    out = run([ckval, "demo", "--epochs", "3", "--run", "demo-test"], tmp_path, with_stderr=True)
    assert_quiet(out)
    assert "top-3 checkpoints by validated accuracy" in out
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    records = registry.checkpoints("demo-test")
    assert [r.validation_status for r in records] == ["VALIDATED"] * 3
    best = registry.best_checkpoint_records("demo-test", "accuracy", "max", k=3)
    assert best[0].metrics["accuracy"] > 0.8  # a real model on real data learns digits
    for record in best:
        assert f"{record.metrics['accuracy']:.4g}" in out  # the CLI's 4 significant digits


def test_example_ray_train_torch(tmp_path):
    out = run(
        [sys.executable, "examples/ray_train_torch.py", "--epochs", "2", "--run", "ex"],
        tmp_path,
        with_stderr=True,
    )
    assert_quiet(out)
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    best = registry.best_checkpoint_records("ex", "accuracy", "max", k=1)[0]
    assert f"accuracy {best.metrics['accuracy']:.4f}" in out
    assert len(registry.checkpoints("ex")) == 2


def test_example_plain_script(tmp_path):
    out = run([sys.executable, "examples/plain_script.py", "--run", "plain"], tmp_path)
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    [best] = registry.best_checkpoint_records("plain", "error", "min", k=1)
    assert best.report_index == 5 and f"error {best.metrics['error']:.5f}" in out


def test_benchmark_core_smoke(tmp_path):
    out = run([sys.executable, "benchmarks/bench_core.py", "--smoke"], tmp_path)
    assert "dispatch latency, report() returned -> validate_fn started: median" in out
    assert "validations/s" in out


def test_benchmark_registry_smoke(tmp_path):
    out = run([sys.executable, "benchmarks/bench_registry.py", "--smoke"], tmp_path)
    assert "| sqlite | 2,000 |" in out and "| postgresql | 2,000 |" in out
    assert "acknowledged/s" in out and "10 validated" in out


def test_benchmark_async_validation_smoke(tmp_path):
    out_file = tmp_path / "async.md"
    run(
        [sys.executable, "benchmarks/bench_async_validation.py", "--smoke", "--out", str(out_file)],
        tmp_path,
        timeout=600,
    )
    table = out_file.read_text()
    for way in ("inline", "native", "native-sync", "ckval", "ckval-async"):
        assert f"| {way} |" in table
    assert "| 2 | 0 | ckval-async |" in table  # its ratios against native ASYNC


def test_benchmark_executors_smoke(tmp_path):
    out_file = tmp_path / "executors.md"
    out = run(
        [sys.executable, "benchmarks/bench_executors.py", "--smoke", "--out", str(out_file)],
        tmp_path,
        timeout=600,
    )
    table = out_file.read_text()
    assert "| ray task | 2/2 |" in table and "| MapBatchesValidator | 2/2 |" in table
    assert "| TorchTrainerValidator | 1/1 |" in table
    assert "Accuracy check: every executor, on every copy, computed" in table
    assert "validated/min" in out
