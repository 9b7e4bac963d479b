"""A program written for Ray Train's async validation runs on ckval with two imports
changed, and its user sees what Ray Train shows: the same checkpoints in ``Result``, the
same validated metrics, the same failed and timed-out validations, in report order.

The program (tests/dropin_programs/ray_native_validation.py) runs once as it is and once
with its two marked import lines changed; nothing else of its text differs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import cloudpickle
import pytest
import ray.cloudpickle
import ray.train

from validation_service import _ray_compat
from validation_service.registry.registry import Registry

pytestmark = pytest.mark.ray

PROGRAM = Path(__file__).parent / "dropin_programs" / "ray_native_validation.py"
DROP_IN = {
    "from ray.train import report": "from trainer_integration import report",
    "from ray.train.torch import TorchTrainer": "from trainer_integration import TorchTrainer",
}
# ckval's job statuses as Ray Train names a reported checkpoint's.
RAY_STATUS = {
    "SUCCEEDED": "VALIDATED",
    "FAILED": "VALIDATION_FAILED",
    "TIMED_OUT": "VALIDATION_TIMEOUT",
}


def _has_rays_validation_api() -> bool:
    task_config = getattr(ray.train, "ValidationTaskConfig", None)
    return (
        _ray_compat.report_takes_validation()
        and task_config is not None
        and "timeout_s" in getattr(task_config, "__dataclass_fields__", {})
        and _ray_compat.result_has_return_value()
    )


if not _has_rays_validation_api():
    pytest.skip(
        "this Ray lacks report(validation=ValidationTaskConfig(timeout_s=...)) or "
        "Result.return_value",
        allow_module_level=True,
    )


def _drop_in_source() -> str:
    """The program's text with only its two import lines changed."""
    lines = PROGRAM.read_text().splitlines(keepends=True)
    changed = []
    for number, line in enumerate(lines):
        statement = line.split("#")[0].strip()
        if statement in DROP_IN:
            lines[number] = line.replace(statement, DROP_IN[statement], 1)
            changed.append(statement)
    assert sorted(changed) == sorted(DROP_IN), "the program's marked imports moved"
    return "".join(lines)


def _load(name: str, source: str) -> types.ModuleType:
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(PROGRAM)
    sys.modules[name] = module
    exec(compile(source, str(PROGRAM), "exec"), module.__dict__)
    # Neither form's module is importable in Ray's workers: its functions travel by value.
    cloudpickle.register_pickle_by_value(module)
    ray.cloudpickle.register_pickle_by_value(module)
    return module


def _calls_by_step(calls_dir: Path) -> dict[int, int]:
    counts: dict[int, int] = {}
    for name in os.listdir(calls_dir):
        step = int(name.split("-")[1])
        counts[step] = counts.get(step, 0) + 1
    return counts


def _run(module: types.ModuleType, name: str, tmp_path: Path):
    calls_dir = tmp_path / f"{name}-calls"
    calls_dir.mkdir()
    result = module.main(name, str(tmp_path / "ray_results"), str(calls_dir))
    assert result.error is None
    return result, calls_dir


def test_the_same_program_on_ray_and_on_ckval_shows_the_same(
    ray_session, service, tmp_path, unique_run
):
    native = _load(f"ray_native_{unique_run.replace('-', '_')}", PROGRAM.read_text())
    drop_in = _load(f"ckval_drop_in_{unique_run.replace('-', '_')}", _drop_in_source())
    assert drop_in.TorchTrainer.__module__ == "trainer_integration.trainers"

    native_result, native_calls = _run(native, f"{unique_run}-ray", tmp_path)
    ckval_run = f"{unique_run}-ckval"
    ckval_result, ckval_calls = _run(drop_in, ckval_run, tmp_path)
    registry = Registry()
    registry.wait(ckval_run, timeout_s=60)

    # Result: the same checkpoints, in report order, with the same reported metrics.
    native_metrics = [metrics for _, metrics in native_result.best_checkpoints]
    ckval_reported = [metrics for _, metrics in ckval_result.best_checkpoints]
    assert [m["step"] for m in native_metrics] == [0, 1, 2, 3, 4, 5]
    assert ckval_reported == [{"step": m["step"], "loss": m["loss"]} for m in native_metrics]
    assert ckval_result.checkpoint is not None

    # Validated metrics: Ray merges them into Result; ckval into its registry, with the
    # same merge (a failed or timed-out validation leaves the reported metrics as they are).
    records = registry.checkpoints(ckval_run)
    assert [record.report_index for record in records] == [0, 1, 2, 3, 4, 5]
    assert [record.metrics for record in records] == native_metrics
    assert records[0].metrics["scale"] == 1.0 and records[1].metrics["scale"] == 2.0

    # Statuses: Ray Train's, read in the train function, against ckval's jobs.
    jobs = sorted(registry.validations(ckval_run), key=lambda job: job.report_index)
    assert [RAY_STATUS.get(job.status, job.status) for job in jobs] == [
        status for _, status in native_result.return_value
    ]
    assert [status for _, status in native_result.return_value] == [
        "VALIDATED",
        "VALIDATED",
        "VALIDATION_FAILED",
        "VALIDATION_TIMEOUT",
        "VALIDATED",  # its first call's ConnectionError is one retry_exceptions names
        "VALIDATION_TIMEOUT",  # timeout_s covers the retries, not each call alone
    ]
    assert "fails on purpose" in jobs[2].error_message
    assert jobs[2].error_type == "ValueError"
    assert records[4].metrics["scale"] == 1.0
    assert jobs[3].timeout_s == jobs[5].timeout_s == native.TIMEOUT_S

    # Ray Train validated none of the drop-in's checkpoints. A validation ran again only
    # after an error that retry_exceptions names, in either form: the ValueError of step 2
    # ends its validation at once; step 4 runs twice.
    assert {status for _, status in ckval_result.return_value} == {"COMMITTED"}
    # (A timed-out validation is cancelled 1 s after its launch (Ray) or its start
    # (ckval): how many calls began by then depends on how soon a worker took the task.)
    for calls_dir in (native_calls, ckval_calls):
        calls = _calls_by_step(calls_dir)
        assert {step: calls.get(step) for step in (0, 1, 2, 4)} == {0: 1, 1: 1, 2: 1, 4: 2}, calls
        assert calls.get(3, 0) <= 1 and calls.get(5, 0) <= 3, calls
    # The retries of a validation are one ckval attempt, as they are one Ray task.
    assert [job.attempts for job in jobs] == [1, 1, 1, 1, 1, 1]
    assert {job.max_attempts for job in jobs} == {3}  # max_retries=2 after a lost worker
