"""`ckval job`, `cancel` and `retry` keep to their namespace as the HTTP API does, and
`ckval cancel` cancels in the registry at once when no Ray cluster answers.

Real SQLite and PostgreSQL registries; the CLI in this process, and as a subprocess
where the time it takes is the point."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from validation_service.cli import main
from validation_service.registry.records import JobOutcome
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest

ROOT = Path(__file__).resolve().parents[1]
REQUEST = ValidationRequest(
    executor_kind="ray_task", pool="CPU", validate_fn_name="v", validate_fn_ref="json:dumps"
)


def queued_job(url: str, namespace: str, run: str = "r") -> int:
    registry = Registry(url, namespace=namespace)
    run_id = registry.ledger.ensure_run(run, storage_root="/nowhere")
    index = registry.ledger.next_report_index(run_id)
    job_id = registry.ledger.register_checkpoint(
        run_id,
        index,
        uri=f"/nowhere/{namespace}/{run}/{index}",
        size_bytes=1,
        manifest_sha256=None,
        reported_metrics={"loss": 1.0},
        job=REQUEST,
    ).job_id
    registry.close()
    return job_id


def failed_job(registry: Registry, url: str, namespace: str) -> int:
    job_id = queued_job(url, namespace)
    [claimed] = registry.job_queue.claim_due_jobs("test", {"CPU": 1}, lease_s=60)
    failure = JobOutcome(succeeded=False, error_type="E", error_message="m", retryable=False)
    assert registry.job_queue.finish_job(claimed.job_id, claimed.lease_token, failure)
    return job_id


def url_of(registry: Registry) -> str:
    return registry.engine.url.render_as_string(hide_password=False)


def ckval(url: str, *args: str):
    return CliRunner().invoke(main, ["--database-url", url, "--namespace", "default", *args])


@pytest.mark.parametrize("command", ["job", "cancel", "retry"])
def test_a_job_of_another_namespace_is_not_found_and_left_as_it_is(registry, command):
    url = url_of(registry)
    job_id = failed_job(registry, url, "other") if command == "retry" else queued_job(url, "other")
    before = registry.get_job(job_id).status

    result = ckval(url, command, str(job_id))

    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: No validation job with id {job_id}.")
    assert "other" not in result.output and "json:dumps" not in result.output
    assert registry.get_job(job_id).status == before


def test_a_job_of_its_own_namespace_is_cancelled(registry):
    url = url_of(registry)
    job_id = queued_job(url, "default")
    result = ckval(url, "cancel", str(job_id))
    assert result.exit_code == 0, result.output
    assert registry.get_job(job_id).status == "CANCELLED"


def test_cancel_with_no_cluster_at_the_ray_address_cancels_at_once_and_says_so(tmp_path):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    job_id = queued_job(url, "default")
    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    env = {**os.environ, "CKVAL_RAY_ADDRESS": address, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()

    done = subprocess.run(
        [sys.executable, "-m", "validation_service.cli", "--database-url", url, "cancel",
         str(job_id)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip

    assert time.monotonic() - started < 30
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"cancelled 1 job(s): [{job_id}]" in done.stdout
    assert "could not be told" in done.stderr and address in done.stderr, done.stderr
    registry = Registry(url)
    assert registry.get_job(job_id).status == "CANCELLED"
    registry.close()
