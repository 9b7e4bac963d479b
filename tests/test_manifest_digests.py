"""Manifests name their digest: BLAKE3 for new copies, made in the copy's one pass;
SHA-256 manifests of earlier releases still verify; a digest ckval does not know, or one
that does not match, is one clear error naming the file."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import tracemalloc

import blake3
import pytest

from validation_service.errors import CheckpointCorrupt, InvalidInput
from validation_service.manifest import copy_file
from validation_service.storage import MANIFEST_NAME, CheckpointStorage


@pytest.fixture
def storage(tmp_path):
    return CheckpointStorage(str(tmp_path / "store"))


@pytest.fixture
def source(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "model.pt").write_bytes(os.urandom(1_000_000))
    (src / "sub" / "opt.bin").write_bytes(b"optimizer-state")
    return src


def write_manifest_of_an_earlier_release(folder) -> str:
    """The manifest as releases before BLAKE3 wrote it: version 1, SHA-256, no algorithm
    named; returns the SHA-256 of its bytes (what the registry keeps)."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        rel = path.relative_to(folder).as_posix()
        files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    body = {"version": 1, "files": files, "total_size": sum(e["size"] for e in files.values())}
    data = json.dumps(body, sort_keys=True, indent=1).encode()
    (folder / MANIFEST_NAME).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def stored_as_an_earlier_release_did(storage, source):
    folder = storage.root + "/ns/run/checkpoint_000000"
    os.makedirs(os.path.dirname(folder))
    import shutil

    shutil.copytree(source, folder)
    from pathlib import Path

    return folder, write_manifest_of_an_earlier_release(Path(folder))


def test_a_sha256_manifest_of_an_earlier_release_still_verifies_and_downloads(
    storage, source, tmp_path
):
    uri, digest = stored_as_an_earlier_release_did(storage, source)
    manifest = storage.verify(uri, digest)
    assert manifest.algorithm == "sha256"
    assert manifest.total_size == 1_000_015
    assert storage.materialize(uri, digest, str(tmp_path)) == uri  # local: read in place
    with open(os.path.join(uri, "model.pt"), "r+b") as f:
        f.write(b"\x00\x01\x02")
    with pytest.raises(CheckpointCorrupt, match=r"'model.pt' has a different sha256 digest"):
        storage.verify(uri, digest)


def test_a_changed_file_is_named_with_the_blake3_digest(storage, source):
    persisted = storage.upload(source, "ns", "run", 0)
    with open(os.path.join(persisted.uri, "sub", "opt.bin"), "r+b") as f:
        f.write(b"O")
    with pytest.raises(CheckpointCorrupt, match=r"'sub/opt.bin' has a different blake3 digest"):
        storage.verify(persisted.uri, persisted.manifest_sha256)


def test_a_manifest_naming_an_unknown_digest_is_one_clear_error(storage, source, tmp_path):
    persisted = storage.upload(source, "ns", "run", 0)
    path = os.path.join(persisted.uri, MANIFEST_NAME)
    body = json.loads(open(path, "rb").read())
    body["algorithm"] = "sha3-512"
    for entry in body["files"].values():
        entry["sha3-512"] = entry.pop("blake3")
    data = json.dumps(body).encode()
    with open(path, "wb") as f:
        f.write(data)
    digest = hashlib.sha256(data).hexdigest()
    named = (
        r"names the digest algorithm 'sha3-512', which this release of ckval does not "
        r"know \(it knows blake3, sha256\).*Upgrade ckval.*" + MANIFEST_NAME
    )
    with pytest.raises(InvalidInput, match=named):
        storage.verify(persisted.uri, digest)
    workdir = tmp_path / "work"
    workdir.mkdir()
    with pytest.raises(InvalidInput, match=named):
        storage.materialize(persisted.uri, digest, str(workdir))


def test_the_copy_reads_each_byte_once_and_writes_what_it_hashed(tmp_path):
    """A named pipe can be read once: a copy that read the file twice (a kernel copy,
    then hashing) would miss bytes."""
    content = os.urandom(3 * 1024 * 1024 + 17)
    fifo = tmp_path / "once"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "wb") as f:
            f.write(content)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    out = io.BytesIO()
    entry = copy_file(str(fifo), out)
    writer.join(timeout=10)
    assert out.getvalue() == content
    assert entry == {"size": len(content), "blake3": blake3.blake3(content).hexdigest()}


def test_a_copy_holds_one_fixed_buffer_whatever_the_file_size(tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(16):
            f.write(os.urandom(4 * 1024 * 1024))  # 64 MB
    tracemalloc.start()
    with open(tmp_path / "copy.bin", "wb") as out:
        copy_file(str(big), out)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1024 * 1024, f"the copy held {peak} bytes of Python memory at its peak"
    assert (tmp_path / "copy.bin").read_bytes() == big.read_bytes()
