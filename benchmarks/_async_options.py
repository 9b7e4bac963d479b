"""The command line of bench_async_validation.py: its ways, scenarios and options."""

from __future__ import annotations

import argparse
from pathlib import Path

WAYS = ("inline", "native", "native-sync", "ckval", "ckval-async")
SCENARIOS = {"backlog": 0.5, "no-backlog": 3.0}  # checkpoint interval / validation time


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny run for CI: 2 checkpoints, ~0.3 s validations, backlog",
    )
    parser.add_argument(
        "--checkpoints",
        type=int,
        nargs="+",
        default=[4, 8, 16],
        help="numbers of checkpoints to sweep (default: 4 8 16)",
    )
    parser.add_argument(
        "--validation-seconds",
        type=float,
        default=1.0,
        help="target cost of one validation (default: 1.0)",
    )
    parser.add_argument("--scenario", choices=[*SCENARIOS, "both"], default="backlog")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument(
        "--steps-per-checkpoint",
        type=int,
        default=None,
        help="fix K instead of calibrating it from the scenario",
    )
    parser.add_argument(
        "--noisy-copies",
        type=int,
        default=None,
        help="fix the validation cost instead of calibrating it",
    )
    parser.add_argument("--ckval-concurrency", type=int, default=2)
    parser.add_argument(
        "--checkpoint-mb",
        type=float,
        nargs="+",
        default=[0.0],
        help="pad each checkpoint with this many MB of random bytes; several sweep (default 0)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per way and checkpoint count; the tables show medians (default 1)",
    )
    parser.add_argument(
        "--score-tolerance",
        type=float,
        default=0.01,
        help="allowed spread of best accuracy across ways (default 0.01)",
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="measure from a cold start (by default one untimed run per way goes first)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary CKVAL_HOME")
    args = parser.parse_args(argv)
    if args.smoke:
        args.checkpoints, args.validation_seconds, args.scenario = [2], 0.3, "backlog"
        args.warmup = False
    return args
