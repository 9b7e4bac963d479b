"""Where ckval keeps its embedded state: CKVAL_HOME and the default registry URL under it.

Plain functions without pydantic or SQLAlchemy, so that Settings (config.py) and the
CLI's fast read path (registry/_fast_read.py) share one definition.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_PREFIX = "CKVAL_"


def default_home() -> Path:
    return Path(os.path.expanduser("~/.ckval"))


def resolved_home(home: Path | str) -> Path:
    return Path(os.path.expanduser(str(home)))


def resolved_database_url(database_url: str | None, home: Path | str) -> str:
    """``database_url`` if given, else the embedded SQLite registry under ``home``."""
    if database_url:
        return database_url
    return f"sqlite:///{resolved_home(home) / 'registry.db'}"
