"""How long report() holds training when the train function imports ckval itself, right
before its first report, as Ray's guides often do; against Ray's native ASYNC report.

A TorchTrainer with 2 workers trains the demo's MLP on the digits that ship with
scikit-learn and reports ``--reports`` checkpoints. The ways:

- ``native``: ``ray.train.report(metrics, checkpoint, checkpoint_upload_mode=ASYNC,
  validation=True)`` with ``TorchTrainer(validation_config=ValidationConfig(fn))``, the
  call of Ray's async-validation guide (Ray 2.51-2.53: ``validate_fn=fn`` in the report);
- ``ckval-async``: ``trainer_integration.report(..., validate_fn=fn,
  checkpoint_upload_mode=ASYNC)``, ``import trainer_integration`` inside the train
  function just before the first report;
- ``ckval-sync``: the same in SYNC mode (ckval's default);
- ``ckval-top``: ckval-async with ``trainer_integration`` imported when the train function
  starts, as a module-level import in the training script is (Ray unpickles the train
  function, and with it the modules it names, before calling it);
- ``plain``: ``ray.train.report(metrics, checkpoint, checkpoint_upload_mode=ASYNC)`` with
  no validation at all: the floor for "until fit()";
- ``dropin``: ``native``'s program with its two imports changed to ckval's drop-in
  (``from trainer_integration import TorchTrainer, report``), the report import inside the
  train function just before the first report; ``dropin-top``: imported when the train
  function starts.

A report's blocked time is the longest any rank spent in it. "until fit()" runs from the
end of the training loop until ``fit()`` returned; "until validated" until the driver can
read every validated metric (native: when ``fit()`` returns; ckval's ways: when
``Registry().wait(run)`` returns after it).

Two clusters: ``fresh`` runs each measured run in a new process that calls ``ray.init()``
(a new local Ray, no ckval service yet: ckval's set-up starts it while training starts),
``long-lived`` runs them all in one Ray with the ckval service already running. Each way
runs ``--repeats`` times per cluster (the ways rotated); tables give medians.

    .venv/bin/python benchmarks/bench_first_report.py --repeats 3 --out /tmp/first_report.md

Smoke test (CI)::

    .venv/bin/python benchmarks/bench_first_report.py --smoke
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from _common import fresh_ckval_home, load_average, pickle_by_value, run_description
from bench_async_validation import _batch_indices, validate_checkpoint
from torch import nn

from validation_service.cli.demo import load_digits_split, make_model

WAYS = ("native", "ckval-async", "ckval-sync", "ckval-top", "plain", "dropin", "dropin-top")
MODES = {"ckval-async": "ASYNC", "ckval-sync": "SYNC", "ckval-top": "ASYNC"}
CLUSTERS = ("fresh", "long-lived")
NUM_WORKERS = 2
STEPS_PER_REPORT = 20


def native_validate_fn(checkpoint, **kwargs) -> dict[str, float]:
    return validate_checkpoint(checkpoint, noisy_copies=kwargs.get("noisy_copies", 0))


def ckval_validate_fn(checkpoint, config: dict) -> dict[str, float]:
    return validate_checkpoint(checkpoint, noisy_copies=config.get("noisy_copies", 0))


def native_validation_arguments() -> tuple[dict[str, Any], dict[str, Any]]:
    """(TorchTrainer keyword arguments, ray.train.report keyword arguments) that turn on
    Ray's own async validation, in this Ray's spelling."""
    import ray.train

    if "validation" in inspect.signature(ray.train.report).parameters:  # Ray 2.54+
        from ray.train.v2.api.validation_config import ValidationConfig

        return {"validation_config": ValidationConfig(native_validate_fn)}, {"validation": True}
    return {}, {"validate_fn": native_validate_fn, "validate_config": {}}  # Ray 2.51-2.53


def train_func(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    if config["way"] in ("ckval-top", "dropin-top"):
        import trainer_integration  # noqa: F401  (what a module-level import does)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    x_train, _, y_train, _ = load_digits_split()
    x = torch.from_numpy(x_train[rank::world])
    y = torch.from_numpy(y_train[rank::world]).long()
    model = ray.train.torch.prepare_model(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    batches = _batch_indices(len(x), 32)
    blocked: list[float] = []
    for index in range(config["reports"]):
        for _ in range(STEPS_PER_REPORT):
            idx = next(batches)
            optimizer.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
        blocked.append(_report(config, rank, model, {"index": index, "loss": loss.item()}))
    loop_end = time.time()
    Path(f"{config['timings']}.rank{rank}").write_text(
        json.dumps({"blocked": blocked, "loop_end": loop_end})
    )


def _report(config: dict, rank: int, model: nn.Module, metrics: dict) -> float:
    import ray.train

    way = config["way"]
    checkpoint = None
    if rank == 0:
        directory = tempfile.mkdtemp(prefix="bench-first-")  # ASYNC: deleted once copied
        torch.save(getattr(model, "module", model).state_dict(), f"{directory}/model.pt")
        checkpoint = ray.train.Checkpoint.from_directory(directory)
    if way.startswith("ckval"):
        import trainer_integration  # where the guides import it: just before reporting

        mode = trainer_integration.CheckpointUploadMode[MODES[way]]
        options = {"checkpoint_upload_mode": mode}
        if checkpoint is not None:
            options.update(validate_fn=ckval_validate_fn, validate_config={})
        started = time.perf_counter()
        trainer_integration.report(metrics, checkpoint, **options)
    elif way.startswith("dropin"):
        from trainer_integration import report  # native's program, this import changed

        options = {"checkpoint_upload_mode": ray.train.CheckpointUploadMode.ASYNC}
        if checkpoint is not None:
            options["validation"] = True
        started = time.perf_counter()
        report(metrics, checkpoint=checkpoint, **options)
    else:
        options = {"checkpoint_upload_mode": ray.train.CheckpointUploadMode.ASYNC}
        if way == "native" and checkpoint is not None:
            options.update(native_validation_arguments()[1])
        started = time.perf_counter()
        ray.train.report(metrics, checkpoint=checkpoint, **options)
    return time.perf_counter() - started


def run_once(way: str, workdir: Path, reports: int) -> dict[str, Any]:
    """One TorchTrainer run of ``way`` on the connected Ray; its blocked times."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if way.startswith("dropin"):
        from trainer_integration import TorchTrainer  # native's program, this import changed
    run = f"first-{way}-{uuid.uuid4().hex[:6]}"
    timings = workdir / run
    native_form = way == "native" or way.startswith("dropin")
    trainer_kwargs = native_validation_arguments()[0] if native_form else {}
    TorchTrainer(
        train_func,
        train_loop_config={"way": way, "reports": reports, "timings": str(timings)},
        scaling_config=ScalingConfig(num_workers=NUM_WORKERS),
        run_config=RunConfig(name=run, storage_path=str(workdir / "ray_results")),
        **trainer_kwargs,
    ).fit()
    fit_returned = validated = time.time()
    if way.startswith(("ckval", "dropin")):
        from validation_service.registry.registry import Registry

        Registry().wait(run, timeout_s=600)
        validated = time.time()
    ranks = [json.loads(Path(f"{timings}.rank{r}").read_text()) for r in range(NUM_WORKERS)]
    held = [max(values) for values in zip(*(r["blocked"] for r in ranks), strict=True)]
    loop_end = max(r["loop_end"] for r in ranks)
    return {
        "way": way,
        "blocked": held,
        "until_fit_s": fit_returned - loop_end,
        "until_validated_s": validated - loop_end,
    }


def _one_fresh_run(way: str, reports: int) -> None:
    """--one-run: a new local Ray in this process, one run, its figures on stdout."""
    import ray

    workdir = fresh_ckval_home("ckval-bench-first-")
    pickle_by_value(__name__)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        print("RESULT " + json.dumps(run_once(way, workdir, reports)))
    finally:
        ray.shutdown()


def fresh_runs(ways: list[str], repeats: int, reports: int) -> list[dict[str, Any]]:
    results = []
    for repeat in range(repeats):
        for way in ways[repeat % len(ways) :] + ways[: repeat % len(ways)]:
            command = [sys.executable, __file__, "--one-run", way, "--reports", str(reports)]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
            results.append(json.loads(line[len("RESULT ") :]))
            print(f"fresh {line}", flush=True)  # each run's figures, as they come
    return results


def long_lived_runs(ways: list[str], repeats: int, reports: int) -> list[dict[str, Any]]:
    import ray

    from validation_service.service import ValidationService

    workdir = fresh_ckval_home("ckval-bench-first-")
    pickle_by_value(__name__)
    from validation_service.config import ckval_env

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ckval_env()},
    )
    service = ValidationService.start()
    try:
        for way in ways:  # one untimed run per way: workers started, imports cached
            run_once(way, workdir, 2)
        results = []
        for repeat in range(repeats):
            for way in ways[repeat % len(ways) :] + ways[: repeat % len(ways)]:
                results.append(run_once(way, workdir, reports))
                print(f"long-lived RESULT {json.dumps(results[-1])}", flush=True)
        return results
    finally:
        service.stop()
        ray.shutdown()


def summary(results: list[dict[str, Any]], way: str) -> dict[str, float]:
    runs = [r for r in results if r["way"] == way]
    return {
        "first": statistics.median(r["blocked"][0] for r in runs),
        "later": statistics.median(statistics.median(r["blocked"][1:]) for r in runs),
        "total": statistics.median(sum(r["blocked"]) for r in runs),
        "until_fit": statistics.median(r["until_fit_s"] for r in runs),
        "until_validated": statistics.median(r["until_validated_s"] for r in runs),
        "runs": len(runs),
    }


def render(tables: dict[str, list[dict[str, Any]]], meta: dict[str, str], reports: int) -> str:
    lines = [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", f"{reports} reports per run, medians; blocked = longest rank per report.", ""]
    lines += [
        "| cluster | way | first report (ms) | later, median (ms) | total blocked (ms) "
        "| until fit() (s) | until validated (s) | total / native | first - native first (ms) "
        "| target met |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for cluster, results in tables.items():
        native = summary(results, "native")
        for way in WAYS:
            if not any(r["way"] == way for r in results):
                continue
            s = summary(results, way)
            ratio = s["total"] / native["total"] if native["total"] else float("nan")
            gap = (s["first"] - native["first"]) * 1000
            met = "-"
            if way.startswith("ckval"):
                total_ok = s["total"] <= max(2 * native["total"], native["total"] + 0.1)
                met = "yes" if total_ok and gap <= 50 else "no"
            if way.startswith("dropin"):
                met = (
                    "yes"
                    if s["total"] <= max(2 * native["total"], native["total"] + 0.05)
                    else "no"
                )
            lines.append(
                f"| {cluster} | {way} | {s['first'] * 1000:.1f} | {s['later'] * 1000:.1f} | "
                f"{s['total'] * 1000:.1f} | {s['until_fit']:.2f} | {s['until_validated']:.2f} | "
                f"{ratio:.2f} | {gap:+.1f} | {met} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reports", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--clusters", nargs="+", choices=CLUSTERS, default=list(CLUSTERS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="1 repeat, 2 reports, both clusters")
    parser.add_argument("--one-run", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.reports, args.ways = 1, 2, ["native", "ckval-async"]
    if args.one_run:
        _one_fresh_run(args.one_run, args.reports)
        return 0
    load_before = load_average()
    tables = {}
    if "fresh" in args.clusters:
        tables["fresh"] = fresh_runs(args.ways, args.repeats, args.reports)
    if "long-lived" in args.clusters:
        tables["long-lived"] = long_lived_runs(args.ways, args.repeats, args.reports)
    text = render(tables, run_description(load_before), args.reports)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
