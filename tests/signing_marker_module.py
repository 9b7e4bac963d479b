"""A module that leaves a file in CKVAL_HOME when it is imported: the proof, in
tests/test_signing.py, that a disallowed validate_fn reference is never imported."""

from __future__ import annotations

import os
from pathlib import Path

Path(os.environ["CKVAL_HOME"], "signing_marker_module.imported").touch()


def validate(checkpoint, config) -> dict:
    return {"imported": 1.0}
