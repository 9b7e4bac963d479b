"""ckval without Ray Train: any training script reports checkpoints with a validate_fn.

python examples/plain_script.py [--run plain-example]
"""

import argparse
import json
import os
import tempfile

from ray.train import Checkpoint

import trainer_integration


def validate_fn(checkpoint: Checkpoint, config: dict) -> dict:
    with checkpoint.as_directory() as directory:
        with open(os.path.join(directory, "weights.json")) as f:
            weights = json.load(f)
    # A stand-in for a real evaluation: distance of the weights to a target.
    error = sum((w - t) ** 2 for w, t in zip(weights, config["target"], strict=True))
    return {"error": error}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", default="plain-example")
    args = parser.parse_args()
    client = trainer_integration.start_run(args.run)
    weights = [0.0, 0.0, 0.0]
    target = [1.0, -2.0, 0.5]
    for step in range(6):
        weights = [w + 0.4 * (t - w) for w, t in zip(weights, target, strict=True)]  # "training"
        with tempfile.TemporaryDirectory() as directory:
            with open(os.path.join(directory, "weights.json"), "w") as f:
                json.dump(weights, f)
            trainer_integration.report(
                {"step": step},
                Checkpoint.from_directory(directory),
                validate_fn=validate_fn,
                validate_config={"target": target},
            )
    client.wait(timeout_s=300, progress=True)  # a live line of the validations
    [(best, metrics)] = client.registry.best_checkpoints(args.run, "error", mode="min", k=1)
    print(f"best checkpoint: step {metrics['step']} error {metrics['error']:.5f} at {best.path}")


if __name__ == "__main__":
    main()
