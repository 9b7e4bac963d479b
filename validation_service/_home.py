"""Where ckval keeps its embedded state: CKVAL_HOME and the default registry URL under it.

Plain functions without pydantic or SQLAlchemy, so that Settings (config.py) and the
CLI's fast read path (registry/_fast_read.py) share one definition.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_PREFIX = "CKVAL_"


def env_var(field: str) -> str:
    """The variable that sets a Settings field: ``storage`` -> CKVAL_STORAGE."""
    return f"{ENV_PREFIX}{field.upper()}"


def env_field(name: str) -> str | None:
    """The Settings field a CKVAL_* variable sets: CKVAL_STORAGE -> ``storage``; None for
    a variable without the prefix."""
    return name[len(ENV_PREFIX) :].lower() if name.startswith(ENV_PREFIX) else None


def default_home() -> Path:
    return Path(os.path.expanduser("~/.ckval"))


def resolved_home(home: Path | str) -> Path:
    return Path(os.path.expanduser(str(home)))


def resolved_database_url(database_url: str | None, home: Path | str) -> str:
    """``database_url`` if given, else the embedded SQLite registry under ``home``."""
    if database_url:
        return database_url
    return f"sqlite:///{resolved_home(home) / 'registry.db'}"


# What ckval keeps on disk (the registry, the signing key, checkpoints, which hold pickled
# models) is its owner's alone: folders 0700, files 0600, from the first one created,
# whichever command creates it. Existing folders and files keep their mode.
PRIVATE_FOLDER_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def make_private_folders(path: Path | str) -> None:
    """Creates ``path`` and each missing folder above it with mode 0700 (os.makedirs
    gives the folders above the last the process's default mode instead)."""
    path = Path(os.path.abspath(os.path.expanduser(str(path))))
    for folder in [*reversed(path.parents), path]:
        if not folder.exists():
            try:
                folder.mkdir(mode=PRIVATE_FOLDER_MODE)
            except FileExistsError:
                pass  # made meanwhile by another process


def create_private_file(path: Path | str):
    """A new file opened for binary writing, created with mode 0600; raises
    FileExistsError when the name exists (never writes through someone else's file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    return os.fdopen(fd, "wb")
