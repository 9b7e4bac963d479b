"""Every rank of a worker group reports into one registry and one storage.

A rank on another node resolves its own settings: without CKVAL_DATABASE_URL and
CKVAL_STORAGE reaching it, a node-local default (an SQLite file, a local folder under
its CKVAL_HOME) that is not the one the other ranks use. Its parts would then be
recorded where the sealing rank never looks. So each rank's first report in a worker
group writes where it reports (the registry's id, the storage's id, its node) beside Ray
Train's run, on its reporter's thread once its registry is open; and each rank that
hands Ray Train a checkpoint compares them once every rank of the group has written (or
the delivery timeout passed: a rank that died writes nothing, and its report never
becomes a checkpoint anyway), failing that first report with an error that names both
places.
"""

from __future__ import annotations

import json
import socket
import time

from validation_service.errors import InvalidInput

FOLDER = ".ckval-ranks"
# The longest pause between two listings of the ranks' notes while some are missing.
MAX_PAUSE_S = 0.25


def where_i_report(reporter, rank: int) -> dict:
    """This rank's registry and storage, by id, and its node."""
    import ray

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "node_id": node,
        "registry": reporter.writer.ledger.registry_identity(),
        "registry_url": reporter.writer.db.display_url,
        "storage": reporter.storage.identity(),
        "storage_uri": reporter.storage.root_uri,
    }


def _folder(storage, worker_group: str) -> str:
    return f"{storage.experiment_fs_path.rstrip('/')}/{FOLDER}/{worker_group}"


def _written(storage, worker_group: str) -> list[dict]:
    """What the ranks of the worker group wrote so far."""
    import pyarrow.fs

    filesystem = storage.storage_filesystem
    selector = pyarrow.fs.FileSelector(_folder(storage, worker_group), allow_not_found=True)
    found = []
    for info in filesystem.get_file_info(selector):
        name = info.path.rsplit("/", 1)[-1]
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue  # a note still being written (note() renames it when whole)
        with filesystem.open_input_stream(info.path) as f:
            found.append(json.loads(f.read()))
    return found


def note(storage, worker_group: str, reporter, rank: int) -> None:
    """Writes where this rank reports, for its worker group (Ray Train's ``storage``)."""
    folder, filesystem = _folder(storage, worker_group), storage.storage_filesystem
    filesystem.create_dir(folder)
    # Written whole, then named: another rank may list the folder at any moment.
    partial = f"{folder}/.rank-{rank}.json.partial"
    with filesystem.open_output_stream(partial) as f:
        f.write(json.dumps(where_i_report(reporter, rank)).encode())
    filesystem.move(partial, f"{folder}/rank-{rank}.json")


def check(storage, worker_group: str, rank: int, *, world_size: int, timeout_s: float) -> None:
    """Raises InvalidInput when a rank of the worker group reports into another registry
    or storage than this rank does (naming both). Waits up to ``timeout_s`` for all
    ``world_size`` ranks to have written; ranks that wrote nothing by then are skipped."""
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    found = _written(storage, worker_group)
    while len(found) < world_size and time.monotonic() + pause < deadline:
        time.sleep(pause)
        pause = min(pause * 2, MAX_PAUSE_S)
        found = _written(storage, worker_group)
    mine = next((w for w in found if w["rank"] == rank), None)
    if mine is None:
        return
    for other in sorted(found, key=lambda w: w["rank"]):
        for what, place in (("registry", "registry_url"), ("storage", "storage_uri")):
            if other[what] != mine[what]:
                raise InvalidInput(_split(what, place, mine, other))


_PLURAL = {"registry": "registries", "storage": "storages"}


def _split(what: str, place: str, mine: dict, other: dict) -> str:
    return (
        f"the ranks of this Ray Train run report into different {_PLURAL[what]}: rank "
        f"{mine['rank']} (node {mine['host']}) into {mine[place]!r}, rank {other['rank']} "
        f"(node {other['host']}) into {other[place]!r}, another {what} although the "
        "address may read alike (a node's own default under its CKVAL_HOME). A checkpoint "
        "is never split across them: give every node the same CKVAL_DATABASE_URL and "
        "CKVAL_STORAGE (a shared database and storage, e.g. PostgreSQL and S3), e.g. with "
        "ray.init(runtime_env={'env_vars': validation_service.config.ckval_env()}); "
        "this report was not registered."
    )
