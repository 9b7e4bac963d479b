"""Builds registries with real stored checkpoints for the alias, tag, retention and search
tests: files copied by CheckpointStorage, rows written by Registry, validations finished
as a scheduler finishes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from sqlalchemy import delete

from validation_service.cli.registry import COMMANDS
from validation_service.registry import retention
from validation_service.registry.models import RetentionPolicy, utcnow
from validation_service.registry.records import JobOutcome
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest
from validation_service.storage import CheckpointStorage

VALIDATION = ValidationRequest(
    executor_kind="ray_task", pool="CPU", validate_fn_name="f", validate_fn_ref="json:dumps"
)


def report(
    registry: Registry,
    storage: CheckpointStorage,
    run: str,
    reported: list[dict[str, Any]],
    *,
    validate: bool = False,
    workdir: Path,
) -> list[str]:
    """Uploads one small checkpoint folder per metrics dict into the run's folder (as
    report() does: each attempt has its own) and registers it; returns the URIs."""
    run_id = registry.ledger.ensure_run(run, storage_root=storage.root_uri)
    attempt = registry.run_attempts(run)[-1].attempt
    first = registry.ledger.next_report_index(run_id)
    uris = []
    for offset, metrics in enumerate(reported):
        index = first + offset
        source = workdir / f"src-{run}-{run_id}-{index}"
        source.mkdir(parents=True)
        (source / "model.txt").write_text(f"{run} {index}")
        persisted = storage.upload(source, registry.namespace, run, index, attempt=attempt)
        registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=persisted.uri,
            size_bytes=persisted.size_bytes,
            manifest_sha256=persisted.manifest_sha256,
            reported_metrics=metrics,
            step=metrics.get("step"),
            job=VALIDATION if validate else None,
        )
        uris.append(persisted.uri)
    return uris


def finish_validations(registry: Registry, results: dict[int, dict[str, Any]]) -> dict[int, int]:
    """Claims the due jobs as a scheduler does; the job of report index i (any run)
    succeeds with results[i]. Returns report index -> job id of those finished."""
    claimed = registry.job_queue.claim_due_jobs("test-owner", {"CPU": 1000}, lease_s=60)
    finished = {}
    for job in claimed:
        if job.report_index in results:
            outcome = JobOutcome(succeeded=True, metrics=results[job.report_index])
            assert registry.job_queue.finish_job(job.job_id, job.lease_token, outcome)
            finished[job.report_index] = job.job_id
    return finished


def delete_checkpoint(registry: Registry, checkpoint_id: int) -> None:
    """Marks one checkpoint deleted as retention does (its files stay): it must be one
    that retention may delete, with no validation in flight and no alias."""
    with registry.db.write() as conn:
        assert retention.mark_deleted(conn, [checkpoint_id], utcnow()) == {checkpoint_id}


def stored_policies(registry: Registry) -> dict[str | None, retention.RetentionRule]:
    """Run name (None: the namespace's own) -> the retention policy stored for it."""
    with registry.db.read() as session:
        return retention.policies(session, registry.namespace)


def clear_policies(registry: Registry) -> None:
    """Removes the namespace's stored retention policies (PostgreSQL's test database
    lives for the session)."""
    with registry.db.write() as conn:
        conn.execute(delete(RetentionPolicy).where(RetentionPolicy.namespace == registry.namespace))


def cli_group() -> click.Group:
    """A `ckval`-like group with the registry commands, as cli.main registers them."""

    @click.group()
    @click.option("--database-url")
    @click.pass_context
    def group(ctx: click.Context, database_url: str | None) -> None:
        ctx.ensure_object(dict).update(database_url=database_url, namespace=None)

    for command in COMMANDS:
        group.add_command(command)
    return group
