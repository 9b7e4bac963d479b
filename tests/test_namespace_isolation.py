"""No reporter touches another namespace's or run's files: a NO_UPLOAD checkpoint lies in
its own run's folder or outside the storage root, and retention (and `ckval gc`) deletes
only inside a checkpoint's own run folder, never a folder another record uses. On SQLite
and PostgreSQL, through the real Client and the real storage."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from ray.train import Checkpoint

from trainer_integration import CheckpointUploadMode, Client
from validation_service.cli import main as ckval
from validation_service.config import Settings
from validation_service.errors import InvalidInput
from validation_service.registry.registry import Registry
from validation_service.storage import MANIFEST_NAME, CheckpointStorage

NO_UPLOAD = CheckpointUploadMode.NO_UPLOAD


@pytest.fixture
def world(registry: Registry, tmp_path: Path):
    """Teams A and B on one database and one storage root; team B's run has a
    checkpoint behind its alias "production"."""
    root = tmp_path / "storage"
    # Names of this test alone: a process keeps one reporter per run name.
    bert, run_a = f"bert-{uuid.uuid4().hex[:6]}", f"runa-{uuid.uuid4().hex[:6]}"

    def settings(namespace: str) -> Settings:
        return Settings(
            database_url=registry.url,
            storage=str(root),
            home=tmp_path / "home",
            namespace=namespace,
        )

    team_b = Client(bert, settings("teamb"), start_service=False)
    index = team_b.report({"accuracy": 0.99}, folder(tmp_path / "b-model", "weights of B"))
    team_b.registry.set_alias(bert, "production", index)
    [production] = team_b.registry.checkpoints(bert)
    yield settings, root, production, run_a


def folder(path: Path, content: str) -> Checkpoint:
    path.mkdir(parents=True)
    (path / "model.txt").write_text(content)
    return Checkpoint.from_directory(str(path))


def everything(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


def test_no_upload_of_another_namespace_or_run_is_refused_before_anything_is_written(world):
    settings, root, production, run_a = world
    team_b_files = everything(root / "teamb")
    client = Client(run_a, settings("teama"), start_service=False)
    (root / "teama" / "other-run" / "x").mkdir(parents=True)
    for target in (root / "teamb", Path(production.uri).parent, root / "teama" / "other-run" / "x"):
        with pytest.raises(InvalidInput, match=f"not inside the folder of run '{run_a}'"):
            client.report(
                {"accuracy": 0.1},
                Checkpoint.from_directory(str(target)),
                checkpoint_upload_mode=NO_UPLOAD,
            )
    assert everything(root / "teamb") == team_b_files  # no manifest written there either
    assert not (root / "teama" / "other-run" / "x" / MANIFEST_NAME).exists()
    assert client.registry.checkpoints(run_a) == []
    CheckpointStorage(str(root)).verify(production.uri, production.manifest_sha256)


def test_retention_never_deletes_another_namespaces_folder_that_a_record_names(world):
    """A record that an older ckval let team A adopt (team B's whole folder): team A's
    retention marks it deleted but leaves team B's files, production included."""
    settings, root, production, run_a = world
    team_a = Registry(settings=settings("teama"))
    run_id = team_a.ledger.ensure_run(run_a, storage_root=str(root))
    for index, (uri, accuracy) in enumerate([(str(root / "teamb"), 0.1), (None, 0.9)]):
        uri = uri or str(root / "teama" / run_a / f"checkpoint_{index:06d}")
        team_a.ledger.register_checkpoint(
            run_id,
            index,
            uri=uri,
            size_bytes=1,
            manifest_sha256=None,
            reported_metrics={"accuracy": accuracy},
        )
    deleted = team_a.apply_retention(run_a, metric="accuracy", keep_best_per_run=1, keep_latest=1)

    assert [r.uri for r in deleted] == [str(root / "teamb")]
    assert os.path.isdir(Path(production.uri).parent)
    CheckpointStorage(str(root)).verify(production.uri, production.manifest_sha256)
    team_b = Registry(settings=settings("teamb"))
    assert team_b.get_alias(production.run, "production")[0].path == production.uri


def test_gc_keeps_a_folder_that_another_checkpoint_record_lies_in(world, tmp_path):
    settings, root, _, run_a = world
    client = Client(run_a, settings("teama"), start_service=False)
    outer = root / "teama" / run_a / "shards"
    inner = outer / "rank-0"
    for path, accuracy in ((inner, 0.9), (outer, 0.1)):
        path.mkdir(parents=True, exist_ok=True)
        (path / f"part-{accuracy}.bin").write_text(str(accuracy))
        client.report(
            {"accuracy": accuracy},
            Checkpoint.from_directory(str(path)),
            checkpoint_upload_mode=NO_UPLOAD,
        )
    client.report({"accuracy": 0.5}, folder(tmp_path / "latest", "newest"))
    result = CliRunner().invoke(
        ckval,
        [
            "--database-url",
            settings("teama").database_url,
            "--namespace",
            "teama",
            "gc",
            run_a,
            "--metric",
            "accuracy",
            "--yes",
        ],
        env={"CKVAL_STORAGE": str(root)},
    )

    assert result.exit_code == 0, result.output
    assert "deleted 1 checkpoint(s)" in result.output
    assert [r.uri for r in client.registry.checkpoints(run_a)] == [
        str(inner),
        client.registry.checkpoints(run_a)[-1].uri,
    ]
    kept = client.registry.checkpoints(run_a)[0]
    CheckpointStorage(str(root)).verify(kept.uri, kept.manifest_sha256)


def test_no_upload_outside_the_storage_root_is_registered_in_place_and_never_deleted(
    world, tmp_path
):
    settings, root, _, run_a = world
    client = Client(run_a, settings("teama"), start_service=False)
    outside = tmp_path / "scratch" / "sharded"
    client.report(
        {"accuracy": 0.1},
        folder(outside, json.dumps({"rank": 0})),
        checkpoint_upload_mode=NO_UPLOAD,
    )
    client.report({"accuracy": 0.5}, folder(tmp_path / "newer", "newer"))
    [in_place, _] = client.registry.checkpoints(run_a)
    assert in_place.uri == str(outside)
    CheckpointStorage(str(root)).verify(in_place.uri, in_place.manifest_sha256)

    plan = client.registry.retention_plan(run_a, metric="accuracy", keep_latest=1)
    deleted = client.registry.apply_retention(run_a, metric="accuracy", keep_latest=1)

    # Outside the storage the settings name: kept whole, its row included.
    assert deleted == [] and [r.uri for r in plan.kept_outside] == [str(outside)]
    assert client.registry.checkpoints(run_a)[0].deleted_at is None
    assert everything(outside)["model.txt"] == json.dumps({"rank": 0})
    assert (outside / MANIFEST_NAME).is_file()
