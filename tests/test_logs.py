"""ckval is quiet by default; CKVAL_LOG_LEVEL turns its and Alembic's logs on."""

from __future__ import annotations

import os
import subprocess
import sys

OPEN_A_NEW_REGISTRY = (
    "import logging, sys; logging.basicConfig(level=logging.INFO); "
    "import trainer_integration; from validation_service import Registry; "
    "Registry('sqlite:///' + sys.argv[1])"
)


def open_registry(tmp_path, level: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "CKVAL_LOG_LEVEL"}
    if level is not None:
        env["CKVAL_LOG_LEVEL"] = level
    done = subprocess.run(
        [sys.executable, "-c", OPEN_A_NEW_REGISTRY, str(tmp_path / "registry.db")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_migrating_a_new_registry_prints_nothing_by_default(tmp_path):
    """Even in a program that logs at INFO (as Ray's workers do)."""
    assert open_registry(tmp_path, None) == ""
    assert (tmp_path / "registry.db").exists()


def test_ckval_log_level_info_shows_the_migration(tmp_path):
    output = open_registry(tmp_path, "info")
    assert "Running upgrade" in output and "alembic" in output


def test_a_bad_ckval_log_level_is_named_and_the_default_kept(tmp_path):
    output = open_registry(tmp_path, "LOUD")
    assert "CKVAL_LOG_LEVEL='LOUD' is not a logging level" in output
    assert "Running upgrade" not in output
