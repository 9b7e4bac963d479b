"""Train on A100 nodes, validate on A10G nodes, at most one A10G validation at a time.

    python tests/cluster_programs/heterogeneous.py [--epochs N] [--hold-s S]

Starts its own multi-node Ray with ray.cluster_utils.Cluster (a 1-CPU head, 2 nodes with
a fake GPU and `accelerator_type:A100`, 2 with a fake GPU and `accelerator_type:A10G`),
the ckval service with pools={"A10G": 1}, and a 2-worker TorchTrainer pinned to the A100
nodes whose rank 0 reports every epoch with validation_resources on an A10G. Prints one
JSON summary as its last stdout line; stops every node it started, also on failure.
CKVAL_HOME and RAY_TMPDIR come from the caller (else fresh temporary ones).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

import _harness
import torch

from validation_service.cli.demo import load_digits_split, make_model, validate_digits

A100, A10G = "A100", "A10G"


def train_on_a100(config):
    """The TorchTrainer loop; every rank records where it runs."""
    import ray
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    from trainer_integration import report

    torch.manual_seed(0)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    node_id = ray.get_runtime_context().get_node_id()
    worker_node_ids = [None] * world
    dist.all_gather_object(worker_node_ids, node_id)
    x_train, _, y_train, _ = load_digits_split()
    x = torch.from_numpy(x_train[rank::world])
    y = torch.from_numpy(y_train[rank::world]).long()
    model = ray.train.torch.prepare_model(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(config["epochs"]):
        for start in range(0, len(x), 64):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                model(x[start : start + 64]), y[start : start + 64]
            )
            loss.backward()
            optimizer.step()
        metrics = {"epoch": epoch, "train_loss": float(loss), "node_id": node_id}
        if rank != 0:
            report(metrics, None)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(model.module.state_dict(), os.path.join(tmp, "model.pt"))
            report(
                {**metrics, "worker_node_ids": worker_node_ids},
                checkpoint=ray.train.Checkpoint.from_directory(tmp),
                validate_fn=validate_on_a10g,
                validate_config={"hold_s": config["hold_s"]},
                validation_resources={"num_cpus": 1, "num_gpus": 1, "accelerator_type": A10G},
            )


def validate_on_a10g(checkpoint, config):
    """The digits evaluation, held open so that two at once would visibly overlap."""
    import ray

    metrics = validate_digits(checkpoint, {})
    time.sleep(config["hold_s"])
    return {**metrics, "assigned_gpus": len(ray.get_gpu_ids())}


def max_overlap(attempts: list[dict]) -> int:
    """The most attempts running at one instant, from their recorded start/finish."""
    events = []
    for a in attempts:
        events += [(a["started_at"], 1), (a["finished_at"], -1)]
    running = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # a finish sorts first
        running += delta
        peak = max(peak, running)
    return peak


def _shutdown_ray() -> None:
    import ray

    ray.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--hold-s", type=float, default=1.5)
    args = parser.parse_args()

    home = _harness.ckval_home()
    ray_tmpdir = _harness.private_ray_tmpdir()
    summary: dict = {"scenario": "heterogeneous", "home": str(home), "ray_tmpdir": ray_tmpdir}
    timings: dict[str, float] = {}
    began = time.monotonic()
    cluster = None
    try:
        import ray
        from ray.cluster_utils import Cluster
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        from validation_service.config import ckval_env
        from validation_service.registry.registry import Registry
        from validation_service.service import ValidationService

        # The GCS port is 0 (any free one) unless given: never Redis' 6379.
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "include_dashboard": False,
                "dashboard_agent_listen_port": None,
            },
        )
        kinds = {A100: [], A10G: []}
        for kind in (A100, A100, A10G, A10G):
            node = cluster.add_node(
                num_cpus=2, num_gpus=1, resources={f"accelerator_type:{kind}": 1}
            )
            kinds[kind].append(node.node_id)
        cluster.wait_for_nodes()
        timings["cluster_start_s"] = round(time.monotonic() - began, 1)
        summary.update(
            gcs_address=cluster.address,
            head_node=cluster.head_node.node_id,
            a100_nodes=kinds[A100],
            a10g_nodes=kinds[A10G],
        )
        _harness.log(f"cluster at {cluster.address}: {kinds}")
        assert not cluster.address.endswith(":6379"), cluster.address

        ray.init(
            address=cluster.address,
            log_to_driver=False,
            runtime_env={"env_vars": ckval_env()},
        )
        summary["ray_nodes"] = [
            {"node_id": n["NodeID"], "resources": n["Resources"]} for n in ray.nodes() if n["Alive"]
        ]
        service = ValidationService.start(pools={A10G: 1})

        run = f"hetero-{os.getpid()}"
        t0 = time.monotonic()
        result = TorchTrainer(
            train_on_a100,
            train_loop_config={"epochs": args.epochs, "hold_s": args.hold_s},
            scaling_config=ScalingConfig(
                num_workers=2,
                # Fake GPUs: a sliver of the custom resource pins workers to A100 nodes.
                resources_per_worker={"CPU": 1, f"accelerator_type:{A100}": 0.001},
            ),
            run_config=RunConfig(name=run, storage_path=str(home / "ray_results")),
        ).fit()
        timings["train_s"] = round(time.monotonic() - t0, 1)
        summary["train_error"] = None if result.error is None else repr(result.error)
        _harness.log(f"training done in {timings['train_s']}s; waiting for validations")

        registry = Registry()
        t1 = time.monotonic()
        registry.wait(run, timeout_s=240)
        timings["validations_after_training_s"] = round(time.monotonic() - t1, 1)
        checkpoints = registry.checkpoints(run)
        attempts = _harness.attempts_of(registry, run)
        summary.update(
            run=run,
            service_pools=service.status()["pools"],
            worker_node_ids=sorted(
                {n for c in checkpoints for n in c.reported_metrics["worker_node_ids"]}
            ),
            checkpoints=[
                {
                    "report_index": c.report_index,
                    "validation_status": c.validation_status,
                    "accuracy": (c.validated_metrics or {}).get("accuracy"),
                    "assigned_gpus": (c.validated_metrics or {}).get("assigned_gpus"),
                }
                for c in checkpoints
            ],
            jobs={str(j.report_index): j.status for j in registry.validations(run)},
            attempts=attempts,
            max_concurrent_validations=max_overlap(attempts),
        )
        service.stop()
        summary["ok"] = True
    except BaseException:  # noqa: BLE001 - reported in the summary, then torn down
        summary["ok"] = False
        summary["error"] = traceback.format_exc()
        _harness.log(summary["error"])
    finally:
        t2 = time.monotonic()
        summary["teardown_errors"] = _harness.run_all(
            _shutdown_ray,
            cluster.shutdown if cluster is not None else None,
            lambda: summary.update(
                leftover_processes_killed=_harness.kill_processes_with(ray_tmpdir)
            ),
        )
        timings["teardown_s"] = round(time.monotonic() - t2, 1)
        timings["total_s"] = round(time.monotonic() - began, 1)
        summary["timings"] = timings
        _harness.emit(summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
