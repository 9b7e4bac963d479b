"""Checkpoint storage on a local folder: manifest, verification, bad paths and URIs."""

from __future__ import annotations

import hashlib
import json
import os

import blake3
import pytest

from validation_service.errors import CheckpointCorrupt, CheckpointNotFound, InvalidInput
from validation_service.storage import MANIFEST_NAME, CheckpointStorage, ray_checkpoint


@pytest.fixture
def source(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "model.pt").write_bytes(os.urandom(300_000))
    (src / "sub" / "opt.bin").write_bytes(b"optimizer-state")
    return src


@pytest.fixture
def storage(tmp_path):
    return CheckpointStorage(str(tmp_path / "store"))


def test_upload_writes_files_and_a_manifest_with_sizes_and_blake3(storage, source):
    persisted = storage.upload(source, "ns", "run", 3)
    assert persisted.uri.endswith("ns/run/checkpoint_000003")
    assert persisted.size_bytes == 300_000 + len(b"optimizer-state")
    manifest_bytes = open(os.path.join(persisted.uri, MANIFEST_NAME), "rb").read()
    assert hashlib.sha256(manifest_bytes).hexdigest() == persisted.manifest_sha256
    body = json.loads(manifest_bytes)
    assert body["algorithm"] == "blake3"
    assert body["files"]["sub/opt.bin"] == {
        "size": 15,
        "blake3": blake3.blake3(b"optimizer-state").hexdigest(),
    }
    assert (
        open(os.path.join(persisted.uri, "model.pt"), "rb").read()
        == (source / "model.pt").read_bytes()
    )
    assert (
        storage.verify(persisted.uri, persisted.manifest_sha256).total_size == persisted.size_bytes
    )
    assert not [p for p in os.listdir(os.path.dirname(persisted.uri)) if p.startswith(".staging")]


def test_an_empty_checkpoint_folder_is_stored_with_an_empty_manifest(storage, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    persisted = storage.upload(empty, "ns", "run", 0)
    assert persisted.size_bytes == 0
    assert os.listdir(persisted.uri) == [MANIFEST_NAME]
    assert storage.verify(persisted.uri, persisted.manifest_sha256).total_size == 0


def test_corrupt_and_missing_files_are_detected(storage, source):
    persisted = storage.upload(source, "ns", "run", 0)
    target = os.path.join(persisted.uri, "model.pt")
    data = bytearray(open(target, "rb").read())
    data[10] ^= 0xFF
    open(target, "wb").write(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="model.pt.*blake3"):
        storage.materialize(persisted.uri, persisted.manifest_sha256, "/tmp")
    open(target, "ab").write(b"x")
    with pytest.raises(CheckpointCorrupt, match="bytes"):
        storage.verify(persisted.uri, persisted.manifest_sha256)
    os.remove(target)
    with pytest.raises(CheckpointNotFound, match="model.pt"):
        storage.verify(persisted.uri, persisted.manifest_sha256)


def test_changed_manifest_and_missing_checkpoint(storage, source):
    persisted = storage.upload(source, "ns", "run", 0)
    with open(os.path.join(persisted.uri, MANIFEST_NAME), "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointCorrupt, match="manifest"):
        storage.verify(persisted.uri, persisted.manifest_sha256)
    with pytest.raises(CheckpointNotFound, match="not found"):
        storage.verify(storage.checkpoint_path("ns", "run", 99), None)
    storage.delete(persisted.uri, namespace="ns", run="run")
    assert not os.path.exists(persisted.uri)


def test_paths_outside_the_root_are_never_deleted(storage, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for uri in [str(outside), os.path.join(storage.root, "..", "elsewhere"), "/etc"]:
        with pytest.raises(InvalidInput, match="outside the storage root"):
            storage.delete(uri, namespace="ns", run="run")
    assert outside.is_dir()


def test_adopt_registers_a_checkpoint_already_in_storage(storage, source, tmp_path):
    import shutil

    in_place = os.path.join(storage.root, "ns", "run", "shards")
    shutil.copytree(source, in_place)
    persisted = storage.adopt(in_place, "ns", "run")
    assert persisted.size_bytes == 300_015
    storage.verify(persisted.uri, persisted.manifest_sha256)


def test_unsupported_uri_scheme_is_a_clear_error():
    with pytest.raises(InvalidInput, match="Unsupported storage URI 'nosuchfs://b/x'"):
        CheckpointStorage("nosuchfs://b/x")


def test_ray_checkpoint_of_a_stored_checkpoint(storage, source):
    persisted = storage.upload(source, "ns", "run", 0)
    checkpoint = ray_checkpoint(persisted.uri)
    with checkpoint.as_directory() as directory:
        assert (source / "model.pt").read_bytes() == open(f"{directory}/model.pt", "rb").read()
