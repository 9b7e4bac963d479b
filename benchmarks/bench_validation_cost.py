"""What a run's validations cost in accelerator-hours: on an A10G through ckval, from the
figures ckval records for each attempt, against validating inline on the training GPUs
(Ray's inline pattern), timed in the same run.

    .venv/bin/python benchmarks/bench_validation_cost.py [--smoke] [--checkpoints N]
        [--repeats R] [--training-gpus W] [--a100-speedup S] [--price A10G=1.006 ...]

One local Ray with one fake GPU of accelerator type A10G. A training loop (the digits
MLP of `ckval demo`, on this machine's CPU) reports a checkpoint every epoch through
ckval, whose validation asks for {"num_gpus": 1, "accelerator_type": "A10G"}; ckval
records each attempt's accelerator type, count and running time. After each report the
loop also runs the same evaluation inline, on the model in memory, as a training loop
validating inline would, and times it.

The inline evaluations are timed after ckval's validations are done (on a 2-core machine,
both at once slow each other down), on the model each epoch ended with.

The inline figure: while a training job of W GPUs validates inline, all W are held for
the validation. Two ways to do it (Ray Train's docs validate inside the train loop):
- rank 0 evaluates while the other W - 1 ranks wait at the next collective:
  W x (inline time) accelerator-seconds per checkpoint;
- every rank evaluates 1/W of the data (the strongest form: no GPU idles):
  W x (inline time / W) = the inline time.
Both are divided by --a100-speedup, how much faster a training GPU evaluates than the
A10G (this machine measures both on its CPU: 1 means equally fast). The ckval figure is
what was recorded: accelerators x running time of every attempt, retries included,
downloading and verifying the checkpoint included.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 checkpoints, 1 repeat")
    parser.add_argument("--checkpoints", type=int, default=8, help="epochs of the run")
    parser.add_argument("--repeats", type=int, default=3, help="runs; the table shows medians")
    parser.add_argument(
        "--training-gpus", type=int, default=8, help="W, the training job's GPUs (p4d: 8)"
    )
    parser.add_argument("--a100-speedup", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument(
        "--eval-seconds",
        type=float,
        default=3.0,
        help="what one evaluation takes on this machine: the digits validation set is "
        "evaluated this long (passes calibrated once), inline and in ckval alike",
    )
    parser.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="TYPE=USD_PER_HOUR",
        help="an accelerator-hour's price, e.g. A10G=1.006 A100=4.096 (optional)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.checkpoints, args.repeats, args.eval_seconds = 2, 1, 0.2
    args.prices = {k: float(v) for k, v in (item.split("=", 1) for item in args.price)}
    return args


def evaluate(model, passes: int) -> dict:
    """The digits evaluation of `ckval demo` on a model in memory (what inline runs),
    over the validation set ``passes`` times (a larger evaluation set, in effect)."""
    import torch

    from validation_service.cli.demo import load_digits_split

    _, x_val, _, y_val = load_digits_split()
    began = time.perf_counter()
    with torch.no_grad():
        for _ in range(passes):
            predicted = model(torch.from_numpy(x_val)).argmax(dim=1)
    accuracy = float((predicted == torch.from_numpy(y_val).long()).float().mean())
    return {"accuracy": accuracy, "eval_s": time.perf_counter() - began}


def validate_on_a10g(checkpoint, config) -> dict:
    """ckval's validation of a reported checkpoint: load it, then the same evaluation."""
    import torch

    from validation_service.cli.demo import make_model

    model = make_model()
    with checkpoint.as_directory() as directory:
        model.load_state_dict(torch.load(os.path.join(directory, "model.pt")))
    return evaluate(model, config["passes"])


def calibrated_passes(seconds: float) -> int:
    """How many passes over the validation set take ``seconds`` on this machine."""
    from validation_service.cli.demo import make_model

    model = make_model()
    evaluate(model, 1)  # warm
    one = min(evaluate(model, 50)["eval_s"] / 50 for _ in range(5))
    return max(1, round(seconds / one))


def one_run(args: argparse.Namespace, run: str) -> dict:
    """A run of args.checkpoints epochs: ckval's recorded attempts, and the inline times."""
    import torch
    from ray.train import Checkpoint

    from trainer_integration import Client
    from validation_service.cli.demo import load_digits_split, make_model

    torch.manual_seed(0)
    x_train, _, y_train, _ = load_digits_split()
    x, y = torch.from_numpy(x_train), torch.from_numpy(y_train).long()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    inline: list[float] = []
    states: list[dict] = []
    client = Client(run)
    with tempfile.TemporaryDirectory() as scratch:
        for epoch in range(args.checkpoints):
            for start in range(0, len(x), 64):
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(
                    model(x[start : start + 64]), y[start : start + 64]
                )
                loss.backward()
                optimizer.step()
            folder = Path(scratch) / str(epoch)
            folder.mkdir()
            torch.save(model.state_dict(), folder / "model.pt")
            client.report(
                {"epoch": epoch, "loss": float(loss.detach())},
                Checkpoint.from_directory(str(folder)),
                validate_fn=validate_on_a10g,
                validate_config={"passes": args.passes},
                validation_resources={"num_cpus": 1, "num_gpus": 1, "accelerator_type": "A10G"},
            )
            states.append(copy.deepcopy(model.state_dict()))
    client.wait(timeout_s=1800)
    # The inline evaluations, timed once ckval's are done: on a 2-core machine, the two
    # at once would slow each other down.
    for state in states:
        model.load_state_dict(state)
        inline.append(evaluate(model, args.passes)["eval_s"])
    jobs = client.registry.validations(run)
    attempts = [a for job in jobs for a in job.attempt_history]
    [summary] = [s for s in client.registry.run_summaries() if s.run.name == run]
    client.close()
    return {
        "statuses": sorted({job.status for job in jobs}),
        "attempts": [[a.accelerator_type, a.accelerators, a.running_s] for a in attempts],
        "ckval_accelerator_s": summary.cost.accelerator_s,
        "ckval_by_type": summary.cost.by("accelerator_type"),
        "inline_s": inline,
        "ckval_eval_s": [job.result_metrics["eval_s"] for job in jobs],
    }


def figures(args: argparse.Namespace, runs: list[dict]) -> list[tuple[str, str]]:
    """The table's rows: (measure, value), medians over the runs."""
    w = args.training_gpus
    median = statistics.median
    ckval_h = median(r["ckval_accelerator_s"] for r in runs) / 3600
    inline_total = median(sum(r["inline_s"]) for r in runs)
    rows = [
        (
            "validations per run (all SUCCEEDED); passes over the validation set",
            f"{args.checkpoints}; {args.passes}",
        ),
        (
            "ckval attempt on the A10G, running time per checkpoint: median (s)",
            f"{median(a[2] for r in runs for a in r['attempts']):.4f}",
        ),
        (
            "  of which the evaluation itself (the rest: start, load, verify): median (s)",
            f"{median(s for r in runs for s in r['ckval_eval_s']):.4f}",
        ),
        (
            "inline evaluation on the model in memory per checkpoint: median (s)",
            f"{median(s for r in runs for s in r['inline_s']):.4f}",
        ),
        (
            "ckval attempt running time: max over the runs (s)",
            f"{max(a[2] for r in runs for a in r['attempts']):.4f}",
        ),
        ("ckval: A10G-hours of the run (recorded)", f"{ckval_h:.3e}"),
    ]
    for speedup in args.a100_speedup:
        rank0 = w * inline_total / speedup / 3600
        sharded = inline_total / speedup / 3600
        rows += [
            (
                f"inline, rank 0 evaluates, {w} GPUs held, speedup {speedup:g}: GPU-hours",
                f"{rank0:.3e}",
            ),
            (
                f"inline, {w} ranks evaluate a shard each, speedup {speedup:g}: GPU-hours",
                f"{sharded:.3e}",
            ),
            (f"ratio rank-0 inline / ckval, speedup {speedup:g}", f"{rank0 / ckval_h:.2f}"),
            (f"ratio sharded inline / ckval, speedup {speedup:g}", f"{sharded / ckval_h:.2f}"),
        ]
        if "A10G" in args.prices and "A100" in args.prices:
            usd = {"ckval": ckval_h * args.prices["A10G"]}
            for name, hours in (("rank 0", rank0), ("sharded", sharded)):
                usd[name] = hours * args.prices["A100"]
            rows.append(
                (
                    f"USD at A10G {args.prices['A10G']:g}/h, A100 {args.prices['A100']:g}/h, "
                    f"speedup {speedup:g}: ckval / rank-0 inline / sharded inline",
                    " / ".join(f"{value:.2e}" for value in usd.values()),
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = _common.load_average()
    args.passes = calibrated_passes(args.eval_seconds)  # before Ray starts beside it
    _common.fresh_ckval_home("ckval-bench-cost-")
    import ray

    from validation_service.config import ckval_env
    from validation_service.service import ValidationService

    _common.pickle_by_value(__name__)
    ray.init(
        num_cpus=2,
        num_gpus=1,
        resources={"accelerator_type:A10G": 1},
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ckval_env()},
    )
    service = ValidationService.start(pools={"A10G": 1})
    try:
        runs = [one_run(args, f"cost-{repeat}") for repeat in range(args.repeats)]
    finally:
        service.stop()
        ray.shutdown()
    for run in runs:
        if run["statuses"] != ["SUCCEEDED"] or set(run["ckval_by_type"]) != {"A10G"}:
            raise SystemExit(f"a validation did not succeed on the A10G: {run}")
    description = _common.run_description(load_before)
    text = render(description, figures(args, runs))
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "validation_cost.md").write_text(text)
    print(text)
    return 0


def render(description: dict[str, str], rows: list[tuple[str, str]]) -> str:
    """The results as benchmarks/results/*.md are: the run's description, then the table."""
    lines = [
        f"- command: {description['command']}",
        f"- date: {description['date']}",
        f"- machine: {description['machine']}; {description['versions']}",
        f"- load average before {description['load_before']}, after {description['load_after']}",
        "",
        "| measure | value |",
        "| --- | ---: |",
        *(f"| {measure} | {value} |" for measure, value in rows),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
