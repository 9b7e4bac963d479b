"""Two nodes whose ranks would report into two registries: the first report fails, naming both.

    python tests/cluster_programs/split_registry.py

Starts its own two-node Ray with ray.cluster_utils.Cluster: the head node as the driver
has it, a second node whose raylet (and so its workers) has a CKVAL_HOME of its own, as a
node of a real cluster has its own home folder. Nothing tells the workers where the
driver's registry is (no CKVAL_DATABASE_URL reaches them), so each rank resolves its own
node's default SQLite registry and storage. A 2-worker TorchTrainer, one worker on each
node, reports the same sharded checkpoint from both ranks. Prints one JSON summary (the
run's error, what each registry holds) as its last stdout line; stops every node it
started. CKVAL_HOME and RAY_TMPDIR come from the caller (else fresh temporary ones).
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback

import _harness


def report_shards(config):
    import ray.train

    from trainer_integration import report

    rank = ray.train.get_context().get_world_rank()
    for step in range(2):
        folder = tempfile.mkdtemp()
        with open(os.path.join(folder, f"shard-{rank}.json"), "w") as f:
            json.dump({"step": step, "rank": rank}, f)
        report(
            {"step": step}, ray.train.Checkpoint.from_directory(folder), validate_fn="json:dumps"
        )


def main() -> int:
    home = _harness.ckval_home()
    _harness.private_ray_tmpdir()
    other_home = tempfile.mkdtemp(prefix="ckval-other-node-")
    summary: dict = {"scenario": "split_registry", "home": str(home), "other_home": other_home}
    cluster = None
    try:
        import ray
        from ray.cluster_utils import Cluster
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        from validation_service.registry.registry import Registry

        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "resources": {"slot": 1},
                "include_dashboard": False,
                "dashboard_agent_listen_port": None,
            },
        )
        cluster.add_node(num_cpus=2, resources={"slot": 1}, env_vars={"CKVAL_HOME": other_home})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        error = None
        try:
            TorchTrainer(
                report_shards,
                scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"slot": 1}),
                run_config=RunConfig(name="split", storage_path=str(home / "ray_results")),
            ).fit()
        except Exception as exc:  # noqa: BLE001 - what the user sees, into the summary
            error = f"{type(exc).__name__}: {exc}"
        held = {}
        for name, folder in (("head", str(home)), ("other", other_home)):
            path = os.path.join(folder, "registry.db")
            held[name] = (
                len(Registry(f"sqlite:///{path}").checkpoints("split"))
                if os.path.exists(path) and _has_run(path)
                else None
            )
        summary.update(ok=True, error=error, checkpoints=held)
    except BaseException:  # noqa: BLE001 - reported in the summary
        summary.update(ok=False, error=traceback.format_exc())
    summary["teardown_errors"] = _harness.run_all(
        _shutdown_ray, cluster.shutdown if cluster is not None else None
    )
    _harness.emit(summary)
    return 0 if summary["ok"] else 1


def _has_run(path: str) -> bool:
    from validation_service.registry.registry import Registry

    return Registry(f"sqlite:///{path}").find_run_id("split") is not None


def _shutdown_ray() -> None:
    import ray

    ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
