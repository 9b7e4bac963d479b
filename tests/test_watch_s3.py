"""Watched folders on S3 (moto's server on loopback): step folders registered in place
with their S3 URIs once their DCP marker is there, read by the attempts; a prefix the
trainer has not written yet; a bucket that does not exist; copies into local storage."""

from __future__ import annotations

import json

import pytest

from tests.moto_s3 import CREDENTIALS, moto_s3_server
from tests.test_watch import SCORE_FN, settle
from validation_service.config import Settings
from validation_service.errors import InvalidInput
from validation_service.registry.registry import Registry
from validation_service.service.watcher import FolderWatcher


@pytest.fixture
def s3(tmp_path):
    """(settings with moto's endpoint, a boto3 client) around a bucket "trainer"."""
    import boto3

    with moto_s3_server("trainer") as endpoint:
        options = {
            "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "endpoint_url": endpoint,
            "client_kwargs": {"region_name": CREDENTIALS["AWS_DEFAULT_REGION"]},
        }
        settings = Settings(
            home=tmp_path / "home",
            database_url=f"sqlite:///{tmp_path / 'registry.db'}",
            storage=str(tmp_path / "store"),
            storage_options=options,
            watch_interval_s=0.001,
        )
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )
        yield settings, client


def put_step(client, prefix: str, name: str, value: float, complete: bool = True) -> None:
    body = json.dumps({"value": value}).encode()
    client.put_object(Bucket="trainer", Key=f"{prefix}/{name}/value.json", Body=body)
    if complete:
        client.put_object(Bucket="trainer", Key=f"{prefix}/{name}/.metadata", Body=b"{}")


def test_step_folders_on_s3_are_registered_in_place_and_validated(s3, unique_run):
    settings, client = s3
    reg = Registry(settings=settings)
    try:
        # Watched before the trainer's first save: the prefix has no object yet.
        reg.watch("s3://trainer/run7", unique_run, SCORE_FN)
        watcher = FolderWatcher(reg.watch_listings, settings, "replica/1")
        assert watcher.tick() == 0
        put_step(client, "run7", "step-100", 0.4)
        put_step(client, "run7", "step-200", 0.6, complete=False)
        assert watcher.tick() == 1
        [listed] = reg.watches()
        assert [w.name for w in listed.waiting] == ["step-200"]
        client.put_object(Bucket="trainer", Key="run7/step-200/.metadata", Body=b"{}")
        assert watcher.tick() == 1
        assert watcher.tick() == 0
        jobs = settle(reg, settings, unique_run)
        records = reg.checkpoints(unique_run)
    finally:
        reg.close()
    assert [j.status for j in jobs] == ["SUCCEEDED", "SUCCEEDED"]
    assert [(r.uri, r.step, r.metrics["score"]) for r in records] == [
        ("s3://trainer/run7/step-100", 100, 0.4),
        ("s3://trainer/run7/step-200", 200, 0.6),
    ]


def test_a_bucket_that_does_not_exist_is_refused(s3, unique_run):
    settings, _ = s3
    reg = Registry(settings=settings)
    try:
        with pytest.raises(InvalidInput, match="no such folder"):
            reg.watch("s3://no-such-bucket/run7", unique_run, SCORE_FN)
        assert reg.watches() == []
    finally:
        reg.close()


def test_copy_brings_an_s3_step_folder_into_local_storage(s3, tmp_path, unique_run):
    settings, client = s3
    put_step(client, "run8", "step-5", 0.5)
    reg = Registry(settings=settings)
    try:
        reg.watch("s3://trainer/run8", unique_run, SCORE_FN, copy=True)
        assert FolderWatcher(reg.watch_listings, settings, "replica/1").tick() == 1
        client.delete_object(Bucket="trainer", Key="run8/step-5/value.json")  # rotated
        [job] = settle(reg, settings, unique_run)
        [record] = reg.checkpoints(unique_run)
    finally:
        reg.close()
    assert job.status == "SUCCEEDED" and record.metrics["score"] == 0.5
    assert record.uri.startswith(str(tmp_path / "store"))
