"""Parts of a checkpoint written by several ranks: stored by each rank, assembled into one
folder with one manifest, conflicts between ranks, and the registry's assembly rows
(on SQLite and PostgreSQL)."""

from __future__ import annotations

import logging
import os

import pytest
from ray.train import Checkpoint

from trainer_integration._parts import ShardReporter
from trainer_integration._reporter import RunReporter
from trainer_integration._request import CheckpointUploadMode, PreparedReport
from validation_service.config import Settings
from validation_service.errors import CheckpointNotFound
from validation_service.jobs import AssemblyStatus, PartStatus
from validation_service.manifest import scan_folder
from validation_service.parts import ShardConflict, assemble, store_part
from validation_service.registry.assemblies import PartRecord, ReportCall
from validation_service.storage import CheckpointStorage


def rank_folder(tmp_path, rank: int, files: dict[str, bytes]) -> str:
    folder = tmp_path / f"rank-{rank}"
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return str(folder)


def stored_parts(storage, target, tmp_path, by_rank: dict[int, dict[str, bytes]]):
    parts = []
    for rank, files in by_rank.items():
        source = scan_folder(rank_folder(tmp_path, rank, files))
        location, stored = store_part(storage, target, rank, source)
        size = sum(entry["size"] for entry in stored.values())
        parts.append(PartRecord(rank, location, stored, size, {"rank": rank}))
    return parts


def test_each_ranks_files_become_one_checkpoint_with_one_manifest(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "store"))
    target = storage.checkpoint_path("default", "r", 0)
    parts = stored_parts(
        storage,
        target,
        tmp_path,
        {
            1: {"__1_0.distcp": b"one" * 100, "config.json": b"{}"},
            0: {"__0_0.distcp": b"zero" * 100, ".metadata": b"m", "config.json": b"{}"},
        },
    )
    persisted, conflicts = assemble(storage, target, parts, "warn")
    assert conflicts == []
    assert sorted(os.listdir(target)) == sorted(
        [".ckval-manifest.json", ".metadata", "__0_0.distcp", "__1_0.distcp", "config.json"]
    )
    manifest = storage.verify(persisted.uri, persisted.manifest_sha256)
    assert sorted(manifest.files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "config.json"]
    assert persisted.size_bytes == 300 + 400 + 1 + 2


def test_ranks_that_differ_on_a_file_keep_the_lowest_ranks_with_a_warning(tmp_path, caplog):
    storage = CheckpointStorage(str(tmp_path / "store"))
    target = storage.checkpoint_path("default", "r", 0)
    by_rank = {0: {"step.txt": b"0"}, 1: {"step.txt": b"1"}, 2: {"step.txt": b"2"}}
    parts = stored_parts(storage, target, tmp_path, by_rank)
    with caplog.at_level(logging.WARNING, logger="validation_service.parts"):
        persisted, conflicts = assemble(storage, target, parts, "warn")
    assert [str(c) for c in conflicts] == ["'step.txt': rank 0's file kept, rank(s) 1, 2 differ"]
    assert "rank 0's file kept, rank(s) 1, 2 differ" in caplog.text
    assert (
        tmp_path / "store" / "default" / "r" / "checkpoint_000000" / "step.txt"
    ).read_bytes() == b"0"
    storage.verify(persisted.uri, persisted.manifest_sha256)


def test_a_conflict_is_an_error_when_the_setting_says_so_and_nothing_moves(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "store"))
    target = storage.checkpoint_path("default", "r", 0)
    parts = stored_parts(storage, target, tmp_path, {0: {"a": b"0"}, 1: {"a": b"1"}})
    with pytest.raises(ShardConflict, match=r"'a': rank 0's file kept, rank\(s\) 1 differ"):
        assemble(storage, target, parts, "error")
    assert sorted(os.listdir(target)) == [".ckval-part-00000", ".ckval-part-00001"]


def test_the_ranks_of_one_report_share_its_slot_and_one_seals_it(registry):
    run_id = registry.ledger.ensure_run("sharded", storage_root="/tmp/x")
    uri_of = lambda index: f"/tmp/x/default/sharded/checkpoint_{index:06d}"  # noqa: E731
    assemblies = registry.assemblies
    call = {rank: ReportCall("g1", 1, rank, 3) for rank in range(3)}
    first = assemblies.join(run_id, call[1], uri_of)
    assert assemblies.join(run_id, call[1], uri_of) == first  # again: the same slot
    second = assemblies.join(run_id, ReportCall("g1", 2, 1, 3), uri_of)
    assert (first.report_index, second.report_index) == (0, 1)
    assert assemblies.join(run_id, call[0], uri_of) == first
    # Rank 2 reports no checkpoint: its progress alone moves on.
    standing = assemblies.standing(run_id, first.assembly_id, call[0])
    assert standing.behind == [2] and not standing.settled
    assemblies.advance(run_id, call[2])
    for rank in (1, 0):
        part = PartRecord(rank, f"{first.uri}/.ckval-part-{rank}", {}, 0, {"rank": rank})
        assert assemblies.arrive(first.assembly_id, part)
        assert assemblies.arrive(first.assembly_id, part)  # again: nothing changes
    standing = assemblies.standing(run_id, first.assembly_id, call[0])
    assert standing.settled and [p.rank for p in standing.stored] == [0, 1]
    parts = assemblies.begin_sealing(first.assembly_id)
    assert [p.rank for p in parts] == [0, 1]
    assert assemblies.begin_sealing(first.assembly_id) is None  # sealed once
    # A part that comes after the seal began is never added to the checkpoint (a rank
    # released from Ray Train's sync by relax_collectives_on_preemption, say).
    late = PartRecord(2, f"{first.uri}/.ckval-part-2", {}, 0, {"rank": 2})
    assert assemblies.join(run_id, call[2], uri_of) == first
    assert not assemblies.arrive(first.assembly_id, late)
    assemblies.end(first.assembly_id, AssemblyStatus.COMPLETE)
    assert not assemblies.arrive(first.assembly_id, late)
    assert [p.rank for p in assemblies.standing(run_id, first.assembly_id, call[0]).stored] == [
        0,
        1,
    ]
    # A newer worker group's seal ends the older group's open assemblies.
    later = assemblies.join(run_id, ReportCall("g2", 1, 0, 3), uri_of)
    assert assemblies.give_up_other_groups(run_id, "g2-") == 1
    listed = registry.incomplete_checkpoints("sharded")
    # Listed too: the newer group's report, still being stored.
    assert [(a.report_index, a.status) for a in listed] == [
        (1, AssemblyStatus.INCOMPLETE),
        (later.report_index, AssemblyStatus.ASSEMBLING),
    ]
    # Nothing of it is a checkpoint: nothing listed, ranked or latest.
    assert registry.checkpoints("sharded") == []
    assert registry.latest_checkpoint("sharded") is None


def test_a_failed_part_settles_the_report_for_the_others_to_end_it_incomplete(registry):
    run_id = registry.ledger.ensure_run("failing", storage_root="/tmp/x")
    uri_of = lambda index: f"/tmp/x/default/failing/checkpoint_{index:06d}"  # noqa: E731
    calls = [ReportCall("g", 1, rank, 2) for rank in (0, 1)]
    slot = registry.assemblies.join(run_id, calls[0], uri_of)
    registry.assemblies.join(run_id, calls[1], uri_of)
    stored = PartRecord(0, f"{slot.uri}/.ckval-part-0", {}, 0, {"step": 1})
    registry.assemblies.arrive(slot.assembly_id, stored)
    assert not registry.assemblies.standing(run_id, slot.assembly_id, calls[0]).settled
    failed = PartRecord.failed(1, {"step": 1}, "rank 1: its folder is missing")
    registry.assemblies.arrive(slot.assembly_id, failed)
    standing = registry.assemblies.standing(run_id, slot.assembly_id, calls[0])
    assert standing.settled
    assert [(p.rank, p.status) for p in standing.failed] == [(1, PartStatus.FAILED)]
    assert standing.failed[0].detail == "rank 1: its folder is missing"


def test_an_open_assembly_of_a_run_that_ended_is_incomplete_once_idle(registry):
    run_id = registry.ledger.ensure_run("ended", storage_root="/tmp/x")
    registry.assemblies.join(
        run_id, ReportCall("g", 1, 0, 2), lambda i: f"/tmp/x/default/ended/checkpoint_{i}"
    )
    registry.ledger.finish_run("ended", "FAILED")
    # Its ranks may still store their parts for a while (ASSEMBLY_LEASE_S).
    assert registry.assemblies.give_up_ended_runs([run_id]) == 0
    assert registry.assemblies.give_up_ended_runs([run_id], idle_s=0) == 1
    (record,) = registry.incomplete_checkpoints("ended")
    assert record.status is AssemblyStatus.INCOMPLETE
    assert "the run ended first" in record.detail


@pytest.mark.parametrize("what", ["a file", "a missing path"])
def test_a_shard_that_is_no_folder_is_refused_naming_the_rank(tmp_path, what):
    home = tmp_path / "home"
    settings = Settings(home=str(home))
    reporter = RunReporter("shards", settings, start_service=False)
    path = tmp_path / "model.pt"
    if what == "a file":
        path.write_bytes(b"x")
    call = ReportCall("g", 1, 3, 4)
    named = r"report\(\) on rank 3: .*not a directory.*Pass Checkpoint"
    with pytest.raises(CheckpointNotFound, match=named):
        ShardReporter(reporter, 3).report(
            PreparedReport({"step": 0}, None, CheckpointUploadMode.ASYNC, delete_local=False),
            Checkpoint.from_directory(str(path)),
            call,
        )
    # Nothing was copied; the rank's part is recorded as failed, so that the report is
    # never sealed without it (the other ranks end it INCOMPLETE).
    reporter.flush(30)
    run_id = reporter.run_id
    assert not [p for p in (home / "checkpoints").rglob("*") if p.is_file()]
    [slot] = [a for a in reporter.registry.incomplete_checkpoints("shards")]
    assembly = reporter.registry.assemblies
    standing = assembly.standing(run_id, _assembly_id(reporter, slot.report_index), call)
    assert [(p.rank, p.status) for p in standing.parts] == [(3, PartStatus.FAILED)]
    assert "rank 3" in standing.parts[0].detail
    reporter.close()


def _assembly_id(reporter, report_index: int) -> int:
    from sqlalchemy import select

    from validation_service.registry.models import CheckpointAssembly

    with reporter.registry.db.read() as session:
        return session.execute(
            select(CheckpointAssembly.id).where(CheckpointAssembly.report_index == report_index)
        ).scalar_one()
