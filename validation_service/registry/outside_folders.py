"""Registry.register: a folder made outside training (a released model, a Hugging Face
folder) added to a run as a checkpoint, read where it is and never deleted by gc.

The folder is checked before anything is written. Its URI carries no credential (they
belong in CKVAL_STORAGE_OPTIONS: a stored URI is shown by the CLI, the API and the
dashboard). It follows the rule a NO_UPLOAD report follows: under a storage root the
settings name (CKVAL_STORAGE, CKVAL_DELETABLE_ROOTS) only inside the run's own folder,
``<root>/<namespace>/<run>/...``; and it holds no such root, nor CKVAL_HOME (the
registry and the signing key), nor is it a system folder: a registered folder pins
every checkpoint folder inside it against gc, and its files are read by validations.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy.exc import IntegrityError

from validation_service.errors import InvalidInput
from validation_service.jobs import RunStatus, ValidationStatus
from validation_service.metrics import normalize_metrics
from validation_service.names import check_name
from validation_service.registry import registration
from validation_service.registry.catalog import checkpoint_row
from validation_service.registry.models import utcnow
from validation_service.secrets import mask_url
from validation_service.validation import check_step

# Local folders never registered, nor any folder inside them: the system's own.
SYSTEM_FOLDERS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/run", "/sbin")
SYSTEM_FOLDERS += ("/sys", "/usr")


def register(registry, run: str, uri: Any, metrics: dict | None, step: int | None) -> int:
    """Registry.register: the folder checked, then the run (made if need be), its report
    index and the checkpoint's row in one write transaction."""
    from validation_service.storage import outside_folder

    check_name("run name", run)
    if not isinstance(uri, str) or not uri.strip():
        raise InvalidInput(f"register needs the folder's path or URI as a str, got {uri!r}")
    check_no_credentials(uri)
    reported = normalize_metrics(metrics or {}, what="metrics")
    check_step(step)
    location, size = outside_folder(uri, registry.settings.storage_options)
    check_registrable(location, registry.settings, registry.namespace, run)
    catalog = registry.catalog
    for _ in range(3):
        try:
            with registry.db.write() as conn:
                run_id = catalog.run_id(conn, run)
                if run_id is None:  # a run of its own, ended: no report goes on in it
                    storage_root = registry.settings.resolved_storage()
                    run_id = catalog.insert_run(
                        conn,
                        run,
                        storage_root=storage_root,
                        tags=None,
                        attempt=1,
                        status=RunStatus.FINISHED,
                    )
                report_index = catalog.reserve_report_index(conn, run_id)
                row = external_row(run_id, report_index, location, size, reported, step)
                registration.register(conn, row, None)
            return report_index
        except IntegrityError:
            continue  # the run was made meanwhile by another writer: use it
    raise RuntimeError(f"could not create or find run {run!r}")


def check_no_credentials(uri: str) -> None:
    """InvalidInput, showing the URI masked, when it carries a credential (a password, a
    user name standing for a token, a secret query parameter)."""
    masked = mask_url(uri)
    if masked != uri:
        raise InvalidInput(
            f"{masked} carries credentials (shown here as ***): a registered URI is stored "
            "and shown as it is. Register it without them and give the storage's "
            "credentials in CKVAL_STORAGE_OPTIONS (or the environment fsspec reads). "
            "Nothing was registered."
        )


def check_registrable(location: str, settings: Any, namespace: str, run: str) -> None:
    """InvalidInput when ``location`` (outside_folder's answer) may not be registered to
    ``run`` of ``namespace`` (see the module's docstring)."""
    from validation_service.storage import CheckpointStorage

    options = settings.storage_options
    for root in settings.deletion_roots():
        storage = CheckpointStorage(root, options)
        if storage.in_root(location):
            if storage.in_run_folder(location, namespace, run):
                return  # the run's own folder: as a NO_UPLOAD report of the run
            raise _refused(
                location,
                f"it lies in ckval's storage root {mask_url(root)} but not inside run "
                f"{run!r}'s own folder ({mask_url(storage.run_folder(namespace, run))}/)",
            )
        if CheckpointStorage(location, options).in_root(root):
            raise _refused(location, f"it holds ckval's storage root {mask_url(root)}")
    if not _is_local(location):
        return
    home = os.path.realpath(settings.resolved_home())
    for path in {os.path.abspath(location), os.path.realpath(location)}:
        if _under(path, home) or _under(home, path):
            raise _refused(
                location,
                f"it holds or lies in CKVAL_HOME ({home}): the registry and the signing key",
            )
        if path == "/" or any(_under(path, folder) for folder in SYSTEM_FOLDERS):
            raise _refused(location, "it is a system folder")


def _refused(location: str, why: str) -> InvalidInput:
    return InvalidInput(
        f"{mask_url(location)} cannot be registered: {why}. Register a folder of your own "
        "(a copy of the model, say) outside ckval's storage root, or report it from "
        "training. Nothing was registered."
    )


def _is_local(location: str) -> bool:
    return "://" not in location or location.startswith("file://")


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + "/")


def external_row(run_id: int, report_index: int, uri: str, size_bytes: int, metrics, step):
    """The checkpoints row of a folder registered from outside training."""
    row = checkpoint_row(run_id, report_index, step, None, uri, size_bytes, None, metrics)
    row.update(created_at=utcnow(), validation_status=ValidationStatus.NONE.value, external=True)
    return row
