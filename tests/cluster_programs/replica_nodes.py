"""Service replicas on separate nodes; the node of one of them is removed mid-validation.

    python tests/cluster_programs/replica_nodes.py --database-url URL [--reports N]
        [--hold-s S]

Starts its own multi-node Ray with ray.cluster_utils.Cluster (a 1-CPU head and two
2-CPU nodes), the ckval service with 2 replicas on the PostgreSQL registry at URL, reports
checkpoints with Client(run).report, and, while validations run, removes the node that
the second replica runs on (Cluster.remove_node: its raylet and every process on it go,
as when a machine is lost). Waits for every validation, then for the second replica to run
again (on another node). Prints one JSON summary as its last stdout line; stops every node
it started, also on failure. CKVAL_HOME and RAY_TMPDIR come from the caller.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

import _harness


def hold(checkpoint, config):
    """Holds the validation open, then says where it ran."""
    import ray

    time.sleep(config["hold_s"])
    return {"index": float(config["index"]), "node": ray.get_runtime_context().get_node_id()}


def replicas_by_name(service) -> dict[str, dict]:
    return {r["name"]: r for r in service.status()["replicas"]}


def wait_for_replicas(service, condition, timeout_s: float, what: str) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            replicas = replicas_by_name(service)
            if condition(replicas):
                return replicas
        except Exception as exc:  # noqa: BLE001 - the first replica may be busy; ask again
            _harness.log(f"status: {exc!r}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s}s")
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--reports", type=int, default=8)
    parser.add_argument("--hold-s", type=float, default=2.0)
    args = parser.parse_args()

    home = _harness.ckval_home()
    os.environ["CKVAL_DATABASE_URL"] = args.database_url
    ray_tmpdir = _harness.private_ray_tmpdir()
    summary: dict = {"scenario": "replica_nodes", "home": str(home), "ray_tmpdir": ray_tmpdir}
    timings: dict[str, float] = {}
    began = time.monotonic()
    cluster = None
    try:
        import ray
        from ray.cluster_utils import Cluster
        from ray.train import Checkpoint

        from trainer_integration import Client
        from validation_service.config import ckval_env
        from validation_service.registry.registry import Registry
        from validation_service.service import ValidationService

        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "include_dashboard": False,
                "dashboard_agent_listen_port": None,
            },
        )
        nodes = {}
        for _ in range(2):
            node = cluster.add_node(num_cpus=2)
            nodes[node.node_id] = node
        cluster.wait_for_nodes()
        summary.update(head_node=cluster.head_node.node_id, worker_nodes=sorted(nodes))
        ray.init(
            address=cluster.address, log_to_driver=False, runtime_env={"env_vars": ckval_env()}
        )
        timings["cluster_start_s"] = round(time.monotonic() - began, 1)

        service = ValidationService.start(
            replicas=2, pools={"CPU": 4}, heartbeat_s=1.0, lease_s=8.0
        )
        second = f"{service.settings.service_name}-replica-1"
        replicas = wait_for_replicas(
            service, lambda r: all(x["alive"] for x in r.values()), 120, "both replicas"
        )
        summary["replica_nodes_before"] = {name: r["node_id"] for name, r in replicas.items()}

        run = f"replica-nodes-{os.getpid()}"
        client = Client(run)
        with tempfile.TemporaryDirectory() as scratch:
            for index in range(args.reports):
                directory = os.path.join(scratch, str(index))
                os.makedirs(directory)
                with open(os.path.join(directory, "w.txt"), "w") as f:
                    f.write(str(index))
                client.report(
                    {"step": index},
                    Checkpoint.from_directory(directory),
                    validate_fn=hold,
                    validate_config={"hold_s": args.hold_s, "index": index},
                )
        registry = Registry()
        deadline = time.monotonic() + 120
        while not any(j.status == "RUNNING" for j in registry.validations(run)):
            assert time.monotonic() < deadline, "no validation ran within 120 s"
            time.sleep(0.2)

        lost_node = replicas[second]["node_id"]
        summary["node_removed"] = lost_node
        if lost_node in nodes:
            removed_at = time.monotonic()
            cluster.remove_node(nodes.pop(lost_node), allow_graceful=False)
            _harness.log(f"removed node {lost_node} of {second}")
        else:
            raise AssertionError(
                f"{second} runs on node {lost_node}, not on a worker node {sorted(nodes)} "
                f"(head {cluster.head_node.node_id}); replicas: {replicas}"
            )

        registry.wait(run, timeout_s=300)
        timings["validated_after_removal_s"] = round(time.monotonic() - removed_at, 1)
        replicas = wait_for_replicas(
            service,
            lambda r: r[second]["alive"] and r[second]["node_id"] != lost_node,
            180,
            f"{second} running again on another node",
        )
        timings["replica_back_after_removal_s"] = round(time.monotonic() - removed_at, 1)
        summary.update(
            run=run,
            replica_nodes_after={name: r["node_id"] for name, r in replicas.items()},
            attempts=_harness.attempts_of(registry, run),
            jobs={str(j.report_index): j.status for j in registry.validations(run)},
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


def _shutdown_ray() -> None:
    import ray

    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
