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
    returncode: int = 0,
) -> str:
    """Runs a program from the repository root as a user would, with its own CKVAL_HOME.

    ckval's and Ray's variables of this test process are left out, and so are ``unset``.
    The program must exit with ``returncode``.
    """
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("CKVAL_", "RAY_ADDRESS", *unset))
    }
    env.update(CKVAL_HOME=str(home), RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == returncode, done.stdout[-3000:] + done.stderr[-5000:]
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


def assert_line_budget(output: str, ours: tuple[str, ...], total: int, foreign: int = 3) -> None:
    """At most ``total`` lines in all, of which at most ``foreign`` are not the program's
    own (those starting with one of ``ours``): Ray's chatter stays out of the user's way."""
    lines = [line for line in output.splitlines() if line.strip()]
    others = [line for line in lines if not line.startswith(ours)]
    assert len(others) <= foreign, "lines not of the program:\n" + "\n".join(others)
    assert len(lines) <= total, f"{len(lines)} lines:\n" + "\n".join(lines)


def assert_under_home(home: Path, *folders: str) -> None:
    """Ray Train's results went under CKVAL_HOME, not ~/ray_results."""
    for folder in folders:
        assert (home / "ray_results" / folder).is_dir(), sorted(os.listdir(home))


def progress_lines_at_most(jobs: int) -> int:
    """The most progress lines a run of ``jobs`` validations prints without a retry: the
    line before any report, then one per change of a job's stage: reported, claimed
    (running), waiting for its Ray task's resources, running again, succeeded."""
    return 1 + 5 * jobs


def test_ckval_demo(tmp_path):
    ckval = str(Path(sys.executable).with_name("ckval"))
    out = run([ckval, "demo", "--epochs", "2", "--run", "demo-test"], tmp_path, with_stderr=True)
    assert_quiet(out)
    assert "top-3 checkpoints by validated accuracy" in out
    # Progress while training and after: plain lines (the output is no terminal).
    assert "ckval run 'demo-test': 2 reported, 0 queued, 0 running, 2 succeeded, 0 failed" in out
    progress = [line for line in out.splitlines() if line.startswith("ckval run 'demo-test'")]
    # A line only when the counts changed (a job waiting for its worker and then running
    # again may bring an earlier line back, never the one just written): at most one
    # before the first report and one per step of each job's way.
    assert 1 <= len(progress) <= progress_lines_at_most(jobs=2)
    assert all(a != b for a, b in zip(progress, progress[1:], strict=False))
    assert_under_home(tmp_path, "demo-test")
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    records = registry.checkpoints("demo-test")
    assert [r.validation_status for r in records] == ["VALIDATED"] * 2
    # The run ended with the Ray Train run: `ckval runs` shows it FINISHED, not RUNNING.
    [summary] = registry.run_summaries()
    assert (summary.run.status, summary.run.ended_at is not None) == ("FINISHED", True)
    best = registry.best_checkpoint_records("demo-test", "accuracy", "max", k=3)
    assert best[0].metrics["accuracy"] > 0.8  # a real model on real data learns digits
    for record in best:
        assert f"{record.metrics['accuracy']:.4g}" in out  # the CLI's 4 significant digits


def test_ckval_demo_exits_non_zero_naming_a_failed_validation(service, unique_run, capsys):
    """The demo's failure path, in the session's Ray and service (the demo takes a Ray
    that is already up, as it does in a notebook): `ckval demo` exits with this message."""
    from validation_service.cli.demo import run_demo

    with pytest.raises(SystemExit) as exited:
        run_demo(epochs=2, num_workers=1, run_name=unique_run, fail_epochs={1})
    out = capsys.readouterr().out
    [validated, failed] = Registry().validations(unique_run)
    assert (validated.status, failed.status) == ("SUCCEEDED", "FAILED")
    said = f"ckval demo failed: 1 of 2 validation(s) of run '{unique_run}' failed (job {failed.id}"
    message = str(exited.value.code)  # a message as SystemExit's code: the process exits 1
    assert message.startswith(said), message
    assert f"`ckval job {failed.id}`" in message and "PermanentValidationError" in message
    assert "top-3 checkpoints by validated accuracy" in out  # the results are still shown


def test_example_ray_train_torch(tmp_path):
    out = run(
        [sys.executable, "examples/ray_train_torch.py", "--epochs", "2", "--run", "ex"],
        tmp_path,
        with_stderr=True,
    )
    assert_quiet(out)
    # 1 "training done", the progress lines, 2 results: a handful of Ray's at most.
    ours = 1 + progress_lines_at_most(jobs=2) + 2
    assert_line_budget(out, ("training done:", "ckval run 'ex':", "epoch "), total=ours + 3)
    assert_under_home(tmp_path, "ex")
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    best = registry.best_checkpoint_records("ex", "accuracy", "max", k=1)[0]
    assert f"accuracy {best.metrics['accuracy']:.4f}" in out
    assert len(registry.checkpoints("ex")) == 2


def test_example_sharded_fsdp2(tmp_path):
    out = run(
        # One report: each is an eval-only Ray Train run of its own (the suite's time).
        [sys.executable, "examples/sharded_fsdp2.py", "--reports", "1", "--run", "sharded"],
        tmp_path,
        with_stderr=True,
    )
    assert_quiet(out)
    assert_under_home(tmp_path, "sharded", "sharded-validate-0")
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    records = registry.checkpoints("sharded")
    assert [r.validation_status for r in records] == ["VALIDATED"]
    for record in records:  # both training ranks' shards, stored as one checkpoint
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(record.uri))
        assert record.validated_metrics["eval_world_size"] == 3
    best = registry.best_checkpoint_records("sharded", "accuracy", "max", k=1)[0]
    assert best.metrics["accuracy"] > 0.5  # 4 classes: a trained model, not chance
    assert f"accuracy {best.metrics['accuracy']:.4f} on 3 eval ranks" in out


def test_example_plain_script(tmp_path):
    out = run([sys.executable, "examples/plain_script.py", "--run", "plain"], tmp_path)
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    [best] = registry.best_checkpoint_records("plain", "error", "min", k=1)
    assert best.report_index == 5 and f"error {best.metrics['error']:.5f}" in out


def test_example_watch_torchtitan_style(tmp_path):
    """A plain torch loop saves DCP step folders; the service registers and validates each
    on the "eval_slot" pool, once."""
    folder = tmp_path / "titan"
    args = ["--steps", "20", "--every", "10", "--run", "titan", "--folder", str(folder)]
    out = run([sys.executable, "examples/watch_torchtitan_style.py", *args], tmp_path)
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    records = registry.checkpoints("titan")
    assert [(r.step, r.uri) for r in records] == [(s, str(folder / f"step-{s}")) for s in (10, 20)]
    assert [r.validation_status for r in records] == ["VALIDATED", "VALIDATED"]
    jobs = registry.validations("titan")
    assert all(job.resources["resources"] == {"eval_slot": 1} for job in jobs)
    assert records[-1].metrics["accuracy"] > 0.5  # 4 classes: trained, not chance
    assert f"step    20: accuracy {records[-1].metrics['accuracy']:.4f}" in out


def test_benchmark_core_smoke(tmp_path):
    out = run([sys.executable, "benchmarks/bench_core.py", "--smoke"], tmp_path)
    assert "dispatch latency, report() returned -> validate_fn started: median" in out
    assert "validations/s" in out


def test_benchmark_sharded_persist_smoke(tmp_path):
    out = run(
        [sys.executable, "benchmarks/bench_sharded.py", "--smoke", "--parts", "persist"], tmp_path
    )
    for way in ("cp", "fsspec", "ckval-sync", "ckval-async"):
        assert f"\n| {way} | " in out


def test_benchmark_registry_smoke(tmp_path):
    out = run([sys.executable, "benchmarks/bench_registry.py", "--smoke"], tmp_path)
    assert "| sqlite | 2,000 |" in out and "| postgresql | 2,000 |" in out
    assert "acknowledged/s" in out and "10 validated" in out


def test_benchmark_revalidate_smoke(tmp_path):
    out = run([sys.executable, "benchmarks/bench_revalidate.py", "--smoke"], tmp_path)
    # 4 runs x 10 checkpoints queued on both databases, and nothing queued the second time.
    assert "| postgresql | 4 x 10 | 40 |" in out and "| sqlite | 4 x 10 | 40 |" in out
    assert "| 0 | met |" in out
    assert "| **validations/s, end to end, 40 jobs** |" in out and "| jobs FAILED | 0 |" in out
    assert "| backlog running | 2 |" in out


def test_benchmark_watch_smoke(tmp_path):
    out = run([sys.executable, "benchmarks/bench_watch.py", "--smoke"], tmp_path)
    assert "| default interval (5 s) | 2 |" in out and "| --short-interval 1 s | 2 |" in out
    assert "| local disk | 50 |" in out and "| S3 (moto) | 50 |" in out


def test_benchmark_async_validation_smoke(tmp_path):
    out_file = tmp_path / "async.md"
    # The call users write (ckval-async) and the strongest configuration of Ray's own
    # (native: ASYNC upload); the measured runs in benchmarks/README.md run every way.
    ways = ("native", "ckval-async")
    run(
        [sys.executable, "benchmarks/bench_async_validation.py", "--smoke", "--ways", *ways]
        + ["--out", str(out_file)],
        tmp_path,
        timeout=600,
    )
    table = out_file.read_text()
    for way in ways:
        assert f"| {way} |" in table
    assert "| 2 | 0 | ckval-async |" in table  # its ratios against native ASYNC


def test_benchmark_executors_smoke(tmp_path):
    out_file = tmp_path / "executors.md"
    # TorchTrainerValidator, a Ray Train run per validation, is left to tests/test_validators.py.
    executors = ["--executors", "ray-task", "map-batches"]
    out = run(
        [sys.executable, "benchmarks/bench_executors.py", "--smoke", *executors]
        + ["--out", str(out_file)],
        tmp_path,
        timeout=600,
    )
    table = out_file.read_text()
    assert "| ray task | 2/2 |" in table and "| MapBatchesValidator | 2/2 |" in table
    assert "Accuracy check: every executor, on every copy, computed" in table
    assert "validated/min" in out
