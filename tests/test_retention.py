"""Retention on SQLite and PostgreSQL: what is kept (best, best per run, latest, aliased,
validations in flight), files gone from local storage and S3 (moto), rows marked, dry
runs, stored policies applied as validations finish, and the gc command and route."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.registry_world import (
    clear_policies,
    cli_group,
    finish_validations,
    report,
    stored_policies,
)
from tests.test_s3 import BUCKET, options_for, s3_endpoint  # noqa: F401 - the moto fixture
from validation_service.api.registry import registry_router
from validation_service.config import Settings
from validation_service.errors import InvalidInput, UnknownMetric
from validation_service.jobs import ValidationStatus
from validation_service.registry.registry import Registry
from validation_service.storage import CheckpointStorage


@pytest.fixture
def storage(tmp_path, monkeypatch) -> CheckpointStorage:
    """The test's storage, which is also the operator's (CKVAL_STORAGE): retention deletes
    files only under the roots its settings name."""
    monkeypatch.setenv("CKVAL_STORAGE", str(tmp_path / "storage"))
    return CheckpointStorage(str(tmp_path / "storage"))


@pytest.fixture
def clean_registry(storage, registry):
    """The registry fixture without stored retention policies (PostgreSQL's database
    lives for the session)."""
    clear_policies(registry)
    yield registry
    clear_policies(registry)


def _one_run_in_flight(registry: Registry, storage: CheckpointStorage, workdir) -> list[str]:
    """Run "r": accuracy by report index 0:.5 1:.9 2:.2 3:.8 4:.1 5:.3 6:.4; the validation
    of 2 is RUNNING, that of 3 QUEUED; 5 has an alias; 6 is the latest."""
    uris = report(registry, storage, "r", [{"accuracy": 0.5}, {"accuracy": 0.9}], workdir=workdir)
    uris += report(registry, storage, "r", [{"accuracy": 0.2}], validate=True, workdir=workdir)
    finish_validations(registry, {})  # claims the job of 2 and leaves it RUNNING
    uris += report(registry, storage, "r", [{"accuracy": 0.8}], validate=True, workdir=workdir)
    uris += report(
        registry,
        storage,
        "r",
        [{"accuracy": 0.1}, {"accuracy": 0.3}, {"accuracy": 0.4}],
        workdir=workdir,
    )
    registry.set_alias("r", "production", 5)
    statuses = [r.validation_status for r in registry.checkpoints("r")]
    assert statuses[2:4] == [ValidationStatus.RUNNING.value, ValidationStatus.PENDING.value]
    return uris


def test_retention_keeps_best_latest_aliased_and_in_flight(clean_registry, storage, tmp_path):
    registry = clean_registry
    uris = _one_run_in_flight(registry, storage, tmp_path)
    deleted = registry.apply_retention("r", metric="accuracy", keep_best_per_run=1, keep_latest=1)
    assert sorted(r.report_index for r in deleted) == [0, 4]
    assert all(r.deleted_at is not None for r in deleted)
    for index, uri in enumerate(uris):
        assert storage.fs.exists(storage.path_of(uri)) == (index not in (0, 4))
    rows = {r.report_index: r for r in registry.checkpoints("r", include_deleted=True)}
    assert [i for i, r in rows.items() if r.deleted_at is not None] == [0, 4]
    assert rows[0].metrics == {"accuracy": 0.5}  # the metrics stay queryable
    assert [r.report_index for r in registry.checkpoints("r")] == [1, 2, 3, 5, 6]
    best = registry.best_checkpoint_records("r", "accuracy", "max", 10)
    assert [r.report_index for r in best] == [1, 3, 6, 5, 2]
    assert registry.latest_checkpoint("r").path == storage.path_of(uris[6])
    # Nothing more goes while nothing changed.
    assert registry.apply_retention("r", metric="accuracy") == []


def test_a_dry_run_deletes_nothing(clean_registry, storage, tmp_path):
    registry = clean_registry
    uris = _one_run_in_flight(registry, storage, tmp_path)
    would = registry.apply_retention("r", metric="accuracy", keep_latest=2, dry_run=True)
    assert sorted(r.report_index for r in would) == [0, 4]
    assert all(r.deleted_at is None for r in would)
    assert all(storage.fs.exists(storage.path_of(uri)) for uri in uris)
    assert len(registry.checkpoints("r")) == 7
    deleted = registry.apply_retention("r", metric="accuracy", keep_latest=2)
    assert [r.id for r in deleted] == [r.id for r in would]


def test_namespace_retention_across_runs_and_attempts(clean_registry, storage, tmp_path):
    registry = clean_registry
    report(registry, storage, "a", [{"accuracy": a} for a in (0.9, 0.1, 0.5)], workdir=tmp_path)
    report(registry, storage, "b", [{"accuracy": a} for a in (0.8, 0.95, 0.2)], workdir=tmp_path)
    registry.ledger.finish_run("a", "FINISHED")
    report(registry, storage, "a", [{"accuracy": a} for a in (0.3, 0.2)], workdir=tmp_path)
    assert [(r.name, r.attempt) for r in registry.runs()] == [("a", 1), ("b", 1), ("a", 2)]
    deleted = registry.apply_retention(
        None, metric="accuracy", keep_best=2, keep_best_per_run=0, keep_latest=1
    )
    # Kept: the best two across the namespace (b/1, a#1/0) and each attempt's latest.
    assert sorted((r.run, r.metrics["accuracy"]) for r in deleted) == [
        ("a", 0.1),
        ("a", 0.3),
        ("b", 0.8),
    ]
    assert [r.report_index for r in registry.checkpoints("a", attempt=1)] == [0, 2]
    assert [r.report_index for r in registry.checkpoints("a")] == [1]


def test_retention_deletes_files_on_s3(clean_registry, s3_endpoint, tmp_path):  # noqa: F811
    root = f"s3://{BUCKET}/retention-{tmp_path.name}"
    settings = Settings(storage=root, storage_options=options_for(s3_endpoint))
    registry = Registry(clean_registry.url, settings=settings)
    storage = CheckpointStorage(root, settings.storage_options)
    uris = report(
        registry, storage, "s3run", [{"loss": x} for x in (0.3, 0.1, 0.2)], workdir=tmp_path
    )
    # An operator whose storage is another prefix of the bucket deletes nothing there.
    elsewhere = settings.model_copy(update={"storage": f"{root}-other"})
    other = Registry(clean_registry.url, settings=elsewhere)
    assert other.apply_retention("s3run", metric="loss", mode="min") == []
    other.close()
    assert [storage.fs.exists(storage.path_of(uri)) for uri in uris] == [True, True, True]
    deleted = registry.apply_retention("s3run", metric="loss", mode="min")
    assert [r.report_index for r in deleted] == [0]
    storage.fs.invalidate_cache()
    assert [storage.fs.exists(storage.path_of(uri)) for uri in uris] == [False, True, True]
    assert registry.checkpoints("s3run", include_deleted=True)[0].deleted_at is not None
    registry.close()


def test_a_stored_policy_applies_as_validations_finish(clean_registry, storage, tmp_path):
    registry = clean_registry
    registry.set_retention("hooked", metric="accuracy", keep_best_per_run=1, keep_latest=1)
    uris = report(
        registry,
        storage,
        "hooked",
        [{"step": i} for i in range(4)],
        validate=True,
        workdir=tmp_path,
    )
    finish_validations(
        registry,
        {0: {"accuracy": 0.5}, 1: {"accuracy": 0.7}, 2: {"accuracy": 0.6}, 3: {"accuracy": 0.4}},
    )
    assert [r.report_index for r in registry.checkpoints("hooked")] == [1, 3]
    assert [storage.fs.exists(storage.path_of(uri)) for uri in uris] == [False, True, False, True]
    assert stored_policies(registry)["hooked"].keep_latest == 1


def test_a_namespace_policy_leaves_runs_with_their_own_policy(clean_registry, storage, tmp_path):
    registry = clean_registry
    registry.set_retention(None, metric="accuracy", keep_best=1, keep_best_per_run=0, keep_latest=1)
    registry.set_retention("own", metric="accuracy", keep_best_per_run=5, keep_latest=1)
    report(registry, storage, "own", [{"accuracy": a} for a in (0.1, 0.2, 0.3)], workdir=tmp_path)
    report(
        registry, storage, "other", [{"step": i} for i in range(3)], validate=True, workdir=tmp_path
    )
    finish_validations(registry, {0: {"accuracy": 0.9}, 1: {"accuracy": 0.2}, 2: {"accuracy": 0.5}})
    assert [r.report_index for r in registry.checkpoints("other")] == [0, 2]
    assert [r.report_index for r in registry.checkpoints("own")] == [0, 1, 2]


def test_an_unknown_metric_deletes_nothing(clean_registry, storage, tmp_path):
    registry = clean_registry
    uris = report(registry, storage, "typo", [{"accuracy": 0.1}] * 3, workdir=tmp_path)
    with pytest.raises(UnknownMetric, match="'acuracy'.*accuracy"):
        registry.apply_retention("typo", metric="acuracy")
    assert len(registry.checkpoints("typo")) == 3
    assert all(storage.fs.exists(storage.path_of(uri)) for uri in uris)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"keep_best": -1}, "keep_best must be an int >= 0"),
        ({"keep_latest": 1.5}, "keep_latest must be an int >= 0"),
        ({"mode": "best"}, "mode must be 'max' or 'min'"),
    ],
)
def test_bad_retention_arguments_are_refused(clean_registry, storage, tmp_path, bad, message):
    registry = clean_registry
    report(registry, storage, "args", [{"accuracy": 0.1}] * 3, workdir=tmp_path)
    with pytest.raises(InvalidInput, match=message):
        registry.apply_retention("args", metric="accuracy", **bad)
    with pytest.raises(InvalidInput, match=message):
        registry.set_retention("args", metric="accuracy", **bad)
    assert len(registry.checkpoints("args")) == 3
    assert stored_policies(registry) == {}


def test_gc_command_shows_asks_and_deletes(clean_registry, storage, tmp_path):
    registry = clean_registry
    report(
        registry, storage, "gc", [{"accuracy": a} for a in (0.2, 0.9, 0.1, 0.3)], workdir=tmp_path
    )
    runner = CliRunner()
    args = ["--database-url", registry.url, "gc", "gc", "--metric", "accuracy"]
    result = runner.invoke(cli_group(), [*args, "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "2 checkpoint(s) would be deleted (dry run)" in result.output
    result = runner.invoke(cli_group(), args, input="n\n")
    assert "Delete these 2 checkpoint(s)" in result.output and "nothing deleted" in result.output
    assert len(registry.checkpoints("gc")) == 4
    result = runner.invoke(cli_group(), [*args, "--yes"])
    assert result.exit_code == 0, result.output
    assert "deleted 2 checkpoint(s)" in result.output
    assert [r.report_index for r in registry.checkpoints("gc")] == [1, 3]
    result = runner.invoke(cli_group(), [*args[:-1], "nope", "--dry-run"])
    assert (
        result.exit_code == 2
        and "No checkpoint of run 'gc' has a metric named 'nope'" in result.output
    )


def test_retention_route_is_a_dry_run(clean_registry, storage, tmp_path):
    registry = clean_registry
    report(registry, storage, "api", [{"accuracy": a} for a in (0.2, 0.9, 0.1)], workdir=tmp_path)
    app = FastAPI()
    app.include_router(registry_router(registry, registry.settings))
    client = TestClient(app)
    response = client.get("/retention", params={"run": "api", "metric": "accuracy"})
    assert response.status_code == 200, response.text
    assert [r["report_index"] for r in response.json()] == [0]
    assert len(registry.checkpoints("api")) == 3
    response = client.get("/retention", params={"metric": "accuracy", "keep_latest": -1})
    assert response.status_code == 422 and "keep_latest" in response.json()["detail"]
