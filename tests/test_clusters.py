"""Multi-node Ray on one machine: train on A100 nodes and validate on A10G nodes; autoscale.

The session's Ray (conftest) and a second cluster cannot live in one process, so each
scenario is a program under tests/cluster_programs/ that starts its own cluster (fake GPUs,
custom `accelerator_type:*` resources, a private RAY_TMPDIR, free ports, never 6379),
prints a JSON summary as its last stdout line and stops everything it started. The tests
assert on that summary and on the rows of the program's SQLite registry, and check that
no process of the program's cluster outlives it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.cluster_programs._harness import kill_processes_with, processes_with
from validation_service.registry.registry import Registry

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

PROGRAMS = Path(__file__).with_name("cluster_programs")
# Generous: on a busy 2-core machine a scenario takes 2 to 3 minutes.
PROGRAM_TIMEOUT_S = 480


def figure(text: str) -> None:
    print(f"\nCLUSTER FIGURE: {text}")


class ClusterProgram:
    """One scenario program: its CKVAL_HOME, its private Ray temp dir, its summary."""

    def __init__(self, tmp_path: Path):
        self.home = tmp_path / "home"
        self.stderr_path = tmp_path / "program.stderr"
        # Short, under /tmp: Ray puts Unix sockets (at most 107 bytes) below it.
        self.ray_tmpdir = tempfile.mkdtemp(prefix="ckc-", dir="/tmp")
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("CKVAL_") and k not in ("RAY_ADDRESS", "RAY_TMPDIR")
        }
        self.env.update(
            CKVAL_HOME=str(self.home),
            RAY_TMPDIR=self.ray_tmpdir,
            RAY_AUTH_MODE="disabled",
            PYTHONUNBUFFERED="1",
        )

    def run(self, name: str, *args: str) -> dict:
        started = time.monotonic()
        with open(self.stderr_path, "w") as stderr:
            process = subprocess.Popen(
                [sys.executable, str(PROGRAMS / name), *args],
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                start_new_session=True,
            )
            try:
                stdout, _ = process.communicate(timeout=PROGRAM_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
                kill_processes_with(self.ray_tmpdir)
                pytest.fail(f"{name} ran past {PROGRAM_TIMEOUT_S}s\n{self.stderr_tail()}")
        wall_s = time.monotonic() - started
        lines = [line for line in stdout.splitlines() if line.strip()]
        assert lines, f"{name} printed nothing (rc {process.returncode})\n{self.stderr_tail()}"
        summary = json.loads(lines[-1])
        summary["wall_s"] = round(wall_s, 1)
        assert process.returncode == 0 and summary["ok"], (
            f"{name} failed (rc {process.returncode}): {summary.get('error')}\n"
            f"{summary.get('monitor_log_tail', '')}\n{self.stderr_tail()}"
        )
        assert summary["teardown_errors"] == []
        # The program stopped every process of its cluster before it exited.
        assert processes_with(self.ray_tmpdir) == []
        return summary

    def registry(self) -> Registry:
        return Registry(f"sqlite:///{self.home / 'registry.db'}")

    def stderr_tail(self, chars: int = 6000) -> str:
        return self.stderr_path.read_text(errors="replace")[-chars:]

    def clean_up(self) -> None:
        kill_processes_with(self.ray_tmpdir)
        shutil.rmtree(self.ray_tmpdir, ignore_errors=True)


@pytest.fixture
def cluster_program(tmp_path):
    program = ClusterProgram(tmp_path)
    yield program
    program.clean_up()


def windows(jobs) -> list[tuple[dt.datetime, dt.datetime]]:
    return sorted((a.started_at, a.finished_at) for job in jobs for a in job.attempt_history)


def test_trains_on_a100_nodes_and_validates_one_at_a_time_on_a10g_nodes(cluster_program):
    epochs = 3
    summary = cluster_program.run("heterogeneous.py", "--epochs", str(epochs), "--hold-s", "1.0")
    a100, a10g = set(summary["a100_nodes"]), set(summary["a10g_nodes"])
    assert len(a100) == 2 and len(a10g) == 2 and not a100 & a10g
    assert summary["train_error"] is None
    assert not summary["gcs_address"].endswith(":6379")
    assert summary["service_pools"] == {"A10G": 1}

    registry = cluster_program.registry()
    run = summary["run"]
    checkpoints = registry.checkpoints(run)
    jobs = registry.validations(run)
    assert [c.report_index for c in checkpoints] == list(range(epochs))
    assert [j.status for j in jobs] == ["SUCCEEDED"] * epochs
    assert all(j.pool == "A10G" and j.resources["accelerator_type"] == "A10G" for j in jobs)

    # Training ran on A100 nodes only: both ranks' node ids, gathered by rank 0.
    for checkpoint in checkpoints:
        worker_nodes = checkpoint.reported_metrics["worker_node_ids"]
        assert len(worker_nodes) == 2 and set(worker_nodes) <= a100, worker_nodes
        assert checkpoint.reported_metrics["node_id"] == worker_nodes[0]
    assert set(summary["worker_node_ids"]) <= a100

    # Every validation ran on an A10G node, with the (fake) GPU Ray granted it.
    attempts = [a for job in jobs for a in job.attempt_history]
    assert len(attempts) == epochs
    assert {a.node_id for a in attempts} <= a10g, [a.node_id for a in attempts]
    for checkpoint in checkpoints:
        assert checkpoint.validation_status == "VALIDATED"
        assert 0.5 < checkpoint.validated_metrics["accuracy"] <= 1.0
        assert checkpoint.validated_metrics["assigned_gpus"] == 1

    # Two A10G nodes were free, yet the pool's cap of 1 kept the attempts apart.
    spans = windows(jobs)
    assert all(start and end and start < end for start, end in spans)
    for (_, previous_end), (next_start, _) in zip(spans, spans[1:], strict=False):
        assert next_start >= previous_end, spans
    assert summary["max_concurrent_validations"] == 1

    figure(
        f"heterogeneous: {len(summary['ray_nodes'])} nodes (head, 2 A100, 2 A10G); training "
        f"on {len(set(summary['worker_node_ids']))} A100 node(s); {epochs} validations on "
        f"{len({a.node_id for a in attempts})} A10G node(s), at most "
        f"{summary['max_concurrent_validations']} at once; timings {summary['timings']}, "
        f"wall {summary['wall_s']}s"
    )


def test_an_autoscaling_cluster_scales_from_zero_refuses_what_no_node_type_offers_and_waits(
    cluster_program, postgres_server_url
):
    """One fake autoscaling cluster, three things an operator meets: A10G validations scale
    the a10g group from 0 to its cap and back (with a replica killed mid-validation); an
    H100 and an "A10g" request in the same run fail by name within a minute while the
    run's other validations go on; after the operator adds an h100 node type, `ckval
    retry` runs the H100 job, which waits for the node the autoscaler adds longer than
    its timeout_s would have allowed had waiting counted."""
    count, timeout_s = 4, 6.0
    # Two service replicas on PostgreSQL; the one holding a validation's lease is killed.
    Registry(postgres_server_url, upgrade=True).close()
    summary = cluster_program.run(
        "autoscaling.py",
        "--checkpoints",
        str(count),
        "--hold-s",
        "2",
        "--idle-timeout-min",
        "0.1",
        "--scale-down-timeout-s",
        "90",
        "--timeout-s",
        str(timeout_s),
        "--replicas",
        "2",
        "--database-url",
        postgres_server_url,
    )
    registry = Registry(postgres_server_url)
    by_index = {job.report_index: job for job in registry.validations(summary["run"])}
    digits = [by_index[index] for index in range(count)]
    check_the_a10g_group_scaled_from_zero_and_back(summary, registry, digits)
    check_requests_no_node_type_offers_failed_by_name(summary, count)
    # Ray's v1 autoscaler runs (ckval tells it from a cluster of fixed nodes), and the
    # service read the node types from CKVAL_NODE_TYPES, the autoscaler's own config.
    assert summary["autoscaler_kind"] == "v1"
    cluster = summary["service_cluster"]
    assert cluster["autoscaler"] is True
    assert cluster["node_types_from"].endswith("node_types.json")
    h100 = by_index[count]
    check_the_retried_job_waited_for_its_node_past_its_timeout(summary, h100, timeout_s)
    assert by_index[count + 1].status == "FAILED"  # the typo was not fixed

    # What the run's validations held, by pool: every digits validation held its A10G.
    [spent] = [s.cost for s in registry.run_summaries() if s.run.name == summary["run"]]
    by_pool = spent.by("pool")
    assert set(by_pool) == {"A10G", "H100"} and by_pool["A10G"] >= count * 2
    assert spent.by("accelerator_type") == {"A10G": by_pool["A10G"], "H100": by_pool["H100"]}

    changes = summary["a10g_node_count_changes"]
    figure(
        f"autoscaling: A10G nodes over time (s, count) {changes}; H100 nodes "
        f"{summary['h100_node_count_changes']}; {count} validations on "
        f"{len(set(summary['a10g_nodes_seen']))} added node(s); refused in "
        f"{[r['seconds_to_fail'] for r in summary['refused'].values()]} s; H100 retry "
        f"waited {waited_s(h100.attempt_history[-1]):.1f}s (timeout_s {timeout_s}); "
        f"{spent.accelerator_s:.1f} accelerator-seconds {by_pool}; all gone "
        f"{summary['timings'].get('scale_down_wait_s')}s after the validations were done; "
        f"timings {summary['timings']}, wall {summary['wall_s']}s"
    )


def waited_s(attempt) -> float:
    return (attempt.started_at - attempt.claimed_at).total_seconds()


def check_the_a10g_group_scaled_from_zero_and_back(summary, registry, jobs) -> None:
    changes = summary["a10g_node_count_changes"]
    assert summary["a10g_nodes_at_start"] == 0 and changes[0][1] == 0
    assert 1 <= summary["a10g_nodes_peak"] <= 2
    assert summary["service_pools"] == {"A10G": 2}
    seen = set(summary["a10g_nodes_seen"])
    assert 1 <= len(seen) <= 2
    assert [j.status for j in jobs] == ["SUCCEEDED"] * len(jobs)
    for job in jobs:
        assert [a.status for a in job.attempt_history].count("SUCCEEDED") == 1
    killed = summary["replica_killed"]
    [taken_over] = [j for j in jobs if j.id == killed["job_id"]]
    assert taken_over.attempt_history[0].lease_owner.startswith(killed["name"] + "/")
    assert len(taken_over.attempt_history) >= 2
    # Ray restarted the killed replica: both answer, the killed one from a new process.
    assert [r["alive"] for r in summary["replicas_after"]] == [True, True]
    [again] = [r for r in summary["replicas_after"] if r["name"] == killed["name"]]
    assert again["pid"] != killed["pid"]
    attempts = [a for job in jobs for a in job.attempt_history if a.status == "SUCCEEDED"]
    # Each ran on a node the autoscaler added for it: none existed when it was reported.
    assert attempts and {a.node_id for a in attempts} <= seen, [a.node_id for a in attempts]
    # And held that node's A10G for as long as it ran.
    for attempt in attempts:
        assert (attempt.accelerator_type, attempt.accelerators) == ("A10G", 1.0)
        assert attempt.running_s >= 2 and attempt.accelerator_s == attempt.running_s
    assert all(
        j.resources == {"num_cpus": 1, "num_gpus": 1, "accelerator_type": "A10G"} for j in jobs
    )
    by_index = {c.report_index: c for c in registry.checkpoints(summary["run"])}
    for job in jobs:
        checkpoint = by_index[job.report_index]
        assert checkpoint.validation_status == "VALIDATED"
        assert checkpoint.validated_metrics["assigned_gpus"] == 1
        assert 0.5 < checkpoint.validated_metrics["accuracy"] <= 1.0
    # With idle_timeout_minutes=0.1 the idle worker nodes were removed again.
    assert summary["a10g_nodes_after_idle"] == summary["h100_nodes_after_idle"] == 0
    assert changes[-1][1] == 0 and max(c for _, c in changes) == summary["a10g_nodes_peak"]


def check_requests_no_node_type_offers_failed_by_name(summary, count: int) -> None:
    named = {
        count: "none offers 'accelerator_type:H100'",
        count + 1: "none offers 'accelerator_type:A10g' (did you mean 'accelerator_type:A10G'?)",
    }
    for index, words in named.items():
        refused = summary["refused"][str(index)]
        message = refused["error_message"]
        assert (refused["status"], refused["error_type"]) == ("FAILED", "InfeasibleResources")
        assert words in message, message
        assert "no node type its autoscaler can add" in message, message
        assert "The cluster offers accelerator types A10G;" in message, message
        assert "node type a10g, up to 2: CPU 2, GPU 1, accelerator_type:A10G" in message
        assert f"ckval retry {refused['job_id']}" in message
        assert refused["seconds_to_fail"] < 60


def check_the_retried_job_waited_for_its_node_past_its_timeout(summary, job, timeout_s) -> None:
    assert job.status == "SUCCEEDED", (job.error_type, job.error_message)
    first, second = job.attempt_history
    assert first.status == "FAILED" and first.node_id is None  # refused, never launched
    assert summary["retry_output"] == f"requeued 1 job(s): [{job.id}]"
    # It waited for the node the autoscaler added, visibly, for longer than its timeout_s
    # would have allowed had waiting counted; then it ran, well within it.
    assert "WAITING_FOR_RESOURCES" in summary["job_statuses_seen"][str(job.id)]
    assert waited_s(second) > timeout_s, waited_s(second)
    assert second.running_s < timeout_s
    assert second.node_id in summary["h100_nodes_seen"]
    assert (second.accelerator_type, second.accelerators) == ("H100", 1.0)
    assert summary["h100_node_count_changes"][-1][1] == 0


def test_a_replicas_node_is_lost_and_every_validation_still_ends_once(
    cluster_program, postgres_server_url
):
    Registry(postgres_server_url, upgrade=True).close()
    reports = 6
    summary = cluster_program.run(
        "replica_nodes.py",
        "--database-url",
        postgres_server_url,
        "--reports",
        str(reports),
        "--hold-s",
        "1.5",
    )
    before, after = summary["replica_nodes_before"], summary["replica_nodes_after"]
    first, second = sorted(before)
    # The replicas ran on different nodes: the first on the head, the second on a worker.
    assert before[first] == summary["head_node"]
    assert before[second] in summary["worker_nodes"]
    assert summary["node_removed"] == before[second]
    assert after[second] != before[second]

    registry = Registry(postgres_server_url)
    jobs = registry.validations(summary["run"])
    assert [j.status for j in jobs] == ["SUCCEEDED"] * reports
    for job in jobs:
        assert [a.status for a in job.attempt_history].count("SUCCEEDED") == 1
    for checkpoint in registry.checkpoints(summary["run"]):
        assert checkpoint.validated_metrics["index"] == checkpoint.report_index
        assert checkpoint.validated_metrics["node"] != summary["node_removed"]
    figure(
        f"replica nodes: second replica's node removed with validations in flight; "
        f"{reports}/{reports} validated once, "
        f"{sum(len(j.attempt_history) for j in jobs) - reports} attempt(s) run again; "
        f"timings {summary['timings']}, wall {summary['wall_s']}s"
    )


def test_on_a_fresh_ray_a_stop_decision_reaches_every_rank_within_a_second_or_two(
    cluster_program,
):
    """The README's early-stopping pattern as the first thing on a fresh Ray, with Ray
    Train's own health-check interval: every rank stops at the same epoch, soon after the
    service records the decision (the validated accuracy stops improving after epoch 3)."""
    summary = cluster_program.run("fresh_early_stop.py")
    decided_at = summary["decided_at"]
    assert decided_at is not None, "no stop decision was recorded"
    assert summary["decided_report"] == 5  # patience 2 after the plateau of epoch 3
    ranks = summary["ranks"]
    stopped_at = {rank: epochs[-1]["epoch"] for rank, epochs in ranks.items()}
    assert all(epochs[-1]["stop"] for epochs in ranks.values()), stopped_at
    assert len(set(stopped_at.values())) == 1, stopped_at  # the same step on every rank
    for rank, epochs in ranks.items():
        late = [e["epoch"] for e in epochs if not e["stop"] and e["asked"] > decided_at + 1.5]
        assert late == [], f"rank {rank} was told to go on more than 1.5 s after the decision"
    figure(
        f"fresh Ray, early stop: decided after report 5, every rank stopped after epoch "
        f"{stopped_at['0']} (of 24); wall {summary['wall_s']}s"
    )


def test_ranks_on_two_nodes_with_two_registries_fail_the_first_report_naming_both(
    cluster_program,
):
    summary = cluster_program.run("split_registry.py")
    error = summary["error"]
    # Ray Train keeps the head and the tail of each rank's error: the tail says that the
    # ranks report into another registry and what to do. The ranks' whole messages (their
    # logs, on the driver's standard error) name both registries.
    assert error is not None and "another registry although the address may read" in error, error
    assert "give every node the same CKVAL_DATABASE_URL" in error
    logs = cluster_program.stderr_path.read_text(errors="replace")
    messages = [line for line in logs.splitlines() if "report into different registries" in line]
    assert messages, logs[-6000:]
    assert all(summary["home"] in m and summary["other_home"] in m for m in messages), messages
    # No checkpoint was split across them: neither registry holds one.
    assert all(count in (0, None) for count in summary["checkpoints"].values())
