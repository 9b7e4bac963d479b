"""report() inside a Ray Train worker: ckval stores and registers the checkpoint, and the
same ``ray.train.report`` call the training code would have made hands Ray Train a
pointer to it.

The call is made on the training thread, in program order, with the upload mode the
report asked for: Ray Train's rank sync, result queue and collectives happen exactly
where they would without ckval, so the training code's own ``ray.train.collective``
calls pair with each other as before. Ray Train's checkpoint for the report is a folder
holding only ``ckval_checkpoint.json``, written by ``checkpoint_upload_fn`` once ckval's
copy is registered (a report of several ranks: once it is sealed): Ray Train keeps it as
its latest checkpoint, and a restarted worker's ``ray.train.get_checkpoint()`` gives the
stored model files (``_resume.py``).
"""

from __future__ import annotations

import json
import logging
import os
import threading

from trainer_integration import _agreement
from trainer_integration._delivery import StoredReport, with_backoff
from trainer_integration._parts import ShardReporter, report_call
from trainer_integration._request import CheckpointUploadMode, PreparedReport

POINTER_FILE = "ckval_checkpoint.json"

logger = logging.getLogger(__name__)

_kept: set[str] = set()  # runs whose CheckpointConfig this process has applied
_kept_lock = threading.Lock()


def report_in_ray_train(context, reporter_of, prepared: PreparedReport, checkpoint) -> None:
    """One report() of a Ray Train worker; ``reporter_of(run)`` gives the run's reporter."""
    if context.get_world_size() > 1:
        _report_in_group(context, reporter_of, prepared, checkpoint)
        return
    if checkpoint is None:
        to_ray_train(prepared.metrics, prepared.mode)
        return
    reporter = reporter_of(context)
    keep_as_ray_would(reporter)
    if prepared.mode is CheckpointUploadMode.NO_UPLOAD:
        stored = StoredReport.finished(*reporter.report(prepared, checkpoint))
    else:
        # SYNC returns once ckval's own copy is stored and Ray Train holds the report (as
        # ray.train.report's SYNC); ASYNC at once.
        stored = reporter.store_and_register(
            prepared.metrics,
            checkpoint,
            prepared.job,
            delete_local=prepared.delete_local,
            copy_now=prepared.mode is CheckpointUploadMode.SYNC,
        )

    def outcome() -> Pointer:
        stored.stored.result()
        stored.registered.result()
        return Pointer(reporter.run, stored.index, stored.uri, complete=True)

    _hand_over(reporter, prepared, checkpoint, outcome)


def _report_in_group(context, reporter_of, prepared: PreparedReport, checkpoint) -> None:
    """A report of one rank of several: its folder is its part of the report (or it has
    none), and the rank that seals the report tells Ray Train where it is."""
    reporter = reporter_of(context)
    call = report_call(context)
    rank = context.get_world_rank()
    shards = ShardReporter(reporter, rank)
    agreed = _note_where_this_rank_reports(reporter, call)
    if checkpoint is None:
        shards.no_part(call)
        to_ray_train(prepared.metrics, prepared.mode)
        return
    keep_as_ray_would(reporter)
    try:
        part = shards.report(prepared, checkpoint, call)
    except Exception:
        # The other ranks are in this report too: keep in step with them.
        to_ray_train(prepared.metrics, prepared.mode)
        raise

    def outcome() -> Pointer | None:
        agreed()  # once every rank has said where it reports
        sealed = part.sealed.result()
        if sealed is None:
            return None  # another rank sealed it and tells Ray Train
        return Pointer(reporter.run, sealed.report_index, sealed.uri, sealed.complete)

    _hand_over(reporter, prepared, checkpoint, outcome)


def _note_where_this_rank_reports(reporter, call):
    """At a rank's first report in its worker group: writes where it reports beside Ray
    Train's run (``_agreement.py``), on the reporter's thread, since it needs the registry
    open (a new worker process opens it while training starts: never wait for it on the
    training thread). Returns the check its report makes before Ray Train is told of it,
    off the training thread in ASYNC mode (nothing to check at later reports, or in Ray
    Train's local mode)."""
    import ray.train

    if call.call != 1:
        return lambda: None
    try:
        storage = ray.train.get_context().get_storage()
    except NotImplementedError:  # local mode: no storage of Ray Train's to meet in
        return lambda: None

    def note() -> None:
        with_backoff(  # an unreachable registry is waited for, as for the report itself
            lambda: _agreement.note(storage, call.worker_group, reporter, call.rank),
            timeout_s=reporter.settings.delivery_timeout_s,
        )

    noted = reporter.submit("reserve", note)

    def check() -> None:
        noted.result()
        _agreement.check(
            storage,
            call.worker_group,
            call.rank,
            world_size=call.world_size,
            timeout_s=reporter.settings.delivery_timeout_s,
        )

    return check


def keep_as_ray_would(reporter) -> None:
    """Once per run and process: the run's ``CheckpointConfig(num_to_keep=K)`` becomes the
    run's retention policy in ckval (in the background). Ray Train ranks its checkpoints
    by what report() carried, which lacks the validated metrics; ckval keeps the K best
    of its copies by ``checkpoint_score_attribute`` once validated (the K newest without
    one), always the newest, and never one whose validation is still to come."""
    with _kept_lock:
        if reporter.run in _kept:
            return
        _kept.add(reporter.run)
    from validation_service._ray_compat import run_checkpoint_config

    config = run_checkpoint_config()
    keep = getattr(config, "num_to_keep", None)
    if keep is None:
        return
    metric = getattr(config, "checkpoint_score_attribute", None)
    if metric is None:  # Ray keeps the K newest: no metric ranks them
        rule = {"metric": "report_index", "keep_best_per_run": 0, "keep_latest": keep}
    else:
        mode = getattr(config, "checkpoint_score_order", "max")
        rule = {"metric": metric, "mode": mode, "keep_best_per_run": keep, "keep_latest": 1}

    def store() -> None:
        try:
            reporter.registry.set_retention(reporter.run, **rule)
        except Exception:  # noqa: BLE001 - checkpoints are kept; say why
            logger.warning("CheckpointConfig(num_to_keep=%s) not applied", keep, exc_info=True)

    reporter.submit("report", store)


class Pointer:
    """What Ray Train keeps in place of a stored checkpoint."""

    def __init__(self, run: str, report_index: int, uri: str, complete: bool):
        self.run, self.report_index, self.uri, self.complete = run, report_index, uri, complete

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "run": self.run,
                "report_index": self.report_index,
                "uri": self.uri,
                "complete": self.complete,
            }
        ).encode()


def _hand_over(reporter, prepared: PreparedReport, checkpoint, outcome) -> None:
    """``ray.train.report`` of this report, with a pointer to ckval's copy as the
    checkpoint; in Ray Train's local mode (no storage of its own) the stored checkpoint
    itself, once registered: fit() returns as soon as the loop does."""
    import ray.train

    try:
        storage = ray.train.get_context().get_storage()
    except NotImplementedError:
        from validation_service.storage import ray_checkpoint

        pointer = outcome()
        stored = None
        if pointer is not None and pointer.complete:
            stored = ray_checkpoint(pointer.uri, reporter.settings.storage_options)
        ray.train.report(prepared.metrics, checkpoint=stored)
        return

    def write_pointer(_checkpoint, checkpoint_dir_name: str):
        path = storage.build_checkpoint_path_from_name(checkpoint_dir_name)
        filesystem = storage.storage_filesystem
        pointer = outcome()
        if pointer is not None:
            filesystem.create_dir(path)
            with filesystem.open_output_stream(f"{path}/{POINTER_FILE}") as f:
                f.write(pointer.to_bytes())
            if pointer.complete:
                _link_stored_files(filesystem, path, pointer.uri)
        return ray.train.Checkpoint(filesystem=filesystem, path=path)

    to_ray_train(prepared.metrics, prepared.mode, checkpoint, write_pointer)


def _link_stored_files(filesystem, path: str, uri: str) -> None:
    """Where Ray Train's checkpoint folder and ckval's copy are on this machine's
    filesystem (both local, or one shared mount), links to the stored files beside the
    pointer: code that opens Ray Train's folder by file name (``model.pt``) finds the
    model files even where ckval was imported after ``ray.train.get_checkpoint()`` (which
    ckval follows to the stored checkpoint once imported: ``_resume.py``). Nothing is
    copied; ckval's retention of the stored copy leaves these links dangling, as it
    leaves the pointer."""
    import pyarrow.fs

    if not isinstance(filesystem, pyarrow.fs.LocalFileSystem) or not os.path.isdir(uri):
        return
    for name in os.listdir(uri):
        link = os.path.join(path, name)
        if name != POINTER_FILE and not os.path.lexists(link):
            os.symlink(os.path.join(uri, name), link)


def to_ray_train(metrics: dict, mode: CheckpointUploadMode, checkpoint=None, upload_fn=None):
    """``ray.train.report`` on the training thread, in the report's upload mode (ckval's
    NO_UPLOAD hands Ray Train a pointer, which it keeps as SYNC does)."""
    import ray.train

    ray_mode = ray.train.CheckpointUploadMode.ASYNC
    if mode is not CheckpointUploadMode.ASYNC:
        ray_mode = ray.train.CheckpointUploadMode.SYNC
    if checkpoint is None:
        ray.train.report(metrics, checkpoint_upload_mode=ray_mode)
        return
    ray.train.report(
        metrics,
        checkpoint=checkpoint,
        checkpoint_upload_mode=ray_mode,
        checkpoint_upload_fn=upload_fn,
        delete_local_checkpoint_after_upload=False,
    )
