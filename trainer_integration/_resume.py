"""Ray Train's checkpoints of ckval's reports are pointers to the stored ones: here they
are followed back to the model files, for the user (``resolve_checkpoint``) and for the
workers Ray Train restarts (``ray.train.get_checkpoint()`` after a failure).

A pointer of a report that never became a checkpoint (a rank's part failed, or a rank
died first: INCOMPLETE) is never resumed from: a restarted worker gets the run's latest
checkpoint reported before it, as if that report had not been made.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

from trainer_integration._ray_train import POINTER_FILE

logger = logging.getLogger(__name__)

_resolved: dict[str, object] = {}  # Ray Train's checkpoint path -> what it resolves to
_resolved_lock = threading.Lock()


def read_pointer(checkpoint) -> dict | None:
    """The pointer a Ray Train checkpoint holds, or None when it is no pointer."""
    import pyarrow.fs

    path = f"{checkpoint.path.rstrip('/')}/{POINTER_FILE}"
    filesystem = checkpoint.filesystem
    if filesystem.get_file_info(path).type != pyarrow.fs.FileType.File:
        return None
    with filesystem.open_input_stream(path) as f:
        return json.loads(f.read())


def resolve_checkpoint(checkpoint):
    """Follows the pointer checkpoint that report() gave Ray Train to the stored one.

    ``resolve_checkpoint(result.checkpoint)`` gives the checkpoint with the model files.
    A checkpoint that is no pointer is returned unchanged; a pointer of a report that
    never became a checkpoint (INCOMPLETE) gives the run's latest checkpoint before it
    (None if there is none).
    """
    pointer = read_pointer(checkpoint)
    if pointer is None:
        return checkpoint
    return _stored(pointer)


def _stored(pointer: dict):
    from trainer_integration._service_link import resolve_settings
    from validation_service.storage import ray_checkpoint

    settings = resolve_settings()
    if pointer.get("complete", True):
        return ray_checkpoint(pointer["uri"], settings.storage_options)
    from trainer_integration._imports import import_once

    registry = import_once("validation_service.registry.registry").Registry(settings=settings)
    try:
        earlier = registry.latest_checkpoint(pointer["run"], before=pointer["report_index"])
    finally:
        registry.close()
    logger.warning(
        "report %s of run %r never became a checkpoint (a rank's part failed or a rank "
        "died first): resuming from %s",
        pointer["report_index"],
        pointer["run"],
        "its latest checkpoint before it" if earlier is not None else "the start",
    )
    return earlier


def resume_with_model_files() -> None:
    """In a Ray Train worker that Ray Train started with a checkpoint (a restart after a
    failure, or a run resumed from storage): makes ``ray.train.get_checkpoint()`` give
    the stored model files instead of ckval's pointer, as Ray Train's own checkpoint
    would. Does nothing elsewhere; a pointer that cannot be followed is left as it is."""
    if "ray.train" not in sys.modules:
        return
    from validation_service import _ray_compat

    _ray_compat.follow_resume_checkpoint(_follow)


def _follow(checkpoint):
    """What a worker's ``ray.train.get_checkpoint()`` gives for Ray Train's checkpoint."""
    if checkpoint is None:
        return None
    key = f"{checkpoint.filesystem.type_name}:{checkpoint.path}"
    with _resolved_lock:
        if key in _resolved:
            return _resolved[key]
    try:
        resolved = resolve_checkpoint(checkpoint)
    except Exception:  # noqa: BLE001 - Ray Train's own checkpoint, as it is, then
        logger.warning("could not follow ckval's checkpoint pointer %s", key, exc_info=True)
        resolved = checkpoint
    with _resolved_lock:
        _resolved[key] = resolved
    return resolved


def ray_results_path() -> str:
    """Where Ray Train keeps its results next to ckval's: ``CKVAL_HOME/ray_results``.

    For ``RunConfig(storage_path=ray_results_path())``, so that every folder a program
    using ckval writes is under one home (Ray's own default is ``~/ray_results``).
    """
    from trainer_integration._service_link import resolve_settings

    return os.fspath(resolve_settings().resolved_home() / "ray_results")
