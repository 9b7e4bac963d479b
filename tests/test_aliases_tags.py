"""Aliases and tags of checkpoints on SQLite and PostgreSQL: moves under concurrency
(threads and processes), tracked aliases after validations, tag filters, bad input, and
the CLI and HTTP surfaces."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from tests.registry_world import cli_group, delete_checkpoint, finish_validations, report
from validation_service.api.registry import registry_router
from validation_service.errors import AliasNotFound, InvalidInput
from validation_service.registry.models import CheckpointAlias
from validation_service.registry.registry import Registry
from validation_service.storage import CheckpointStorage

RUN = "aliased"


@pytest.fixture
def storage(tmp_path) -> CheckpointStorage:
    return CheckpointStorage(str(tmp_path / "storage"))


@pytest.fixture
def world(registry, storage, tmp_path) -> Registry:
    """RUN with five checkpoints, accuracy 0.1 .. 0.5, no validations."""
    report(
        registry,
        storage,
        RUN,
        [{"accuracy": a, "step": i} for i, a in enumerate([0.1, 0.5, 0.3, 0.2, 0.4])],
        workdir=tmp_path,
    )
    return registry


def _alias_rows(registry: Registry, alias: str) -> int:
    with registry.engine.connect() as conn:
        return conn.scalar(
            select(func.count()).select_from(CheckpointAlias).where(CheckpointAlias.alias == alias)
        )


def test_an_alias_points_at_a_checkpoint_and_moves(world):
    world.set_alias(RUN, "production", 2)
    checkpoint, metrics = world.get_alias(RUN, "production")
    assert metrics["accuracy"] == 0.3
    with checkpoint.as_directory() as directory:
        assert (Path(directory) / "model.txt").read_text() == f"{RUN} 2"
    world.set_alias(RUN, "production", 4)
    assert world.get_alias_record(RUN, "production").report_index == 4
    assert world.aliases(RUN) == {"production": 4}
    assert _alias_rows(world, "production") == 1
    by_index = {r.report_index: r.aliases for r in world.checkpoints(RUN)}
    assert by_index == {0: (), 1: (), 2: (), 3: (), 4: ("production",)}
    assert world.remove_alias(RUN, "production")
    assert world.aliases(RUN) == {}


def test_concurrent_moves_from_threads_end_with_one_alias(world):
    targets = [0, 1, 2, 3, 4]
    start = threading.Barrier(len(targets))
    errors = []

    def move(index: int) -> None:
        try:
            start.wait()
            for _ in range(10):
                world.set_alias(RUN, "best", index)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=move, args=(i,)) for i in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert _alias_rows(world, "best") == 1
    assert world.aliases(RUN)["best"] in targets


def _move_in_a_process(url: str, index: int, moves: int, start) -> None:
    registry = Registry(url)
    start.wait()
    for _ in range(moves):
        registry.set_alias(RUN, "best", index)
    registry.close()


def test_concurrent_moves_from_two_processes_end_with_one_alias(world):
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    processes = [
        context.Process(target=_move_in_a_process, args=(world.url, index, 20, start))
        for index in (1, 3)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert [p.exitcode for p in processes] == [0, 0]
    assert _alias_rows(world, "best") == 1
    assert world.aliases(RUN)["best"] in (1, 3)


def test_a_tracked_alias_follows_the_best_validated_checkpoint(registry, storage, tmp_path):
    report(registry, storage, "tracked", [{"loss": 1.0}] * 3, validate=True, workdir=tmp_path)
    # No checkpoint has the metric yet: the rule is stored and applied later.
    assert registry.track_alias("tracked", "best", "accuracy", "max") is None
    finish_validations(registry, {0: {"accuracy": 0.6}, 1: {"accuracy": 0.9}})
    assert registry.aliases("tracked") == {"best": 1}
    report(registry, storage, "tracked", [{"loss": 0.5}], validate=True, workdir=tmp_path)
    finish_validations(registry, {2: {"accuracy": 0.7}, 3: {"accuracy": 0.95}})
    assert registry.aliases("tracked") == {"best": 3}
    run_id = registry.find_run_id("tracked")
    assert registry.housekeeping.refresh_tracked_aliases(run_id) == {"best": 3}


def test_tags_filter_checkpoints_and_best_checkpoints(world):
    for index, split in [(0, "val"), (1, "train"), (2, "val"), (4, "val")]:
        world.tag(RUN, index, "split", split)
    world.tag(RUN, 2, "dataset.version", "v2")
    assert [r.report_index for r in world.checkpoints(RUN, tags={"split": "val"})] == [0, 2, 4]
    assert [
        r.report_index
        for r in world.checkpoints(RUN, tags={"split": "val", "dataset.version": "v2"})
    ] == [2]
    best = world.best_checkpoint_records(RUN, "accuracy", "max", 2, tags={"split": "val"})
    assert [(r.report_index, r.tags["split"]) for r in best] == [(4, "val"), (2, "val")]
    pairs = world.best_checkpoints(RUN, "accuracy", "max", 5, tags={"split": "train"})
    assert [metrics["accuracy"] for _, metrics in pairs] == [0.5]
    # Namespace-wide best-k filters by tags too; a tag set again is replaced.
    world.tag(RUN, 4, "split", "test")
    assert [
        r.report_index
        for r in world.best_checkpoint_records(None, "accuracy", "max", 5, tags={"split": "val"})
    ] == [2, 0]
    world.tag(RUN, 2, "split", None)
    assert world.checkpoints(RUN)[2].tags == {"dataset.version": "v2"}


@pytest.mark.parametrize("alias", ["", "has space", "-leading-dash", "x" * 256, 7])
def test_a_bad_alias_name_is_refused(world, alias):
    with pytest.raises(InvalidInput, match="alias .* is not allowed"):
        world.set_alias(RUN, alias, 1)
    assert world.aliases(RUN) == {}


def test_an_alias_on_a_missing_report_index_is_refused(world):
    with pytest.raises(InvalidInput, match="no checkpoint with report index 9"):
        world.set_alias(RUN, "best", 9)
    assert world.aliases(RUN) == {}


def test_an_alias_on_a_deleted_checkpoint_is_refused(world):
    delete_checkpoint(world, world.checkpoints(RUN)[1].id)
    with pytest.raises(InvalidInput, match="was deleted"):
        world.set_alias(RUN, "best", 1)
    assert world.aliases(RUN) == {}


def test_an_unknown_alias_names_the_known_ones(world):
    world.set_alias(RUN, "production", 0)
    with pytest.raises(AliasNotFound, match="no alias 'staging'.*production"):
        world.get_alias(RUN, "staging")


def test_a_tag_value_that_is_not_a_string_is_refused(world):
    with pytest.raises(InvalidInput, match="tag values are strings"):
        world.tag(RUN, 0, "epoch", 3)
    assert world.checkpoints(RUN)[0].tags == {}


def test_a_tag_value_too_long_is_refused(world):
    with pytest.raises(InvalidInput, match="at most 1000"):
        world.tag(RUN, 0, "notes", "x" * 1001)
    assert world.checkpoints(RUN)[0].tags == {}


def test_a_bad_tag_key_is_refused(world):
    with pytest.raises(InvalidInput, match="tag key"):
        world.tag(RUN, 0, "a key", "v")
    assert world.checkpoints(RUN)[0].tags == {}


def test_a_tag_filter_that_is_not_a_dict_is_refused(world):
    with pytest.raises(InvalidInput, match="tags must be a dict"):
        world.checkpoints(RUN, tags=["split", "val"])


def test_alias_and_tag_commands(world):
    runner = CliRunner()
    group = cli_group()
    url = ["--database-url", world.url]
    result = runner.invoke(group, [*url, "alias", RUN, "production", "3"])
    assert result.exit_code == 0, result.output
    assert world.aliases(RUN) == {"production": 3}
    result = runner.invoke(
        group, [*url, "alias", RUN, "best", "--track", "--metric", "accuracy", "--mode", "max"]
    )
    assert result.exit_code == 0, result.output
    assert "now report 1" in result.output
    assert world.aliases(RUN) == {"best": 1, "production": 3}
    result = runner.invoke(group, [*url, "tag", RUN, "1", "split", "val"])
    assert result.exit_code == 0, result.output
    assert world.checkpoints(RUN)[1].tags == {"split": "val"}
    result = runner.invoke(group, [*url, "alias", RUN, "best"])
    assert "best" in result.output and "split=val" in result.output
    result = runner.invoke(group, [*url, "alias", RUN, "nope"])
    assert result.exit_code == 2
    assert "no alias 'nope'" in result.output


def test_alias_and_tag_routes(world):
    app = FastAPI()
    app.include_router(registry_router(world, world.settings))
    client = TestClient(app)
    response = client.put(f"/runs/{RUN}/aliases/production", json={"report_index": 2})
    assert response.status_code == 200, response.text
    response = client.put(f"/runs/{RUN}/aliases/best", json={"track_metric": "accuracy"})
    assert response.json()["report_index"] == 1
    assert client.get(f"/runs/{RUN}/aliases").json() == {"best": 1, "production": 2}
    response = client.put(f"/runs/{RUN}/checkpoints/2/tags/split", json={"value": "val"})
    assert response.status_code == 200, response.text
    body = client.get(f"/runs/{RUN}/aliases/production").json()
    assert (body["report_index"], body["aliases"], body["tags"]) == (
        2,
        ["production"],
        {"split": "val"},
    )
    response = client.get(f"/runs/{RUN}/aliases/staging")
    assert response.status_code == 404
    assert response.json()["error"] == "AliasNotFound"
    response = client.put(f"/runs/{RUN}/aliases/x y", json={"report_index": 2})
    assert response.status_code == 422
    assert client.delete(f"/runs/{RUN}/aliases/production").status_code == 200
    assert client.delete(f"/runs/{RUN}/checkpoints/2/tags/split").status_code == 200
    assert world.aliases(RUN) == {"best": 1}
    assert world.checkpoints(RUN)[2].tags == {}
