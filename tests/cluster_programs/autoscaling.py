"""Validations that need an A10G scale an autoscaling cluster up from zero A10G nodes;
requests no node type offers fail by name; a job waits for a node past its timeout_s.

    python tests/cluster_programs/autoscaling.py [--checkpoints N] [--hold-s S]
        [--idle-timeout-min M] [--scale-down-timeout-s T] [--timeout-s T]

Starts its own head with `ray start --head --block` (a free port, never 6379; its own
session, so its process group is ours to kill) and an autoscaling config for Ray's
fake_multinode provider: a CPU-only head and a node type "a10g" (2 CPUs, a fake GPU,
`accelerator_type:A10G`) with min_workers 0 and max_workers 2. This is what
ray.cluster_utils.AutoscalingCluster does, minus its `ray stop --force`, which would kill
every Ray on the machine. CKVAL_NODE_TYPES names a copy of its node types.
Then it starts the ckval service (pools={"A10G": 2}) and reports, in one run, checkpoints
with Client(run).report whose validations ask for an A10G and 1 GPU, one that asks for an
H100 and one for an "A10g" (no node type offers either). It samples the alive worker nodes
and the jobs' statuses throughout and waits for the validations. Then it adds an "h100"
node type to ckval's node types (CKVAL_NODE_TYPES, a file of its own) and runs `ckval
retry` of the H100 job: it waits for a node (WAITING_FOR_RESOURCES); once it has waited
longer than its timeout_s, the node type reaches the autoscaler's config too, which adds
the node; the job runs and succeeds. Last, it waits for the idle worker nodes to be
removed. Prints one JSON summary as its last stdout line and stops every process it
started, also on failure. CKVAL_HOME and RAY_TMPDIR come from the caller (else fresh
temporary ones).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import _harness
import torch

from validation_service.cli.demo import load_digits_split, make_model, validate_digits

A10G = "A10G"
A10G_RESOURCE = f"accelerator_type:{A10G}"
MAX_A10G_NODES = 2
H100_RESOURCE = "accelerator_type:H100"
WORKER_TYPES = {A10G_RESOURCE: "a10g", H100_RESOURCE: "h100"}


def validate_on_a10g(checkpoint, config):
    """The digits evaluation, held open a little so that both nodes get work."""
    import ray

    metrics = validate_digits(checkpoint, {})
    time.sleep(config["hold_s"])
    return {**metrics, "assigned_gpus": len(ray.get_gpu_ids())}


def hold_a_gpu(checkpoint, config):
    """A validation that imports nothing heavy: its running time is its hold."""
    import ray

    time.sleep(config["hold_s"])
    return {"held_s": config["hold_s"], "assigned_gpus": len(ray.get_gpu_ids())}


def fake_gpu_node(resource: str) -> dict:
    """A node type of the fake provider: 2 CPUs, a fake GPU of one accelerator type."""
    return {
        "resources": {
            "CPU": 2,
            "GPU": 1,
            resource: 1,
            "object_store_memory": 150 * 1024 * 1024,
        },
        "node_config": {},
        "min_workers": 0,
        "max_workers": MAX_A10G_NODES if resource == A10G_RESOURCE else 1,
    }


def autoscaling_config(gcs_address: str, idle_timeout_min: float) -> dict:
    """A complete fake_multinode config (the monitor reads it as is, without defaults)."""
    return {
        "cluster_name": f"ckval-autoscaling-{os.getpid()}",
        "max_workers": MAX_A10G_NODES,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_min,
        "docker": {},
        "provider": {
            "type": "fake_multinode",
            # The fake provider joins new nodes to <node ip>:6379 unless told otherwise.
            "gcs_address": gcs_address,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "auth": {},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "a10g": fake_gpu_node(A10G_RESOURCE),
        },
        "head_node_type": "ray.head.default",
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def start_head(port: int, ip: str, config_path: Path, log_path: Path) -> subprocess.Popen:
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    env = dict(os.environ, AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_FAKE_CLUSTER="1")
    command = [
        ray_cli,
        "start",
        "--head",
        f"--port={port}",
        f"--node-ip-address={ip}",
        f"--autoscaling-config={config_path}",
        "--num-cpus=1",
        "--num-gpus=0",
        f"--object-store-memory={150 * 1024 * 1024}",
        "--include-dashboard=false",
        f"--dashboard-port={_harness.free_port()}",
        f"--ray-client-server-port={_harness.free_port()}",
        f"--dashboard-agent-listen-port={_harness.free_port()}",
        "--disable-usage-stats",
        "--block",
    ]
    with open(log_path, "w") as log:
        # Its own session: its process group holds the GCS, the head raylet and the
        # autoscaler with the fake nodes it launches, and nothing else.
        return subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_for_port(head: subprocess.Popen, ip: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with {head.returncode}")
        try:
            with socket.create_connection((ip, port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the head's GCS did not listen on {ip}:{port} within {timeout_s}s")


def stop_head(head: subprocess.Popen | None) -> None:
    if head is None or head.poll() is not None:
        return
    try:
        # `ray start --block` drains its node on SIGTERM for up to 30 s: not needed here.
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait(timeout=10)


class ClusterSampler(threading.Thread):
    """Samples twice a second the alive worker nodes of each type (the record of the
    scale-up and -down) and, once given a run, its jobs' statuses (the record of waits)."""

    def __init__(self):
        super().__init__(name="cluster-sampler", daemon=True)
        self.began = time.monotonic()
        self.samples: dict[str, list[tuple[float, int]]] = {t: [] for t in WORKER_TYPES.values()}
        self.seen: dict[str, set[str]] = {t: set() for t in WORKER_TYPES.values()}
        self.statuses: dict[int, list[str]] = {}  # job id -> its statuses, in order seen
        self.watch: tuple | None = None  # (registry, run)
        self._stopping = threading.Event()

    def count(self, node_type: str = "a10g") -> int:
        import ray

        now = round(time.monotonic() - self.began, 1)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        for resource, kind in WORKER_TYPES.items():
            alive = [n["NodeID"] for n in nodes if resource in n["Resources"]]
            self.seen[kind].update(alive)
            samples = self.samples[kind]
            if not samples or samples[-1][1] != len(alive):
                samples.append((now, len(alive)))  # changes only, with when they happened
        return self.samples[node_type][-1][1]

    def look_at_jobs(self) -> None:
        if self.watch is None:
            return
        registry, run = self.watch
        for job in registry.validations(run):
            seen = self.statuses.setdefault(job.id, [])
            if not seen or seen[-1] != job.status:
                seen.append(job.status)

    def run(self) -> None:
        while not self._stopping.wait(0.5):
            try:
                self.count()
                self.look_at_jobs()
            except Exception:  # noqa: BLE001 - a missed sample is retried next tick
                pass

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=5)


def kill_a_replica_holding_a_lease(service, registry, run: str) -> dict:
    """kill -9 of the replica that holds a RUNNING validation's lease."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        running = [j for j in registry.validations(run) if j.status == "RUNNING"]
        if running:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("no validation ran within 120 s")
    job = running[0]
    owner = job.lease_owner.split("/")[0]
    [replica] = [r for r in service.status()["replicas"] if r["name"] == owner]
    os.kill(replica["pid"], signal.SIGKILL)
    _harness.log(f"killed replica {owner} (pid {replica['pid']}) holding job {job.id}")
    return {"name": owner, "pid": replica["pid"], "job_id": job.id}


def replicas_answering(service, count: int, timeout_s: float = 120) -> list[dict]:
    """The replicas once all of them answer again (Ray restarts a killed one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = service.status()["replicas"]
        alive = [r for r in replicas if r["alive"]]
        if len(alive) == count or time.monotonic() > deadline:
            return [{"name": r["name"], "pid": r["pid"], "alive": r["alive"]} for r in replicas]
        time.sleep(0.5)


def save_checkpoint(model: torch.nn.Module, directory: str) -> None:
    os.makedirs(directory)
    torch.save(model.state_dict(), os.path.join(directory, "model.pt"))


def report_checkpoints(client, args, checkpoint_class) -> None:
    """The digits model's checkpoints, each validated on an A10G; then two whose
    validations ask for what no node type offers: an H100, and an A10g (a typo)."""
    torch.manual_seed(0)
    x_train, _, y_train, _ = load_digits_split()
    x, y = torch.from_numpy(x_train), torch.from_numpy(y_train).long()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with tempfile.TemporaryDirectory() as scratch:
        for step in range(args.checkpoints + 2):
            for start in range(0, len(x), 64):
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(
                    model(x[start : start + 64]), y[start : start + 64]
                )
                loss.backward()
                optimizer.step()
            directory = os.path.join(scratch, str(step))
            save_checkpoint(model, directory)
            kind = A10G if step < args.checkpoints else ("H100", "A10g")[step - args.checkpoints]
            client.report(
                {"step": step, "train_loss": loss.item()},
                checkpoint_class.from_directory(directory),
                validate_fn=validate_on_a10g if kind == A10G else hold_a_gpu,
                validate_config={"hold_s": args.hold_s if kind == A10G else 0.3},
                validation_resources={"num_cpus": 1, "num_gpus": 1, "accelerator_type": kind},
                timeout_s=None if kind == A10G else args.timeout_s,
                max_attempts=3 if kind == A10G else 1,
            )


def refused_jobs(registry, run: str, indices: list[int], timeout_s: float = 120) -> dict:
    """The jobs of these reports once FAILED: their error and how long it took."""
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = [j for j in registry.validations(run) if j.report_index in indices]
        if all(j.status == "FAILED" for j in jobs) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return {
        str(j.report_index): {
            "job_id": j.id,
            "status": j.status,
            "error_type": j.error_type,
            "error_message": j.error_message,
            "seconds_to_fail": (j.finished_at - j.created_at).total_seconds()
            if j.finished_at
            else None,
        }
        for j in jobs
    }


def retry_with_an_h100_node_type(
    config: dict, config_path: Path, types_path: Path, registry, job, gcs_address: str
) -> str:
    """The operator adds an "h100" node type: to ckval's node types first, then `ckval
    retry JOB`; once the job has waited longer than its timeout_s, to the autoscaler's
    config too (its monitor reads the file again every update), which adds the node."""
    config["available_node_types"]["h100"] = fake_gpu_node(H100_RESOURCE)
    config["max_workers"] = MAX_A10G_NODES + 1
    types_path.write_text(json.dumps(config, indent=1))
    ckval = os.path.join(os.path.dirname(sys.executable), "ckval")
    env = dict(os.environ, CKVAL_RAY_ADDRESS=gcs_address)
    done = subprocess.run(
        [ckval, "retry", str(job.id)], env=env, capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise AssertionError(f"ckval retry failed ({done.returncode}): {done.stderr}")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = registry.get_job(job.id)
        if now.status == "WAITING_FOR_RESOURCES":
            claimed = now.attempt_history[-1].claimed_at
            waited = (dt.datetime.now(dt.timezone.utc) - claimed).total_seconds()
            if waited > job.timeout_s + 1:
                break  # past what its timeout would have allowed, had waiting counted
        time.sleep(0.2)
    else:
        raise AssertionError(f"job {job.id} did not wait for its node: {now.status}")
    config_path.write_text(json.dumps(config, indent=1))
    return done.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", type=int, default=4)
    parser.add_argument("--hold-s", type=float, default=2.0)
    parser.add_argument("--idle-timeout-min", type=float, default=0.1)
    parser.add_argument("--scale-down-timeout-s", type=float, default=90.0)
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=6.0,
        help="timeout_s of the H100 validation: it waits longer than that for its node",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="service replicas (PostgreSQL at --database-url); with 2 or more, the "
        "replica holding a validation's lease is killed (kill -9) while it runs",
    )
    parser.add_argument("--database-url", default=None, help="else CKVAL_HOME's SQLite")
    args = parser.parse_args()

    home = _harness.ckval_home()
    if args.database_url:
        os.environ["CKVAL_DATABASE_URL"] = args.database_url
    ray_tmpdir = _harness.private_ray_tmpdir()
    summary: dict = {"scenario": "autoscaling", "home": str(home), "ray_tmpdir": ray_tmpdir}
    timings: dict[str, float] = {}
    began = time.monotonic()
    head = None
    sampler = None
    try:
        import ray
        import ray._private.services
        from ray.train import Checkpoint

        from trainer_integration import Client
        from validation_service import _ray_compat
        from validation_service.config import ckval_env
        from validation_service.registry.registry import Registry
        from validation_service.service import ValidationService

        port = _harness.free_port()
        ip = ray._private.services.get_node_ip_address()
        gcs_address = f"{ip}:{port}"
        config = autoscaling_config(gcs_address, args.idle_timeout_min)
        config_path = Path(ray_tmpdir) / "autoscaling.json"
        config_path.write_text(json.dumps(config, indent=1))
        # ckval reads the node types the autoscaler can add from a file of its own, as
        # on KubeRay (there, a ConfigMap entry beside the RayCluster).
        types_path = Path(ray_tmpdir) / "node_types.json"
        types_path.write_text(json.dumps(config, indent=1))
        os.environ["CKVAL_NODE_TYPES"] = str(types_path)
        head_log = Path(ray_tmpdir) / "ray-start.log"
        summary.update(gcs_address=gcs_address, head_log=str(head_log))
        head = start_head(port, ip, config_path, head_log)
        wait_for_port(head, ip, port, timeout_s=60)
        ray.init(address=gcs_address, log_to_driver=False, runtime_env={"env_vars": ckval_env()})
        timings["head_start_s"] = round(time.monotonic() - began, 1)

        sampler = ClusterSampler()
        summary["a10g_nodes_at_start"] = sampler.count()
        if summary["a10g_nodes_at_start"] != 0:
            raise AssertionError(f"{summary['a10g_nodes_at_start']} A10G nodes before any work")
        sampler.start()
        service = ValidationService.start(
            pools={A10G: MAX_A10G_NODES}, replicas=args.replicas, heartbeat_s=1.0, lease_s=10.0
        )

        run = f"autoscale-{os.getpid()}"
        client = Client(run)
        registry = Registry()
        sampler.watch = (registry, run)
        t0 = time.monotonic()
        report_checkpoints(client, args, Checkpoint)
        timings["reports_s"] = round(time.monotonic() - t0, 1)
        h100, typo = args.checkpoints, args.checkpoints + 1
        summary["refused"] = refused_jobs(registry, run, [h100, typo])
        summary["autoscaler_kind"] = _ray_compat.autoscaler_kind()
        summary["service_cluster"] = service.status()["cluster"]

        if args.replicas > 1:
            summary["replica_killed"] = kill_a_replica_holding_a_lease(service, registry, run)
        registry.wait(run, timeout_s=240, raise_on_failure=False)
        if args.replicas > 1:
            summary["replicas_after"] = replicas_answering(service, args.replicas)
        timings["validations_s"] = round(time.monotonic() - t0, 1)
        sampler.count()
        peak = max(count for _, count in sampler.samples["a10g"])
        _harness.log(f"validations done in {timings['validations_s']}s; A10G peak {peak}")

        # The operator adds the missing node type and retries: the job waits for the node.
        t1 = time.monotonic()
        job = registry.get_job(summary["refused"][str(h100)]["job_id"])
        summary["retry_output"] = retry_with_an_h100_node_type(
            config, config_path, types_path, registry, job, gcs_address
        )
        registry.wait(run, timeout_s=240, raise_on_failure=False)
        timings["h100_retry_s"] = round(time.monotonic() - t1, 1)
        sampler.look_at_jobs()
        summary.update(
            run=run,
            service_pools=service.status()["pools"],
            a10g_nodes_peak=peak,
            jobs={str(j.report_index): j.status for j in registry.validations(run)},
            job_statuses_seen={str(k): v for k, v in sampler.statuses.items()},
            attempts=_harness.attempts_of(registry, run),
            checkpoints=[
                {
                    "report_index": c.report_index,
                    "validation_status": c.validation_status,
                    "accuracy": (c.validated_metrics or {}).get("accuracy"),
                    "assigned_gpus": (c.validated_metrics or {}).get("assigned_gpus"),
                }
                for c in registry.checkpoints(run)
            ],
        )
        service.stop()

        # Scale-down: the worker nodes, idle since the last validation, go after
        # idle_timeout_minutes (the autoscaler looks once a second).
        t2 = time.monotonic()
        deadline = t2 + args.scale_down_timeout_s
        while (sampler.count("a10g") or sampler.count("h100")) and time.monotonic() < deadline:
            time.sleep(0.5)
        summary["a10g_nodes_after_idle"] = sampler.count("a10g")
        summary["h100_nodes_after_idle"] = sampler.count("h100")
        if not summary["a10g_nodes_after_idle"] + summary["h100_nodes_after_idle"]:
            timings["scale_down_wait_s"] = round(time.monotonic() - t2, 1)
        summary["ok"] = True
    except BaseException:  # noqa: BLE001 - reported in the summary, then torn down
        summary["ok"] = False
        summary["error"] = traceback.format_exc()
        _harness.log(summary["error"])
        summary["monitor_log_tail"] = _monitor_log_tail(ray_tmpdir)
    finally:
        t3 = time.monotonic()
        summary["teardown_errors"] = _harness.run_all(
            (lambda: _record_samples(sampler, summary)) if sampler is not None else None,
            _shutdown_ray,
            lambda: stop_head(head),
            lambda: summary.update(
                leftover_processes_killed=_harness.kill_processes_with(ray_tmpdir)
            ),
        )
        timings["teardown_s"] = round(time.monotonic() - t3, 1)
        timings["total_s"] = round(time.monotonic() - began, 1)
        summary["timings"] = timings
        _harness.emit(summary)
    return 0 if summary["ok"] else 1


def _record_samples(sampler: ClusterSampler, summary: dict) -> None:
    sampler.stop()
    summary["a10g_node_count_changes"] = sampler.samples["a10g"]
    summary["a10g_nodes_seen"] = sorted(sampler.seen["a10g"])
    summary["h100_node_count_changes"] = sampler.samples["h100"]
    summary["h100_nodes_seen"] = sorted(sampler.seen["h100"])


def _shutdown_ray() -> None:
    import ray

    ray.shutdown()


def _monitor_log_tail(ray_tmpdir: str, lines: int = 40) -> str:
    logs = sorted(Path(ray_tmpdir).glob("ray/session_*/logs/monitor.log"))
    if not logs:
        return ""
    return "\n".join(logs[-1].read_text(errors="replace").splitlines()[-lines:])


if __name__ == "__main__":
    sys.exit(main())
