"""Sharded checkpoints on S3: what each way writes to the object store per checkpoint byte.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_sharded_s3.py  # 4 ranks x 64 MB
    PYTHONPATH=. .venv/bin/python benchmarks/bench_sharded_s3.py --smoke  # tiny, checks it runs

moto's S3 server on loopback, reached through a proxy that counts what the clients send
(tests/moto_s3.py's S3Traffic): the bytes, the requests, and the server-side copies
(CopyObject: the server writes the object's bytes again, none of them sent). R ranks
each hold a shard of S MB (rank 0 also a small ``.metadata``) and report it once:

- **ray**: a TorchTrainer of R CPU workers, each ``ray.train.report(metrics,
  checkpoint=Checkpoint.from_directory(its folder), checkpoint_upload_mode=ASYNC)``, Ray
  Train's storage on the S3 server (``storage_filesystem``: pyarrow's S3 client);
- **ckval**: the same run with ckval's ``report(..., checkpoint_upload_mode=ASYNC)``,
  CKVAL_STORAGE on the S3 server (Ray Train's own storage local: it keeps ckval's
  pointer there), timed until the registry lists the checkpoint;
- **fsspec**: s3fs ``put(folder, checkpoint folder, recursive=True)`` of the R folders,
  one after another from one process.

Per way: bytes sent / checkpoint bytes, bytes copied on the server / checkpoint bytes
(each copied object's size), the two together (bytes written per checkpoint byte),
requests, copies, and the wall time (moto runs in this process: the time is the
slowest part of the figure, the bytes are exact). MB is 2**20 bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # tests.moto_s3: the counting proxy
from _common import fresh_ckval_home, pickle_by_value, run_description  # noqa: E402
from _sharded_persist import MB, make_rank_folders  # noqa: E402

from tests.moto_s3 import CREDENTIALS, S3Traffic, moto_s3_server  # noqa: E402

BUCKET = "bench"
WAYS = ("ray", "ckval", "fsspec")


def train_func(config: dict[str, Any]) -> None:
    """Each rank reports its folder once (Ray's report or ckval's)."""
    import ray.train

    from trainer_integration import CheckpointUploadMode, report

    rank = ray.train.get_context().get_world_rank()
    folder = os.path.join(config["folders"], f"rank{rank}")
    checkpoint = ray.train.Checkpoint.from_directory(folder)
    if config["way"] == "ray":
        mode = ray.train.CheckpointUploadMode.ASYNC
        ray.train.report({"step": 0}, checkpoint=checkpoint, checkpoint_upload_mode=mode)
    else:
        report({"step": 0}, checkpoint, checkpoint_upload_mode=CheckpointUploadMode.ASYNC)


def pyarrow_s3(endpoint: str):
    import pyarrow.fs

    return pyarrow.fs.S3FileSystem(
        access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region=CREDENTIALS["AWS_DEFAULT_REGION"],
        endpoint_override=endpoint.split("//", 1)[1],
        scheme="http",
    )


def in_ray_train(way: str, traffic: S3Traffic, workdir: Path, ranks: int) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    run = f"s3-{way}-{uuid.uuid4().hex[:6]}"
    storage: dict[str, Any] = {"storage_path": str(workdir / "ray_results")}
    if way == "ray":
        storage = {
            "storage_path": f"{BUCKET}/ray",
            "storage_filesystem": pyarrow_s3(traffic.endpoint),
        }
    result = TorchTrainer(
        train_func,
        train_loop_config={"way": way, "folders": str(workdir / way)},
        scaling_config=ScalingConfig(num_workers=ranks),
        run_config=RunConfig(name=run, **storage),
    ).fit()
    if result.error is not None:
        raise RuntimeError(f"{way}: the run failed: {result.error}")
    if way == "ckval":
        from validation_service.registry.registry import Registry

        registry, deadline = Registry(), time.monotonic() + 300
        while not registry.checkpoints(run):
            if time.monotonic() > deadline:
                raise RuntimeError("ckval: the checkpoint was not registered in 300 s")
            time.sleep(0.05)


def with_fsspec(traffic: S3Traffic, workdir: Path, ranks: int) -> None:
    import fsspec

    fs = fsspec.filesystem(
        "s3",
        key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=traffic.endpoint,
        skip_instance_cache=True,
    )
    dest = f"{BUCKET}/fsspec/{uuid.uuid4().hex[:6]}/checkpoint_000000/"
    # One folder after another: moto's server (werkzeug) lost requests of concurrent
    # puts from one process here, and s3fs then waited without end.
    for rank in range(ranks):
        fs.put(f"{workdir / 'fsspec' / f'rank{rank}'}/", dest, recursive=True)


def copied_bytes(traffic: S3Traffic) -> int:
    """The size of each object a server-side copy wrote (it is where the copy put it)."""
    import boto3

    client = boto3.client("s3", endpoint_url=traffic.endpoint, **_boto_credentials())
    total = 0
    for target, _ in traffic.copies:
        bucket, _, key = target.lstrip("/").split("?", 1)[0].partition("/")
        from urllib.parse import unquote

        total += client.head_object(Bucket=bucket, Key=unquote(key))["ContentLength"]
    return total


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


def measure(ways, ranks: int, shard_mb: float, workdir: Path) -> tuple[float, list[dict]]:
    import ray

    checkpoint_bytes = 0
    rows = []
    with moto_s3_server(BUCKET) as endpoint, S3Traffic(endpoint) as traffic:
        os.environ.update(CREDENTIALS)
        os.environ["CKVAL_STORAGE"] = f"s3://{BUCKET}/ckval"
        os.environ["CKVAL_STORAGE_OPTIONS"] = (
            f'{{"endpoint_url": "{traffic.endpoint}", '
            '"client_kwargs": {"region_name": "us-east-1"}}'
        )
        pickle_by_value(__name__)
        ray.init(num_cpus=ranks + 2, include_dashboard=False, log_to_driver=False)
        try:
            for way in ways:
                # Each way its own copy: Ray Train's ASYNC report deletes the folders.
                make_rank_folders(workdir / way, ranks, int(shard_mb * MB))
                files = [f for f in (workdir / way).rglob("*") if f.is_file()]
                checkpoint_bytes = sum(f.stat().st_size for f in files)
                traffic.reset()
                started = time.perf_counter()
                if way == "fsspec":
                    with_fsspec(traffic, workdir, ranks)
                else:
                    in_ray_train(way, traffic, workdir, ranks)
                wall = time.perf_counter() - started
                copied = copied_bytes(traffic)
                rows.append(
                    {
                        "way": way,
                        "sent": traffic.sent_bytes / checkpoint_bytes,
                        "copied": copied / checkpoint_bytes,
                        "requests": len(traffic.requests),
                        "copies": len(traffic.copies),
                        "wall": wall,
                    }
                )
                print(f"  {way}: {rows[-1]}", flush=True)
        finally:
            ray.shutdown()
    return checkpoint_bytes / MB, rows


def table(rows: list[dict]) -> str:
    lines = [
        "| way | bytes sent / checkpoint byte | bytes copied on the server / checkpoint byte "
        "| bytes written / checkpoint byte | requests | server-side copies | wall (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['way']} | {r['sent']:.3f} | {r['copied']:.3f} | "
            f"{r['sent'] + r['copied']:.3f} | {r['requests']} | {r['copies']} | {r['wall']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--shard-mb", type=float, default=64)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--smoke", action="store_true", help="1 MB shards")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shard_mb = 1
    from _common import load_average

    load_before = load_average()
    workdir = fresh_ckval_home("ckval-bench-s3-")
    try:
        total_mb, rows = measure(args.ways, args.ranks, args.shard_mb, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    meta = run_description(load_before)
    header = "\n".join(f"- {key}: {value}" for key, value in meta.items())
    markdown = (
        f"{header}\n\n### {args.ranks} ranks x {args.shard_mb:g} MB on S3 (moto), "
        f"{total_mb:.1f} MB per checkpoint\n\n{table(rows)}"
    )
    print("\n" + markdown)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(markdown + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
