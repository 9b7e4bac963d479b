"""gc, retention and the service delete files only under the storage roots their own
settings name (CKVAL_STORAGE and CKVAL_DELETABLE_ROOTS): a run whose reporter chose
another storage root keeps its files, reported as "outside the configured storage: kept".

Real SQLite and PostgreSQL registries, real files copied by CheckpointStorage.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.registry_world import clear_policies, cli_group, finish_validations, report
from validation_service.config import Settings
from validation_service.registry.registry import Registry
from validation_service.storage import CheckpointStorage

RUN = "theirs"
KEPT = "outside the configured storage: kept"


@pytest.fixture
def world(registry, tmp_path):
    """(url, operator's storage, reporter's storage, the reporter's URIs): run "theirs"
    has 3 checkpoints under a storage root its reporter chose, not the operator's."""
    clear_policies(registry)
    reporter = CheckpointStorage(str(tmp_path / "reporter-storage"))
    uris = report(
        registry, reporter, RUN, [{"accuracy": a} for a in (0.9, 0.2, 0.5)], workdir=tmp_path
    )
    url = registry.engine.url.render_as_string(hide_password=False)
    yield url, tmp_path / "operator-storage", reporter, uris
    clear_policies(registry)


def operator(url: str, storage: Path, **settings) -> Registry:
    return Registry(url, settings=Settings(storage=str(storage), **settings))


def files_left(uris: list[str]) -> list[bool]:
    return [Path(uri).exists() for uri in uris]


def test_retention_keeps_files_outside_the_configured_storage(world):
    url, storage, _reporter, uris = world
    registry = operator(url, storage)

    plan = registry.retention_plan(RUN, metric="accuracy", keep_best_per_run=1, keep_latest=1)
    deleted = registry.apply_retention(RUN, metric="accuracy", keep_best_per_run=1, keep_latest=1)

    assert [r.report_index for r in plan.kept_outside] == [1]
    assert plan.deleting == [] and deleted == []
    assert files_left(uris) == [True, True, True]
    assert [r.deleted_at for r in registry.checkpoints(RUN)] == [None, None, None]
    registry.close()


def test_gc_reports_kept_checkpoints_in_the_dry_run_and_deletes_nothing(world, monkeypatch):
    url, storage, _reporter, uris = world
    monkeypatch.setenv("CKVAL_STORAGE", str(storage))
    args = ["--database-url", url, "gc", RUN, "--metric", "accuracy"]

    dry = CliRunner().invoke(cli_group(), [*args, "--dry-run"])
    real = CliRunner().invoke(cli_group(), [*args, "--yes"])

    for result in (dry, real):
        assert result.exit_code == 0, result.output
        assert f"{RUN}/1" in result.output and KEPT in result.output, result.output
    assert "would be deleted" not in dry.output
    assert files_left(uris) == [True, True, True]


def test_the_services_stored_policy_keeps_files_outside_its_storage(world):
    url, storage, reporter, uris = world
    registry = operator(url, storage)
    uris += report(registry, reporter, RUN, [{"accuracy": 0.1}], validate=True, workdir=storage)
    registry.set_retention(RUN, metric="accuracy", keep_best_per_run=1, keep_latest=1)

    assert finish_validations(registry, {3: {"accuracy": 0.1}})

    assert files_left(uris) == [True, True, True, True]
    assert [r.deleted_at for r in registry.checkpoints(RUN)] == [None] * 4
    registry.close()


def test_a_root_in_ckval_deletable_roots_is_deleted_from(world, monkeypatch):
    url, storage, reporter, uris = world
    monkeypatch.setenv("CKVAL_DELETABLE_ROOTS", f'["{reporter.root_uri}"]')
    registry = Registry(url, settings=Settings(storage=str(storage)))

    deleted = registry.apply_retention(RUN, metric="accuracy", keep_best_per_run=1, keep_latest=1)

    assert [r.report_index for r in deleted] == [1]
    assert files_left(uris) == [True, False, True]
    registry.close()
