"""Dask: PyTorch DDP launched on a Dask cluster, with its checkpoints and results sent to ckval.

``run`` starts one DDP process group over the workers; ``ResultsHandler`` replaces
dask-pytorch-ddp's ``DaskResultsHandler`` and ``S3ImageFolder`` its dataset of that name.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import json
import logging
import os
import posixpath
import queue
import re
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from validation_service.errors import CkvalError, InvalidInput

if TYPE_CHECKING:
    from trainer_integration._image_folder import FsspecImageFolder, S3ImageFolder

__all__ = [
    "FsspecImageFolder",
    "NoDaskWorkers",
    "ResultsHandler",
    "S3ImageFolder",
    "WorkerLost",
    "run",
]

logger = logging.getLogger(__name__)


# Names of another module, imported on first use: the image folders import torch and
# Pillow, which launching and results need not.
_LAZY_NAMES = {
    "FsspecImageFolder": "trainer_integration._image_folder",
    "S3ImageFolder": "trainer_integration._image_folder",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY_NAMES[name]), name)


# Results other than checkpoints travel through the Dask scheduler, which keeps the
# last events of each topic in memory: they must stay small. Checkpoints never do.
MAX_RESULT_BYTES = 1 << 20
CHECKPOINT_PATTERNS = ("checkpoint-*.pkl", "*.pt")
# How long process_results waits, after a rank failed, for the others to fail too.
PEER_FAILURE_GRACE_S = 5.0


class NoDaskWorkers(CkvalError, RuntimeError):
    """run() was called on a Dask cluster that has no workers."""

    def __init__(self, run_name: str, scheduler: str):
        self.run_name = run_name
        self.scheduler = scheduler
        super().__init__(
            f"The Dask cluster at {scheduler} has no workers, so run {run_name!r} cannot start "
            "a DDP process group. Start or scale workers first (client.wait_for_workers(n))."
        )


class WorkerLost(CkvalError, RuntimeError):
    """A rank's Dask worker left the cluster during the run: its process group is broken."""

    def __init__(self, run_name: str, rank: int, address: str):
        self.run_name = run_name
        self.rank = rank
        self.address = address
        super().__init__(
            f"Rank {rank} of run {run_name!r} lost its Dask worker {address} during the run; "
            "a DDP process group cannot take a new member. Checkpoints reported before are "
            "registered and validated: call run() again and resume from "
            f"Registry().latest_checkpoint({run_name!r})."
        )

    def __reduce__(self):
        # Raised on a worker and unpickled on the client: rebuilt from its fields.
        return type(self), (self.run_name, self.rank, self.address), self.__dict__


# ---------------------------------------------------------------------------- launching
def run(
    dask_client, fn: Callable[..., Any], *, run_name: str, backend: str = "gloo", **kwargs: Any
) -> list:
    """Runs ``fn(**kwargs)`` on every worker of the client's cluster as one DDP process group.

    Each rank gets MASTER_ADDR/MASTER_PORT (a free port on rank 0's worker), RANK,
    WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, joins ``init_process_group(backend)``
    and records into ``run_name``: ``trainer_integration.report(...)`` inside ``fn``
    works as inside Ray Train (rank 0 passes the checkpoint). The workers get this
    process's ckval settings (database URL, storage) with the task and need no Ray.
    Returns one future per rank, in rank order.
    """
    if not isinstance(run_name, str) or not run_name:
        raise InvalidInput(f"run_name must be a non-empty str, got {run_name!r}")
    if not callable(fn):
        raise InvalidInput(f"fn must be callable, got {type(fn).__name__}")
    workers = _ordered_workers(dask_client)
    if not workers:
        raise NoDaskWorkers(run_name, dask_client.scheduler.address)
    master_address, master_host = workers[0][0], workers[0][1]
    port = dask_client.run(_free_port, workers=[master_address])[master_address]
    env = driver_env()
    launch = uuid.uuid4().hex[:8]
    hosts = [host for _, host in workers]
    futures = []
    for rank, (address, host) in enumerate(workers):
        ddp_env = {
            "MASTER_ADDR": master_host,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(len(workers)),
            "LOCAL_RANK": str(hosts[:rank].count(host)),
            "LOCAL_WORLD_SIZE": str(hosts.count(host)),
        }
        futures.append(
            dask_client.submit(
                _run_rank,
                fn,
                kwargs,
                run_name=run_name,
                backend=backend,
                address=address,
                env={**env, **ddp_env},
                key=f"ckval-ddp-{run_name}-{launch}-rank-{rank}",
                workers=[address],
                # A task of a lost worker is sent elsewhere, where it fails at once with
                # WorkerLost instead of waiting forever for a worker that is gone.
                allow_other_workers=True,
                pure=False,
            )
        )
    return futures


def driver_env() -> dict[str, str]:
    """This process's ckval settings as CKVAL_* variables, with the embedded defaults settled.

    Workers use them as they are, whatever their own environment says: the registry and
    storage of a run are those of the process that launched it.
    """
    from validation_service.config import ckval_env, get_settings

    settings = get_settings()
    return {
        **ckval_env(include_secrets=True),
        "CKVAL_DATABASE_URL": settings.resolved_database_url(),
        "CKVAL_STORAGE": settings.resolved_storage(),
    }


def _ordered_workers(dask_client) -> list[tuple[str, str]]:
    """(address, host) of every worker, grouped by host: rank 0 is the first."""
    info = dask_client.scheduler_info(n_workers=-1)["workers"]
    workers = [(address, w.get("host") or _host_of(address)) for address, w in info.items()]
    return sorted(workers, key=lambda w: (w[1], w[0]))


def _host_of(address: str) -> str:
    return address.split("://")[-1].rsplit(":", 1)[0]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _run_rank(
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    *,
    run_name: str,
    backend: str,
    address: str,
    env: dict[str, str],
) -> Any:
    """One rank on its worker: settings, run, process group, then fn."""
    import distributed
    import torch.distributed as dist

    import trainer_integration

    rank = int(env["RANK"])
    if distributed.get_worker().address != address:
        raise WorkerLost(run_name, rank, address)
    os.environ.update(env)
    where = f"rank {rank} of {env['WORLD_SIZE']} (Dask worker {address}) of run {run_name!r}"
    try:
        trainer_integration.start_run(run_name, start_service=False)
        dist.init_process_group(backend, rank=rank, world_size=int(env["WORLD_SIZE"]))
        try:
            return fn(**kwargs)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        exc.add_note(f"raised on {where}")
        exc.ckval_dask_worker = address  # in __dict__: it travels with the exception
        raise


# ---------------------------------------------------------------------------- results
class ResultsHandler:
    """Drop-in for dask-pytorch-ddp's DaskResultsHandler that reports into a ckval run.

    On a worker, ``submit_result(path, data)``: a ``checkpoint-*.pkl`` or ``*.pt`` is
    stored and registered as a checkpoint of ``run_name`` (with its validation when
    ``validate_fn`` is given), by the worker itself; a JSON result of rank 0 becomes the
    reported metrics of its next checkpoint. Only a small notice goes through Dask's
    events. On the client, ``process_results(prefix, futures)`` writes every result
    under ``prefix`` (checkpoints copied from storage) and raises the workers' errors.
    """

    def __init__(
        self,
        run_name: str,
        validate_fn: Callable[..., dict] | str | None = None,
        validate_config: dict | None = None,
        validation_resources: dict | None = None,
    ):
        if not isinstance(run_name, str) or not run_name:
            raise InvalidInput(f"run_name must be a non-empty str, got {run_name!r}")
        if validate_fn is None and (validate_config or validation_resources):
            raise InvalidInput("validate_config and validation_resources need a validate_fn.")
        self.run_name = run_name
        self.validate_fn = validate_fn
        self.validate_config = validate_config
        self.validation_resources = validation_resources
        self.topic = f"ckval-results-{run_name}-{uuid.uuid4().hex}"
        # The settings of the process that made the handler travel with it to the
        # workers, also under dask-pytorch-ddp's own launcher.
        self.env = driver_env()

    def __repr__(self) -> str:
        return f"ResultsHandler({self.run_name!r})"

    # ------------------------------------------------------------ worker side
    def submit_result(self, path: str, data: bytes | str) -> None:
        """Publishes one result from a worker; a checkpoint is stored and registered first.

        Returns once a checkpoint is registered (its validation runs later, on the
        ckval service). Raises InvalidInput for data that is neither bytes nor str, for
        a path that is absolute or leaves the results folder, and for a checkpoint from
        a rank other than 0 (the run's checkpoints have one reporter, as in Ray Train).
        """
        _check_result_path(path)
        if isinstance(data, (bytearray, memoryview)):
            data = bytes(data)
        if not isinstance(data, (bytes, str)):
            raise InvalidInput(
                f"submit_result({path!r}, ...) takes bytes or str, got "
                f"{type(data).__name__}: pass pickle.dumps(obj) or json.dumps(obj)."
            )
        rank = _current_rank()
        notice: dict[str, Any] = {"id": uuid.uuid4().hex, "rank": rank, "path": path}
        if is_checkpoint_path(path):
            notice.update(self._report_checkpoint(path, data, rank))
        else:
            if len(data) > MAX_RESULT_BYTES:
                raise InvalidInput(
                    f"Result {path!r} is {len(data)} bytes; results other than checkpoints go "
                    f"through the Dask scheduler and must stay under {MAX_RESULT_BYTES}. Name "
                    "it checkpoint-<name>.pkl or <name>.pt to store it as a checkpoint."
                )
            if rank == 0 and path.endswith(".json"):
                _latest_metrics[self.topic] = _metrics_of(data)
            notice["data"] = data
        _publish(self.topic, notice)

    def _report_checkpoint(self, path: str, data: bytes | str, rank: int) -> dict[str, Any]:
        """Stores the file as a checkpoint folder of one file and registers it."""
        if rank != 0:
            raise InvalidInput(
                f"Checkpoint {path!r} was submitted by rank {rank}; submit checkpoints from "
                f"rank 0 only, which reports every checkpoint of run {self.run_name!r}."
            )
        from ray.train import Checkpoint

        name = posixpath.basename(path)
        client = self._client()
        metrics = _latest_metrics.pop(self.topic, None) or {}
        with tempfile.TemporaryDirectory(prefix="ckval-dask-") as directory:
            mode = "w" if isinstance(data, str) else "wb"
            with open(os.path.join(directory, name), mode) as f:
                f.write(data)
            index = client.report(
                metrics,
                Checkpoint.from_directory(directory),
                validate_fn=self.validate_fn,
                validate_config=self.validate_config,
                validation_resources=self.validation_resources,
            )
        [record] = [
            r for r in client.registry.checkpoints(self.run_name) if r.report_index == index
        ]
        return {"report_index": index, "uri": record.uri, "name": name}

    def _client(self):
        import trainer_integration

        os.environ.update(self.env)
        return trainer_integration.Client(self.run_name, start_service=False)

    # ------------------------------------------------------------ client side
    def process_results(self, prefix: str, futures: Iterable, raise_errors: bool = True) -> None:
        """Writes every result under ``prefix`` until all futures are done.

        Checkpoints are copied from ckval's storage to ``prefix/<path>``; other results are
        written as received. With ``raise_errors``, the first worker error is raised
        (after writing what had arrived); otherwise it is logged and the rest collected.
        """
        import distributed

        futures = list(futures)
        client = futures[0].client if futures else distributed.get_client()
        received: queue.SimpleQueue = queue.SimpleQueue()
        writer = _ResultWriter(prefix, self.env)
        client.subscribe_topic(self.topic, received.put)
        try:
            writer.write_all(client.get_events(self.topic))
            failure = _wait_writing(futures, received, writer, raise_errors)
            writer.write_all(_drained(received))
            writer.write_all(client.get_events(self.topic))
        finally:
            with contextlib.suppress(ValueError):
                client.unsubscribe_topic(self.topic)
        if failure is not None:
            failure.result()  # raises the worker's exception with its traceback


_latest_metrics: dict[str, dict[str, Any]] = {}


def is_checkpoint_path(path: str) -> bool:
    """Whether a submitted result is a checkpoint: ``checkpoint-*.pkl`` or ``*.pt``."""
    name = posixpath.basename(path)
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in CHECKPOINT_PATTERNS)


def _check_result_path(path: str) -> None:
    """Refuses a result path that would be written outside the results folder.

    Any character a POSIX file name may hold is allowed (``checkpoint-{isoformat()}.pkl``
    holds ``:``). Refused: absolute paths, ``..`` parts (``/`` and ``\\`` both separate
    parts, as on Windows clients) and a Windows drive (``C:`` as the first part, or
    ``C:`` and a separator), which ``os.path.join(prefix, path)`` would not keep under the
    prefix. On a Windows client the writer also refuses a drive-relative ``C:name``.
    """
    if not isinstance(path, str) or not path or path.endswith(("/", "\\")) or "\0" in path:
        raise InvalidInput(f"a result path must be a non-empty file path, got {path!r}")
    parts = path.replace("\\", "/").split("/")
    if path.startswith(("/", "\\")) or ".." in parts or _WINDOWS_DRIVE.match(path):
        raise InvalidInput(
            f"result path {path!r} must stay inside the results folder: a relative path "
            "without '..' or a drive, such as 'worker/0/data.json'."
        )


_WINDOWS_DRIVE = re.compile(r"[A-Za-z]:(?:[/\\]|$)")


def _current_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _metrics_of(data: bytes | str) -> dict[str, Any] | None:
    """The scalar entries of a JSON object, or None for JSON that is not an object."""
    try:
        value = json.loads(data)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return {k: v for k, v in value.items() if isinstance(v, (int, float, str, bool))}


def _publish(topic: str, notice: dict[str, Any]) -> None:
    import distributed

    try:
        worker = distributed.get_worker()
    except ValueError:  # not in a Dask task: the process's own client publishes
        distributed.get_client().log_event(topic, notice)
        return
    worker.log_event(topic, notice)


def _wait_writing(futures: list, received: queue.SimpleQueue, writer, raise_errors: bool):
    """Writes results as they come until every future is done; the failed one to raise."""
    import distributed

    pending = futures
    while pending:
        writer.write_all(_drained(received))
        try:
            done, pending = distributed.wait(pending, timeout=0.2, return_when="FIRST_COMPLETED")
        except TimeoutError:
            continue
        pending = list(pending)
        failed = [future for future in done if future.status == "error"]
        if failed and raise_errors:
            return _root_failure(failed, pending, received, writer)
        for future in failed:
            logger.error("%s failed: %r", future.key, future.exception())
    return None


def _root_failure(failed: list, pending: list, received: queue.SimpleQueue, writer):
    """The failure to raise: the rank that failed first, not the peers that lost it.

    When one rank fails, the others fail within moments with a broken process group
    (gloo: "Connection closed by peer"); waiting PEER_FAILURE_GRACE_S for them lets the
    error raised be the cause.
    """
    import distributed

    if pending:
        with contextlib.suppress(TimeoutError):
            distributed.wait(pending, timeout=PEER_FAILURE_GRACE_S)
        still_running = [future for future in pending if not future.done()]
        if still_running:
            # A rank that raised keeps its gloo connections open while its worker process
            # lives, and the other ranks wait in their next collective until gloo's
            # 30-minute timeout: restarting the failed ranks' workers closes them.
            _restart_workers_of([f for f in failed if not _is_peer_failure(f.exception())])
            with contextlib.suppress(TimeoutError):
                distributed.wait(still_running, timeout=PEER_FAILURE_GRACE_S)
        writer.write_all(_drained(received))
        failed += [future for future in pending if future.status == "error"]
    causes = [future for future in failed if not _is_peer_failure(future.exception())]
    return (causes or failed)[0]


def _restart_workers_of(failed: list) -> None:
    addresses = {getattr(f.exception(), "ckval_dask_worker", None) for f in failed} - {None}
    if not addresses:
        return
    logger.warning(
        "restarting Dask worker(s) %s, whose rank failed, so that the other ranks stop "
        "waiting for it",
        sorted(addresses),
    )
    try:
        failed[0].client.restart_workers(sorted(addresses), timeout=15)
    except Exception:  # noqa: BLE001 - best effort: the peers then end at gloo's timeout
        logger.warning("could not restart Dask worker(s) %s", sorted(addresses), exc_info=True)


def _is_peer_failure(exc: BaseException) -> bool:
    """Whether a rank failed only because another rank of its process group did."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and any(
        sign in message for sign in ("Connection closed by peer", "Connection reset by peer")
    )


def _drained(received: queue.SimpleQueue) -> list:
    events = []
    with contextlib.suppress(queue.Empty):
        while True:
            events.append(received.get_nowait())
    return events


class _ResultWriter:
    """Writes each notice once under the results folder, as DaskResultsHandler did."""

    def __init__(self, prefix: str, env: dict[str, str]):
        self.prefix = prefix
        self.storage_options = json.loads(env.get("CKVAL_STORAGE_OPTIONS") or "{}")
        self.seen: set[str] = set()
        self._lock = threading.Lock()

    def write_all(self, events) -> None:
        for _, notice in events:
            with self._lock:
                if notice["id"] in self.seen:
                    continue
                self.seen.add(notice["id"])
            self.write(notice)

    def write(self, notice: dict[str, Any]) -> None:
        target = os.path.join(self.prefix, notice["path"])
        inside = os.path.abspath(self.prefix)
        if os.path.commonpath([inside, os.path.abspath(target)]) != inside:
            # Only a Windows client gets here (a drive-relative "C:name").
            logger.error("result %r is not written: it names a place outside %s", target, inside)
            return
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        if "uri" in notice:
            self._copy_stored(notice, target)
            return
        data = notice["data"]
        mode = "w" if isinstance(data, str) else "wb"
        with open(target, mode) as f:
            f.write(data)

    def _copy_stored(self, notice: dict[str, Any], target: str) -> None:
        # The bytes come from ckval's storage, never through the scheduler.
        import fsspec

        fs, root = fsspec.core.url_to_fs(notice["uri"], **self.storage_options)
        try:
            fs.get_file(posixpath.join(root, notice["name"]), target)
        except OSError:
            logger.warning(
                "checkpoint %s (report %s) is registered but could not be copied to %s",
                notice["uri"],
                notice["report_index"],
                target,
                exc_info=True,
            )
