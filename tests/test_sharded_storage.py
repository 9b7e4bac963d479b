"""How the ranks' parts of a sharded checkpoint are stored and sealed: on S3 (moto's
server, its traffic counted) each part is written once, at its final place; names ckval
keeps for parts are refused; ranks that clash on a file; NO_UPLOAD's ranks each hash
their own shards. Through ShardReporter and a real registry, without Ray."""

from __future__ import annotations

import logging
import os
import time
import uuid

import pytest
from ray.train import Checkpoint

from tests.moto_s3 import S3Traffic, moto_s3_server
from trainer_integration._parts import ShardReporter
from trainer_integration._reporter import RunReporter
from trainer_integration._request import CheckpointUploadMode, PreparedReport
from validation_service.config import Settings
from validation_service.errors import CheckpointCorrupt, InvalidInput
from validation_service.jobs import AssemblyStatus
from validation_service.manifest import MANIFEST_NAME
from validation_service.parts import ShardConflict
from validation_service.registry.assemblies import ReportCall

BUCKET = "ckval-shards"
RUN = "sharded"
MB = 1024 * 1024


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server, reached through a proxy that counts what the clients send."""
    with moto_s3_server(BUCKET) as endpoint, S3Traffic(endpoint) as traffic:
        yield traffic


def folder_of(tmp_path, name: str, files: dict[str, bytes]) -> str:
    folder = tmp_path / name
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return str(folder)


def make_reporter(tmp_path, s3: S3Traffic | None = None, **settings) -> RunReporter:
    if s3 is not None:
        settings["storage"] = f"s3://{BUCKET}/{uuid.uuid4().hex}"
        settings["storage_options"] = {
            "key": "test",
            "secret": "test",
            "endpoint_url": s3.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        }
    home = tmp_path / f"home-{uuid.uuid4().hex[:6]}"
    return RunReporter(RUN, Settings(home=str(home), **settings), start_service=False)


def report(reporter, folders: dict[int, str], mode=CheckpointUploadMode.ASYNC, world=None):
    """Every rank's report() of one step (the ranks of one worker group, each with a
    folder), each part stored in rank order; returns the ranks' PartReports, which the
    lowest rank seals once both are stored."""
    group = uuid.uuid4().hex[:8]
    shards = {}
    for rank, folder in sorted(folders.items()):
        shards[rank] = ShardReporter(reporter, rank).report(
            PreparedReport({"step": 0}, None, mode, delete_local=False),
            Checkpoint.from_directory(folder),
            ReportCall(group, 1, rank, world or len(folders)),
        )
    return shards


def _group_of(reporter, slot) -> str:
    """The worker group of a report's assembly (its group key less the call)."""
    from sqlalchemy import select

    from validation_service.registry.models import CheckpointAssembly

    with reporter.registry.db.read() as session:
        key = session.execute(
            select(CheckpointAssembly.group_key).where(CheckpointAssembly.id == slot.assembly_id)
        ).scalar_one()
    return key.rsplit("-", 1)[0]


def sealed(shards):
    """The lowest rank's outcome of the report (raising what its seal raised)."""
    return shards[min(shards)].sealed.result(timeout=60)


def seal(reporter, shards) -> None:
    assert sealed(shards).complete


# ------------------------------------------------------------- S3: each part written once
@pytest.mark.parametrize("ranks", [2, 1], ids=["two-parts", "one-rank-with-a-checkpoint"])
def test_on_s3_each_part_is_written_once_at_its_final_place(s3, tmp_path, ranks):
    reporter = make_reporter(tmp_path, s3)
    folders = {
        rank: folder_of(
            tmp_path, f"rank{rank}", {f"__{rank}_0.distcp": os.urandom(3 * MB), "c.json": b"{}"}
        )
        for rank in range(ranks)
    }
    checkpoint_bytes = ranks * (3 * MB + 2)
    reporter.prepare()  # the registry opened first: its SQLite file is local, not S3
    s3.reset()
    seal(reporter, report(reporter, folders))
    # Every byte went up once (plus HTTP headers and the manifest); nothing was copied
    # on the server, nothing written under a part's folder, nothing deleted.
    assert checkpoint_bytes * 0.99 < s3.sent_bytes < checkpoint_bytes * 1.05
    assert s3.copies == []
    assert not [path for _, path in s3.requests if ".ckval-part-" in path]
    assert not [path for method, path in s3.requests if method == "DELETE"]
    (record,) = reporter.registry.checkpoints(RUN)
    expected = sorted([*(f"__{r}_0.distcp" for r in range(ranks)), "c.json"])
    manifest = reporter.storage.verify(record.uri, record.manifest_sha256)
    assert sorted(manifest.files) == expected
    stored = reporter.storage.fs.ls(reporter.storage.path_of(record.uri))
    assert sorted(os.path.basename(p) for p in stored) == sorted([*expected, MANIFEST_NAME])
    reporter.close()


def test_on_s3_ranks_that_wrote_one_name_alike_or_differently(s3, tmp_path, caplog):
    reporter = make_reporter(tmp_path, s3)
    folders = {
        rank: folder_of(
            tmp_path,
            f"rank{rank}",
            {"config.json": b'{"width": 8}', "step.txt": str(rank).encode() * 10},
        )
        for rank in (0, 1)
    }
    with caplog.at_level(logging.WARNING, logger="validation_service.parts"):
        seal(reporter, report(reporter, folders))
    # Both went to the same place; the storage holds the last written (rank 1's here:
    # its part was stored after rank 0's), and the manifest says so.
    assert "'step.txt': rank 1's file kept, rank(s) 0 differ" in caplog.text
    assert "config.json" not in caplog.text  # the same content: no conflict
    (record,) = reporter.registry.checkpoints(RUN)
    reporter.storage.verify(record.uri, record.manifest_sha256)
    path = reporter.storage.path_of(record.uri)
    assert reporter.storage.fs.cat(f"{path}/step.txt") == b"1" * 10
    reporter.close()


def test_on_s3_a_conflict_is_an_error_when_the_setting_says_so(s3, tmp_path):
    reporter = make_reporter(tmp_path, s3, shard_conflicts="error")
    folders = {r: folder_of(tmp_path, f"rank{r}", {"a.txt": bytes([r])}) for r in (0, 1)}
    shards = report(reporter, folders)
    with pytest.raises(ShardConflict, match=r"'a.txt': rank 0's file kept, rank\(s\) 1 differ"):
        sealed(shards)
    (assembly,) = reporter.registry.incomplete_checkpoints(RUN)
    assert assembly.status is AssemblyStatus.INCOMPLETE
    assert reporter.registry.checkpoints(RUN) == []
    reporter.close()


# -------------------------------------------------------------------- names and clashes
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_rank_file_under_a_part_name_is_refused_before_anything_is_stored(s3, tmp_path, where):
    reporter = make_reporter(tmp_path, s3 if where == "s3" else None)
    folder = folder_of(tmp_path, "rank0", {".ckval-part-00001/model.pt": b"not rank 1's"})
    named = r"report\(\) on rank 0: .*'\.ckval-part-00001/model\.pt'.*ckval's own.*Rename"
    with pytest.raises(InvalidInput, match=named):
        ShardReporter(reporter, 0).report(
            PreparedReport({"step": 0}, None, CheckpointUploadMode.SYNC, delete_local=False),
            Checkpoint.from_directory(folder),
            ReportCall("g", 1, 0, 1),
        )
    if where == "local":
        stored = [p for p in (tmp_path.glob("home-*/checkpoints/**/*")) if p.is_file()]
        assert stored == []
    reporter.close()


@pytest.mark.parametrize("setting", ["warn", "error"])
def test_a_file_where_another_rank_has_a_folder_keeps_the_lowest_ranks(tmp_path, caplog, setting):
    reporter = make_reporter(tmp_path, shard_conflicts=setting)
    folders = {
        0: folder_of(tmp_path, "rank0", {"a": b"rank 0's file", "b/x": b"0"}),
        1: folder_of(tmp_path, "rank1", {"a/inner": b"rank 1's", "b": b"1", "c": b"c"}),
    }
    shards = report(reporter, folders, CheckpointUploadMode.SYNC)
    if setting == "error":
        with pytest.raises(ShardConflict, match=r"'a/inner': rank\(s\) 1's file left out"):
            sealed(shards)
        return
    with caplog.at_level(logging.WARNING, logger="validation_service.parts"):
        seal(reporter, shards)
    assert "'a/inner': rank(s) 1's file left out, 'a' is rank 0's file, not a folder" in (
        caplog.text
    )
    assert "'b': rank(s) 1's file left out, it is a folder of rank 0's files" in caplog.text
    (record,) = reporter.registry.checkpoints(RUN)
    manifest = reporter.storage.verify(record.uri, record.manifest_sha256)
    assert sorted(manifest.files) == ["a", "b/x", "c"]
    assert open(os.path.join(record.uri, "a"), "rb").read() == b"rank 0's file"
    reporter.close()


# ------------------------------------------------------------ NO_UPLOAD: each rank hashes
def test_no_upload_ranks_each_hash_their_own_shards(tmp_path):
    reporter = make_reporter(tmp_path)
    shared = folder_of(
        tmp_path,
        "shared",
        {
            "__0_0.distcp": os.urandom(MB),
            "__1_0.distcp": os.urandom(MB),
            ".metadata": b"m",
            "config.json": b"{}",
        },
    )
    # A third rank, without a folder, reports last: the seal waits for it.
    shards = report(reporter, {0: shared, 1: shared}, CheckpointUploadMode.NO_UPLOAD, world=3)
    slot = shards[0].joined.result(timeout=60)
    call = ReportCall("any", 1, 0, 3)
    deadline = time.monotonic() + 60
    while True:
        parts = reporter.writer.assemblies.standing(reporter.run_id, slot.assembly_id, call).parts
        if [p.status.value for p in parts] == ["stored", "stored"]:
            break
        assert time.monotonic() < deadline, parts
    # Each rank hashed its own shard when it reported; the rest is the sealer's.
    assert [(p.rank, sorted(p.files)) for p in parts] == [
        (0, ["__0_0.distcp"]),
        (1, ["__1_0.distcp"]),
    ]
    # The sealer does not read rank 1's shard again: what rank 1 hashed is in the
    # manifest, and a change made after rank 1 reported is found by verification.
    with open(os.path.join(shared, "__1_0.distcp"), "r+b") as f:
        f.write(b"changed after rank 1 reported")
    ShardReporter(reporter, 2).no_part(ReportCall(_group_of(reporter, slot), 1, 2, 3))
    seal(reporter, shards)
    (record,) = reporter.registry.checkpoints(RUN)
    assert record.uri == shared
    with pytest.raises(CheckpointCorrupt, match=r"'__1_0.distcp' has a different blake3"):
        reporter.storage.verify(record.uri, record.manifest_sha256)
    reporter.close()
