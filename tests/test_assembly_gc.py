"""Sharded checkpoints and gc, on SQLite and PostgreSQL: sealing registers the checkpoint
and ends its assembly COMPLETE in one transaction (refused once the assembly was given
up); an open assembly is given up only once idle; gc never removes a folder a checkpoint
row uses, nor another namespace's parts."""

from __future__ import annotations

import os
import time

import pytest
from fastapi.testclient import TestClient
from ray.train import Checkpoint

from trainer_integration import Client
from trainer_integration._parts import ShardReporter
from trainer_integration._reporter import RunReporter
from trainer_integration._request import CheckpointUploadMode, PreparedReport
from validation_service.api import create_app
from validation_service.config import Settings
from validation_service.errors import AssemblyGivenUp
from validation_service.jobs import AssemblyStatus
from validation_service.registry.assemblies import PartRecord, ReportCall
from validation_service.registry.registry import Registry
from validation_service.storage import CheckpointStorage


@pytest.fixture
def settings(registry, tmp_path) -> Settings:
    url = registry.engine.url.render_as_string(hide_password=False)
    return Settings(
        home=tmp_path / "home", database_url=url, storage=str(tmp_path / "s"), keep_warm=False
    )


@pytest.fixture
def reg(settings):
    opened = Registry(settings=settings)
    yield opened
    opened.close()


def rank_folder(tmp_path, rank: int) -> Checkpoint:
    folder = tmp_path / f"rank-{rank}"
    folder.mkdir()
    (folder / f"shard-{rank}.bin").write_bytes(bytes([rank]) * 100)
    return Checkpoint.from_directory(str(folder))


def a_ranked_checkpoint(settings: Settings, tmp_path, run: str) -> None:
    """Another run's plain checkpoint with a "loss", for retention to rank."""
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "w.bin").write_bytes(b"w")
    with Client(run, settings, start_service=False) as client:
        client.report({"loss": 0.5}, Checkpoint.from_directory(str(folder)))


def test_a_run_finished_while_parts_are_stored_keeps_them_for_its_seal(
    reg, settings, tmp_path, unique_run
):
    """POST /runs/r/finish while a report's parts are ASSEMBLING (rank 2, without a part,
    has not reported yet), then gc: the parts stay (the assembly is not idle yet), and
    the lowest rank's seal registers the checkpoint with every file. Once, gc gave the
    assembly up and removed the parts, and the seal lost the report without an error."""
    a_ranked_checkpoint(settings, tmp_path, unique_run + "-plain")
    reporters = [RunReporter(unique_run, settings, start_service=False) for _ in range(3)]
    report = PreparedReport({"step": 0}, None, CheckpointUploadMode.SYNC, delete_local=False)
    parts = [
        ShardReporter(reporters[rank], rank).report(
            report, rank_folder(tmp_path, rank), ReportCall("g1", 1, rank, 3)
        )
        for rank in (0, 1)
    ]
    run_id = reporters[0].run_id
    assert reporters[2].run_id == run_id  # rank 2 reported in this run before
    deadline = time.monotonic() + 60
    while [p.status.value for p in _parts(reg, run_id, 3)] != ["stored", "stored"]:
        assert time.monotonic() < deadline, "the two parts were never stored"

    with TestClient(create_app(settings, reg), base_url="http://localhost") as client:
        finished = client.post(f"/runs/{unique_run}/finish", json={"status": "FINISHED"})
    reg.apply_retention(metric="loss", keep_best_per_run=1, keep_latest=1)
    assert not parts[0].sealed.done()  # rank 2 is behind: nothing sealed yet
    ShardReporter(reporters[2], 2).no_part(ReportCall("g1", 1, 2, 3))
    sealed = parts[0].sealed.result(timeout=60)
    assert parts[1].sealed.result(timeout=60) is None  # rank 0 seals, rank 1 does not
    for reporter in reporters:
        reporter.flush(60)
        reporter.close()

    assert finished.status_code == 200, finished.text
    assert sealed.complete
    [record] = reg.checkpoints(unique_run)
    manifest = CheckpointStorage(settings.storage).verify(record.uri, record.manifest_sha256)
    assert sorted(manifest.files) == ["shard-0.bin", "shard-1.bin"]
    assert reg.incomplete_checkpoints(unique_run) == []


def _parts(reg: Registry, run_id: int, world_size: int):
    """The parts of the run's first report."""
    from sqlalchemy import select

    from validation_service.registry.models import CheckpointAssembly

    with reg.db.read() as session:
        assembly_id = session.execute(
            select(CheckpointAssembly.id).where(CheckpointAssembly.run_id == run_id)
        ).scalar_one_or_none()
    if assembly_id is None:
        return []
    return reg.assemblies.standing(run_id, assembly_id, ReportCall("g1", 1, 0, world_size)).parts


def _sealing(reg: Registry, run: str, storage: str, group: str = "g1", call: int = 1):
    """A report of two ranks whose parts are stored and whose seal has begun."""
    run_id = reg.ledger.ensure_run(run, storage_root=storage)
    uri_of = lambda i: f"{storage}/default/{run}/ckpt_{i}"  # noqa: E731
    for rank in (0, 1):
        slot = reg.assemblies.join(run_id, ReportCall(group, call, rank, 2), uri_of)
    os.makedirs(slot.uri)
    with open(os.path.join(slot.uri, "model.bin"), "wb") as f:
        f.write(b"weights")
    for rank in (0, 1):
        reg.assemblies.arrive(slot.assembly_id, PartRecord(rank, slot.uri, {}, 7, {}))
    assert reg.assemblies.begin_sealing(slot.assembly_id) is not None
    return run_id, slot


def test_a_seal_after_its_assembly_was_given_up_registers_nothing(
    reg, settings, tmp_path, unique_run
):
    run_id, slot = _sealing(reg, unique_run, settings.storage)
    reg.ledger.finish_run(unique_run)
    assert reg.assemblies.give_up_ended_runs([run_id], idle_s=0) == 1

    with pytest.raises(AssemblyGivenUp, match=f"Report 0 of run {unique_run} was given up"):
        reg.assemblies.seal(
            slot.assembly_id,
            run_id,
            slot.report_index,
            uri=slot.uri,
            size_bytes=7,
            manifest_sha256=None,
            reported_metrics={},
            step=None,
            epoch=None,
            job=None,
        )

    assert reg.checkpoints(unique_run) == []
    [incomplete] = reg.incomplete_checkpoints(unique_run)
    assert incomplete.status is AssemblyStatus.INCOMPLETE


def test_a_seal_ends_its_assembly_and_older_groups_in_its_transaction(reg, settings, unique_run):
    run_id, old = _sealing(reg, unique_run, settings.storage, "g1", 1)
    # The older group's next report never got all its parts.
    stale = reg.assemblies.join(
        run_id, ReportCall("g1", 2, 0, 2), lambda i: f"{settings.storage}/x/{i}"
    )
    newer = reg.assemblies.join(
        run_id, ReportCall("g2", 1, 0, 1), lambda i: f"{settings.storage}/y/{i}"
    )
    reg.assemblies.arrive(newer.assembly_id, PartRecord(0, newer.uri, {}, 1, {}))
    assert reg.assemblies.begin_sealing(newer.assembly_id)
    common = dict(size_bytes=1, manifest_sha256=None, reported_metrics={}, step=None, epoch=None)

    first = reg.assemblies.seal(
        newer.assembly_id, run_id, newer.report_index, uri=newer.uri, group_prefix="g2-",
        job=None, **common,
    )  # fmt: skip
    again = reg.assemblies.seal(
        newer.assembly_id, run_id, newer.report_index, uri=newer.uri, group_prefix="g2-",
        job=None, **common,
    )  # fmt: skip

    assert first.created and not again.created and again.checkpoint_id == first.checkpoint_id
    states = {a.report_index: a.status for a in reg.incomplete_checkpoints(unique_run)}
    # The older group's ASSEMBLING one ends; its SEALING one is left to its sealer.
    assert states == {
        old.report_index: AssemblyStatus.SEALING,
        stale.report_index: AssemblyStatus.INCOMPLETE,
    }
    assert [r.report_index for r in reg.checkpoints(unique_run)] == [newer.report_index]


def test_gc_never_removes_a_folder_a_checkpoint_row_uses(reg, settings, tmp_path, unique_run):
    """A checkpoint registered from a sealing assembly (as an older ckval's sealer did
    before ending it): another worker group's seal leaves the assembly to its sealer,
    and even once it is given up, gc keeps the folder the checkpoint row uses."""
    a_ranked_checkpoint(settings, tmp_path, unique_run + "-plain")
    run_id, slot = _sealing(reg, unique_run, settings.storage)
    reg.ledger.register_checkpoint(
        run_id, slot.report_index, uri=slot.uri, size_bytes=7, manifest_sha256=None,
        reported_metrics={"loss": 0.1},
    )  # fmt: skip

    assert reg.assemblies.give_up_other_groups(run_id, "g2-") == 0  # its sealer may be alive
    assert reg.assemblies.give_up_other_groups(run_id, "g2-", idle_s=0) == 1
    reg.apply_retention(metric="loss", keep_best_per_run=1, keep_latest=1)

    assert os.path.isfile(os.path.join(slot.uri, "model.bin"))
    assert reg.latest_checkpoint(unique_run).path == slot.uri


def test_gc_of_one_namespace_leaves_another_namespaces_parts(registry, tmp_path, unique_run):
    url = registry.engine.url.render_as_string(hide_password=False)
    storage = str(tmp_path / "s")
    teams = {
        name: Registry(settings=Settings(database_url=url, storage=storage, namespace=name))
        for name in ("team-a", "team-b")
    }
    try:
        a, b = teams["team-a"], teams["team-b"]
        run_id = a.ledger.ensure_run(unique_run, storage_root=storage)
        slot = a.assemblies.join(
            run_id, ReportCall("g", 1, 0, 1), lambda i: f"{storage}/team-a/{unique_run}/c_{i}"
        )
        os.makedirs(slot.uri)
        open(os.path.join(slot.uri, "part.bin"), "wb").close()
        a.ledger.finish_run(unique_run)
        a.assemblies.end(slot.assembly_id, AssemblyStatus.INCOMPLETE, "a rank died")
        for team, name in ((a, "team-a"), (b, "team-b")):  # a checkpoint to rank in each
            other = team.ledger.ensure_run("other", storage_root=storage)
            team.ledger.register_checkpoint(
                other, 0, uri=f"{storage}/{name}/other/c_0", size_bytes=0,
                manifest_sha256=None, reported_metrics={"loss": 1.0},
            )  # fmt: skip

        b.apply_retention(metric="loss", keep_best_per_run=1, keep_latest=1)
        kept = os.path.isfile(os.path.join(slot.uri, "part.bin"))
        [after_b] = a.incomplete_checkpoints(unique_run)
        a.apply_retention(metric="loss", keep_best_per_run=1, keep_latest=1)
        [after_a] = a.incomplete_checkpoints(unique_run)
    finally:
        for opened in teams.values():
            opened.close()

    assert kept and after_b.deleted_at is None  # team B's gc left team A's parts alone
    assert after_a.deleted_at is not None and not os.path.exists(slot.uri)  # A's own gc


@pytest.mark.ray
def test_the_reports_of_a_worker_group_ray_removed_end_incomplete_at_once(
    ray_session, reg, unique_run
):
    """A Ray Tune trial stopped (or a run preempted) mid-report: its ranks are gone with
    their placement group, and the scheduler's scan ends the open report INCOMPLETE, long
    before the run is ended or the assembly's lease runs out. A live group's report, and
    one of a placement group this cluster does not know (a run on another Ray cluster
    reporting into this registry), are left open."""
    import ray.util

    from validation_service.service.worker_groups import end_reports_of_ended_groups

    run_id = reg.ledger.ensure_run(unique_run, storage_root="/tmp/ckval-groups")
    ended, live = (ray.util.placement_group([{"CPU": 0.01}]) for _ in range(2))
    ray.get([ended.ready(), live.ready()], timeout=60)
    ray.util.remove_placement_group(ended)
    groups = {"ended": ended.id.hex(), "live": live.id.hex(), "elsewhere": "ab" * 18}
    for name, pg_id in groups.items():
        call = ReportCall(f"pg{pg_id}", 1, 0, 2)
        reg.assemblies.join(run_id, call, lambda index, name=name: f"/tmp/ckval-groups/{name}")
    deadline = time.monotonic() + 30
    while end_reports_of_ended_groups(reg.assemblies) == 0:
        assert time.monotonic() < deadline, "the removed group's report stayed open"
        time.sleep(0.2)
    states = {r.uri.rsplit("/", 1)[1]: r for r in reg.incomplete_checkpoints(unique_run)}
    assert states["ended"].status is AssemblyStatus.INCOMPLETE
    assert "its worker group ended first" in states["ended"].detail
    assert states["live"].status is AssemblyStatus.ASSEMBLING
    assert states["elsewhere"].status is AssemblyStatus.ASSEMBLING
    assert end_reports_of_ended_groups(reg.assemblies) == 0  # once
    ray.util.remove_placement_group(live)
