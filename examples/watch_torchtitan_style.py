"""Checkpoints from any trainer: a plain torch loop (no Ray Train) saves DCP step folders
as torchtitan does (`<folder>/step-<N>/`, `.metadata` written last), and ckval's service
evaluates each one, once, on its own resource pool, while training goes on.

python examples/watch_torchtitan_style.py [--steps 40] [--every 10] [--run titan-example]

In a real deployment the trainer runs anywhere that writes the folder (a shared disk, a
bucket) and the watch is made once from a shell:

    ckval watch /data/titan/checkpoints --run titan-7b --validate-fn my_evals:score

The validations ask for the Ray resource "eval_slot" here (a node type of their own in a
cluster, e.g. the A10G nodes); the run's curve is on the dashboard (`ckval ui`, then
/ui/runs/<run>) and in `ckval checkpoints <run>`.
"""

import argparse
import os
import tempfile
import time
import warnings

import torch

FEATURES, CLASSES = 8, 4


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
    )


def make_data(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points around one centre per class."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0)) * 2
    labels = torch.randint(0, CLASSES, (rows,), generator=generator)
    return centres[labels] + torch.randn(rows, FEATURES, generator=generator), labels


def evaluate(checkpoint, config: dict) -> dict:
    """The validate_fn: the step folder's model, scored on held-out data. It runs in a
    Ray task of the service, wherever "eval_slot" is."""
    from validation_service.validators.dcp import load_sharded

    model = load_sharded(make_model(), checkpoint).eval()
    x, y = make_data(500, seed=1)
    with torch.no_grad():
        logits = model(x)
    return {
        "accuracy": (logits.argmax(dim=1) == y).float().mean().item(),
        "eval_loss": torch.nn.functional.cross_entropy(logits, y).item(),
    }


def train(folder: str, steps: int, every: int) -> list[int]:
    """A plain torch loop that saves a DCP step folder every ``every`` steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_data(2000, seed=2)
    saved = []
    for step in range(1, steps + 1):
        batch = torch.randint(0, len(x), (64,))
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % every == 0:
            with warnings.catch_warnings():  # one process: no process group, on purpose
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                state = {"model": get_model_state_dict(model)}
                dcp.save(state, checkpoint_id=os.path.join(folder, f"step-{step}"), no_dist=True)
            saved.append(step)
            print(f"step {step}: train loss {loss.item():.3f}, saved step-{step}")
    return saved


def wait_for(registry, run: str, steps: list[int], timeout_s: float = 300.0) -> None:
    """Until every saved step is registered and validated (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while len(registry.checkpoints(run)) < len(steps):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the service registered {registry.checkpoints(run)} only")
        time.sleep(0.2)
    registry.wait(run, timeout_s=max(1.0, deadline - time.monotonic()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--run", default="titan-example")
    parser.add_argument("--folder", default=None, help="where the trainer saves")
    args = parser.parse_args()

    import ray

    from validation_service import Registry, ValidationService
    from validation_service.secrets import ckval_env

    # The validations' own resource pool: 2 "eval_slot"s (another node type in a cluster).
    ray.init(
        resources={"eval_slot": 2},
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ckval_env()},
    )
    ValidationService.start(watch_interval_s=0.5)
    folder = args.folder or tempfile.mkdtemp(prefix="titan-checkpoints-")
    os.makedirs(folder, exist_ok=True)  # the trainer's checkpoint folder
    registry = Registry()
    # `ckval watch FOLDER --run RUN --validate-fn module:fn --resources JSON` from a shell
    # does the same.
    watch_id = registry.watch(
        folder,
        args.run,
        evaluate,
        validation_resources={"num_cpus": 1, "resources": {"eval_slot": 1}},
    )
    print(f"watch {watch_id}: {folder} -> run {args.run!r}")
    saved = train(folder, args.steps, args.every)
    wait_for(registry, args.run, saved)
    print(f"run {args.run!r}, validated on the eval pool:")
    for record in registry.checkpoints(args.run):
        print(
            f"  step {record.step:>5}: accuracy {record.metrics['accuracy']:.4f}"
            f"  eval_loss {record.metrics['eval_loss']:.4f}"
        )
    print(f"dashboard: `ckval ui`, then http://127.0.0.1:8780/ui/runs/{args.run}")
    registry.unwatch(watch_id)


if __name__ == "__main__":
    main()
