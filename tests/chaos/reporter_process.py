"""A training process for the chaos tests: reports N checkpoints, then exits or dies.

    python tests/chaos/reporter_process.py RUN N [--hold-s S] [--max-attempts A] [--die]

It connects to the Ray cluster in CKVAL_RAY_ADDRESS and uses the CKVAL_* settings it
inherits. With --die it kills itself with SIGKILL right after its last report returns.
"""

import argparse
import os
import signal
import sys
import tempfile
import time

from ray.train import Checkpoint

from trainer_integration import Client


def validate(checkpoint, config):
    time.sleep(config["hold_s"])  # stands in for evaluation work
    with checkpoint.as_directory() as directory:
        with open(os.path.join(directory, "step.txt")) as f:
            step = int(f.read())
    with open(config["log"], "a") as f:
        f.write(f"{config['run']} {step}\n")  # one line per execution, to count re-runs
    return {"step_seen": step, "score": step / 1000.0}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run")
    parser.add_argument("count", type=int)
    parser.add_argument("--hold-s", type=float, default=0.0)
    parser.add_argument("--log", default=os.devnull)
    parser.add_argument("--max-attempts", type=int, default=None)
    parser.add_argument("--die", action="store_true")
    args = parser.parse_args()
    client = Client(args.run)
    with tempfile.TemporaryDirectory() as scratch:
        for step in range(args.count):
            directory = os.path.join(scratch, str(step))
            os.makedirs(directory)
            with open(os.path.join(directory, "step.txt"), "w") as f:
                f.write(str(step))
            client.report(
                {"step": step},
                Checkpoint.from_directory(directory),
                validate_fn=validate,
                validate_config={"hold_s": args.hold_s, "log": args.log, "run": args.run},
                **({"max_attempts": args.max_attempts} if args.max_attempts else {}),
            )
            print(f"acknowledged {step}", flush=True)
    if args.die:
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)


if __name__ == "__main__":
    main()
