"""Storage safety: names and paths confined to the storage root, manifests that cannot
point elsewhere, verification that notices added files, and symlinks in checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import uuid

import pytest
from ray.train import Checkpoint

from tests.test_s3 import BUCKET, options_for, s3_endpoint  # noqa: F401 - moto's S3 fixture
from trainer_integration import CheckpointUploadMode, Client
from trainer_integration._reporter import RunReporter
from validation_service.config import Settings, get_settings
from validation_service.errors import (
    CheckpointCorrupt,
    CheckpointExists,
    CheckpointNotFound,
    InvalidInput,
    InvalidSettings,
)
from validation_service.names import check_name
from validation_service.registry.registry import Registry
from validation_service.signing import key_file
from validation_service.storage import MANIFEST_NAME, CheckpointStorage

TRAVERSING_NAMES = ["../../../outside", "..", "../outside", "/abs/outside", "a/../../outside"]


@pytest.fixture
def source(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "model.pt").write_bytes(b"model-weights" * 100)
    (src / "sub" / "opt.bin").write_bytes(b"optimizer-state")
    return src


@pytest.fixture
def layout(tmp_path):
    """A storage root nested deep enough that '../../../outside' lands in tmp_path."""
    root = tmp_path / "deep" / "er" / "store"
    root.mkdir(parents=True)
    return CheckpointStorage(str(root)), tmp_path


def everything_under(path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), path) for d, _, files in os.walk(path) for f in files
    )


# ------------------------------------------------------------------------------ names
@pytest.mark.parametrize("bad", [*TRAVERSING_NAMES, ".hidden", "a b", "x" * 129, "", "ü"])
def test_check_name_refuses_unsafe_names_saying_the_rule(bad):
    with pytest.raises(InvalidInput, match=r"run name .* is not allowed: use 1 to 128 char"):
        check_name("run name", bad)


def test_check_name_accepts_rays_default_run_names():
    for good in ["ray_train_run-2026-11-22_10-31-07", "digits", "exp.v2", "a" * 128, "-x"]:
        assert check_name("run name", good) == good


@pytest.mark.parametrize("bad", ["../../../x", "/abs/x", "a/b"])
def test_ckval_namespace_that_leaves_the_root_fails_at_settings_load(monkeypatch, bad):
    monkeypatch.setenv("CKVAL_NAMESPACE", bad)
    with pytest.raises(InvalidSettings, match=r"CKVAL_NAMESPACE .* is not allowed"):
        Settings()


@pytest.mark.parametrize("bad", TRAVERSING_NAMES)
def test_upload_with_a_traversing_namespace_writes_nothing(layout, source, bad):
    storage, tmp_path = layout
    with pytest.raises(InvalidInput, match="namespace"):
        storage.upload(source, bad, "run", 0)
    assert not (tmp_path / "outside").exists()
    assert not os.path.exists("/abs")
    assert everything_under(storage.root) == []


@pytest.mark.parametrize("bad", TRAVERSING_NAMES)
def test_upload_with_a_traversing_run_name_writes_nothing(layout, source, bad):
    storage, tmp_path = layout
    with pytest.raises(InvalidInput, match="run name"):
        storage.upload(source, "ns", bad, 0)
    assert not (tmp_path / "outside").exists()
    assert everything_under(storage.root) == []


@pytest.mark.parametrize("bad", ["../../../outside", "/abs/outside"])
def test_client_with_a_traversing_run_name_is_refused_before_anything_is_written(tmp_path, bad):
    home = tmp_path / "deep" / "er" / "home"
    settings = get_settings(home=str(home))
    with pytest.raises(InvalidInput, match="run name .* is not allowed"):
        Client(bad, settings, start_service=False)
    with pytest.raises(InvalidInput, match="run name .* is not allowed"):
        RunReporter(bad, settings, start_service=False)
    assert not (tmp_path / "outside").exists()
    assert not home.exists()  # not even the registry was opened


def test_registry_refuses_a_traversing_namespace_and_run(tmp_path):
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with pytest.raises(InvalidInput, match="namespace '../x' is not allowed"):
        Registry(url, namespace="../x")
    registry = Registry(url)
    with pytest.raises(InvalidInput, match="run name '../x' is not allowed"):
        registry.ledger.ensure_run("../x", storage_root=str(tmp_path))
    assert registry.runs() == []


def test_a_run_folder_symlinked_out_of_the_root_is_refused(layout, source):
    """realpath, not the spelling of the path, decides what is inside the root."""
    storage, tmp_path = layout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.makedirs(os.path.join(storage.root, "ns"))
    os.symlink(elsewhere, os.path.join(storage.root, "ns", "run"))
    with pytest.raises(InvalidInput, match="outside the storage root.*resolves to"):
        storage.upload(source, "ns", "run", 0)
    assert everything_under(elsewhere) == []


def test_delete_through_a_symlink_out_of_the_root_is_refused(layout):
    storage, tmp_path = layout
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("keep")
    os.makedirs(os.path.join(storage.root, "ns", "run"))
    link = os.path.join(storage.root, "ns", "run", "checkpoint_000000")
    os.symlink(precious, link)
    with pytest.raises(InvalidInput, match="outside the storage root"):
        storage.delete(link, namespace="ns", run="run")
    with pytest.raises(InvalidInput, match="outside the storage root"):
        storage.verify(link, None)
    assert (precious / "keep.txt").read_text() == "keep"


def test_the_storage_root_itself_is_no_checkpoint(layout):
    storage, _ = layout
    with pytest.raises(InvalidInput, match="outside the storage root"):
        storage.delete(storage.root, namespace="ns", run="run")
    assert os.path.isdir(storage.root)


def test_an_existing_checkpoint_folder_is_never_overwritten(layout, source, tmp_path):
    storage, _ = layout
    first = storage.upload(source, "ns", "run", 0)
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.pt").write_bytes(b"another model")
    with pytest.raises(CheckpointExists, match="nothing was overwritten"):
        storage.upload(other, "ns", "run", 0)
    storage.verify(first.uri, first.manifest_sha256)  # the first is intact


# -------------------------------------------------------------------------- manifests
def rewrite_manifest(directory: str, files: dict) -> str:
    data = json.dumps({"version": 1, "files": files}).encode()
    with open(os.path.join(directory, MANIFEST_NAME), "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("entry", ["/tmp/ckval-escaped.txt", "../../escaped.txt", "a/../b"])
def test_a_local_manifest_with_an_unsafe_entry_is_refused(layout, source, entry):
    storage, _ = layout
    persisted = storage.upload(source, "ns", "run", 0)
    digest = rewrite_manifest(persisted.uri, {entry: {"size": 1, "sha256": "0" * 64}})
    with pytest.raises(CheckpointCorrupt, match=rf"lists '{entry}'.*nothing was read or written"):
        storage.materialize(persisted.uri, digest, "/tmp")


@pytest.mark.parametrize("entry", ["/escaped-abs.txt", "../../../escaped-up.txt"])
def test_an_s3_manifest_with_an_unsafe_entry_writes_nothing_on_download(
    s3_endpoint,  # noqa: F811 - the fixture imported above
    source,
    tmp_path,
    entry,
):
    storage = CheckpointStorage(
        f"s3://{BUCKET}/unsafe-{uuid.uuid4().hex}", options_for(s3_endpoint)
    )
    persisted = storage.upload(source, "ns", "run", 0)
    path = storage.path_of(persisted.uri)
    content = b"written where it should not be"
    body = {entry: {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}}
    data = json.dumps({"version": 1, "files": body}).encode()
    storage.fs.pipe(f"{path}/{MANIFEST_NAME}", data)
    workdir = tmp_path / "a" / "b" / "work"
    workdir.mkdir(parents=True)
    with pytest.raises(CheckpointCorrupt, match=rf"lists '{entry}'"):
        storage.materialize(persisted.uri, hashlib.sha256(data).hexdigest(), str(workdir))
    assert not os.path.exists("/escaped-abs.txt")
    assert everything_under(tmp_path / "a") == []
    assert not (tmp_path / "escaped-up.txt").exists()


def test_extra_file_fails_verification_naming_it(layout, source):
    storage, _ = layout
    persisted = storage.upload(source, "ns", "run", 0)
    with open(os.path.join(persisted.uri, "sub", "injected.py"), "w") as f:
        f.write("import os")
    with pytest.raises(
        CheckpointCorrupt, match=r"not in the manifest were added: 'sub/injected.py'"
    ):
        storage.verify(persisted.uri, persisted.manifest_sha256)
    with pytest.raises(CheckpointCorrupt, match="sub/injected.py"):
        storage.materialize(persisted.uri, persisted.manifest_sha256, "/tmp")


def test_missing_file_fails_verification_naming_it(layout, source):
    storage, _ = layout
    persisted = storage.upload(source, "ns", "run", 0)
    os.remove(os.path.join(persisted.uri, "sub", "opt.bin"))
    with pytest.raises(CheckpointNotFound, match=r"are missing: 'sub/opt.bin'"):
        storage.verify(persisted.uri, persisted.manifest_sha256)


def test_changed_file_fails_verification_naming_it(layout, source):
    storage, _ = layout
    persisted = storage.upload(source, "ns", "run", 0)
    with open(os.path.join(persisted.uri, "model.pt"), "r+b") as f:
        f.write(b"M")  # same size, other bytes
    with pytest.raises(CheckpointCorrupt, match=r"'model.pt' has a different blake3 digest"):
        storage.verify(persisted.uri, persisted.manifest_sha256)


def test_added_and_removed_files_are_all_named(layout, source):
    storage, _ = layout
    persisted = storage.upload(source, "ns", "run", 0)
    os.remove(os.path.join(persisted.uri, "model.pt"))
    open(os.path.join(persisted.uri, "extra-1"), "w").close()
    open(os.path.join(persisted.uri, "extra-2"), "w").close()
    with pytest.raises(CheckpointCorrupt) as raised:
        storage.verify(persisted.uri, persisted.manifest_sha256)
    message = str(raised.value)
    assert "missing: 'model.pt'" in message and "added: 'extra-1', 'extra-2'" in message


def test_an_added_empty_folder_fails_verification_like_an_added_file(layout, source):
    storage, _ = layout
    persisted = storage.upload(source, "ns", "run", 0)
    os.makedirs(os.path.join(persisted.uri, "plugins", "autoload"))
    with pytest.raises(
        CheckpointCorrupt, match=r"not in the manifest were added: 'plugins/autoload/'"
    ):
        storage.verify(persisted.uri, persisted.manifest_sha256)


def test_empty_folders_reported_with_a_checkpoint_are_kept_and_checked(layout, source):
    storage, _ = layout
    (source / "logs" / "empty").mkdir(parents=True)
    persisted = storage.upload(source, "ns", "run", 0)
    assert os.path.isdir(os.path.join(persisted.uri, "logs", "empty"))
    storage.verify(persisted.uri, persisted.manifest_sha256)
    os.rmdir(os.path.join(persisted.uri, "logs", "empty"))
    with pytest.raises(CheckpointCorrupt, match=r"missing: 'logs/empty/'.*added: 'logs/'"):
        storage.verify(persisted.uri, persisted.manifest_sha256)


def modes_under(path) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(folder, name), path): stat.S_IMODE(
            os.stat(os.path.join(folder, name)).st_mode
        )
        for folder, folders, files in os.walk(path)
        for name in [*folders, *files]
    }


def test_home_checkpoint_folders_and_files_are_owner_only_from_the_first_use(tmp_path):
    """A fresh CKVAL_HOME made by the signing key's file, then the checkpoints a report
    stores under it, with the usual umask 022: nothing is readable by others."""
    home = tmp_path / "fresh" / "home"
    previous = os.umask(0o022)
    try:
        key_file(home)
        settings = Settings(home=home, database_url=f"sqlite:///{tmp_path / 'r.db'}")
        source = tmp_path / "model"
        (source / "sub").mkdir(parents=True)
        (source / "sub" / "weights.bin").write_bytes(b"w")
        in_place = home / "checkpoints" / "default" / "modes" / "shards"
        client = Client("modes", settings, start_service=False)
        client.report({"step": 1}, Checkpoint.from_directory(str(source)))
        in_place.mkdir(mode=0o755)
        (in_place / "part.bin").write_bytes(b"p")
        client.report(
            {"step": 2},
            Checkpoint.from_directory(str(in_place)),
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(home.parent).st_mode) == 0o700
    modes = modes_under(home)
    stored = {
        path: mode
        for path, mode in modes.items()
        if not path.startswith("checkpoints/default/modes/shards")
    }
    assert {mode for path, mode in stored.items() if os.path.isdir(home / path)} == {0o700}, modes
    assert {mode for path, mode in stored.items() if os.path.isfile(home / path)} == {0o600}, modes
    assert modes[f"checkpoints/default/modes/shards/{MANIFEST_NAME}"] == 0o600


def test_extra_file_on_s3_fails_verification_naming_it(
    s3_endpoint,  # noqa: F811 - the fixture imported above
    source,
    tmp_path,
):
    storage = CheckpointStorage(f"s3://{BUCKET}/extra", options_for(s3_endpoint))
    persisted = storage.upload(source, "ns", "run", 0)
    storage.materialize(persisted.uri, persisted.manifest_sha256, str(tmp_path))
    storage.fs.pipe(f"{storage.path_of(persisted.uri)}/planted.bin", b"x")
    with pytest.raises(CheckpointCorrupt, match="added: 'planted.bin'"):
        storage.materialize(persisted.uri, persisted.manifest_sha256, str(tmp_path))


# --------------------------------------------------------------------------- symlinks
def test_symlinked_folder_and_file_inside_the_checkpoint_are_copied_as_content(layout, source):
    storage, _ = layout
    os.symlink("sub", source / "sub-alias")  # a folder link, relative, inside
    os.symlink(source / "model.pt", source / "model-alias.pt")  # a file link, absolute, inside
    persisted = storage.upload(source, "ns", "run", 0)
    stored = persisted.uri
    assert everything_under(stored) == sorted(
        [MANIFEST_NAME, "model-alias.pt", "model.pt", "sub/opt.bin", "sub-alias/opt.bin"]
    )
    assert not any(os.path.islink(os.path.join(stored, p)) for p in os.listdir(stored))
    assert (source / "sub" / "opt.bin").read_bytes() == open(
        os.path.join(stored, "sub-alias", "opt.bin"), "rb"
    ).read()
    assert persisted.size_bytes == 2 * (1300 + 15)
    storage.verify(persisted.uri, persisted.manifest_sha256)


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_symlink_out_of_the_checkpoint_is_refused(layout, source, tmp_path, kind):
    storage, _ = layout
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "key").write_text("private")
    target = secrets if kind == "folder" else secrets / "key"
    os.symlink(target, source / "leak")
    with pytest.raises(InvalidInput, match=r"'leak' is a symlink to .*outside the checkpoint"):
        storage.upload(source, "ns", "run", 0)
    assert everything_under(storage.root) == []


def test_dangling_symlink_is_refused(layout, source):
    storage, _ = layout
    os.symlink(source / "gone", source / "dangling")
    with pytest.raises(InvalidInput, match="'dangling' is a symlink to .*which does not exist"):
        storage.upload(source, "ns", "run", 0)
    assert everything_under(storage.root) == []


def test_symlink_cycle_is_refused(layout, source):
    storage, _ = layout
    os.symlink("..", source / "sub" / "up")
    with pytest.raises(InvalidInput, match=r"'sub/up' is a symlink to a folder that contains it"):
        storage.upload(source, "ns", "run", 0)
    assert everything_under(storage.root) == []


def test_client_report_of_a_folder_with_links_stores_their_content(tmp_path, unique_run, source):
    from ray.train import Checkpoint

    settings = get_settings(home=str(tmp_path / "home"))
    os.symlink("sub", source / "sub-alias")
    client = Client(unique_run, settings, start_service=False)
    index = client.report({"step": 1}, Checkpoint.from_directory(str(source)))
    [record] = client.registry.checkpoints(unique_run)
    assert record.report_index == index
    assert os.path.isfile(os.path.join(record.uri, "sub-alias", "opt.bin"))
    os.symlink(tmp_path, source / "leak")
    with pytest.raises(InvalidInput, match="'leak' is a symlink"):
        client.report({"step": 2}, Checkpoint.from_directory(str(source)))
    assert [r.report_index for r in client.registry.checkpoints(unique_run)] == [index]
    # The refused report reserved no index: the next one follows on.
    os.remove(source / "leak")
    assert client.report({"step": 3}, Checkpoint.from_directory(str(source))) == index + 1


# ----------------------------------------------------------------------------- remote
def test_s3_paths_outside_the_root_are_refused_before_anything_moves(
    s3_endpoint,  # noqa: F811 - the fixture imported above
    source,
):
    storage = CheckpointStorage(f"s3://{BUCKET}/confined/root", options_for(s3_endpoint))
    storage.fs.pipe(f"{BUCKET}/confined/neighbour/keep.txt", b"keep")
    for uri in [
        f"s3://{BUCKET}/confined/neighbour",
        f"s3://{BUCKET}/confined/root/../neighbour",
        f"s3://{BUCKET}/confined/root",
        "/etc",
    ]:
        with pytest.raises(InvalidInput, match="outside the storage root|not on the storage"):
            storage.delete(uri, namespace="ns", run="run")
    for namespace, run in [("..", "neighbour"), ("ns", "../../neighbour")]:
        with pytest.raises(InvalidInput, match="not allowed"):
            storage.upload(source, namespace, run, 0)
    assert storage.fs.cat(f"{BUCKET}/confined/neighbour/keep.txt") == b"keep"
    storage.fs.invalidate_cache()
    assert storage.fs.find(f"{BUCKET}/confined/neighbour") == [
        f"{BUCKET}/confined/neighbour/keep.txt"
    ]
    assert not storage.fs.exists(f"{BUCKET}/confined/root")


def test_copying_a_checkpoint_back_keeps_working(layout, source, tmp_path):
    """A stored checkpoint (manifest included) reported again is stored afresh."""
    storage, _ = layout
    first = storage.upload(source, "ns", "run", 0)
    again = tmp_path / "again"
    shutil.copytree(first.uri, again)
    second = storage.upload(again, "ns", "run", 1)
    assert second.manifest_sha256 == first.manifest_sha256
