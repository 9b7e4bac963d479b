"""`.ci/setup`'s choices, read through its dry run (CKVAL_SETUP_DRY_RUN=1) with real bash
and pip: which PyTorch build it would install, which Ray, and where."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / ".ci" / "setup"


def _dry_run(tmp_path: Path, **settings: str) -> subprocess.CompletedProcess:
    """The set-up's dry run with pip's configuration files and index settings left out,
    so that only what the test sets tells pip where packages lie."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("PIP_", "CKVAL_")) and name not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    env |= {
        "PIP_CONFIG_FILE": os.devnull,
        "PYTHON": sys.executable,
        "CKVAL_VENV": str(tmp_path / "venv"),
        "CKVAL_SETUP_DRY_RUN": "1",
        **settings,
    }
    done = subprocess.run(
        ["bash", str(SETUP)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def no_gpu():
    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU is present: the set-up takes the default build without asking")


def test_without_gpu_local_build_or_index_it_installs_the_default_build_and_says_so(
    tmp_path, no_gpu
):
    done = _dry_run(tmp_path)
    assert "torch: default" in done.stdout.splitlines()
    notice = " ".join(line.removeprefix("ckval set-up: ") for line in done.stderr.splitlines())
    assert "default PyTorch build, which is large (several GB" in notice
    assert "PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index" in notice
    assert "or install torch into" in notice
    assert not (tmp_path / "venv").exists()  # a dry run creates nothing


def test_an_index_named_in_the_environment_is_where_torch_comes_from(tmp_path, no_gpu):
    index = tmp_path / "index"
    index.mkdir()
    done = _dry_run(tmp_path, PIP_EXTRA_INDEX_URL=index.as_uri())
    assert "torch: index" in done.stdout.splitlines()
    assert "several GB" not in done.stderr


def test_a_local_cpu_build_is_taken_before_any_index(tmp_path, no_gpu):
    """The CPU build that a find-links folder holds (this machine's, where it has one)."""
    folders = [part for part in os.environ.get("PIP_FIND_LINKS", "").split() if part]
    holding = [
        folder
        for folder in folders
        if any(
            Path(folder).glob(f"torch-2.13.0+cpu-cp{sys.version_info[0]}{sys.version_info[1]}-*")
        )
    ]
    if not holding:
        pytest.skip("no local CPU build of torch 2.13.0 for this Python in PIP_FIND_LINKS")
    index = tmp_path / "index"
    index.mkdir()
    done = _dry_run(tmp_path, PIP_FIND_LINKS=holding[0], PIP_EXTRA_INDEX_URL=index.as_uri())
    assert "torch: local" in done.stdout.splitlines()


def test_the_ray_release_asked_and_the_venv_asked(tmp_path):
    done = _dry_run(tmp_path, CKVAL_RAY_VERSION="2.54.1")
    lines = done.stdout.splitlines()
    assert "ray: ray[train,data,client]==2.54.1" in lines
    assert lines[0].startswith(f"venv: {tmp_path / 'venv'} (Python ")
    assert "ckval: -e .[test,tensorflow,dask,transformers,lightning,lm-eval]" in lines


def test_a_venv_that_has_torch_gets_no_other_build(tmp_path):
    done = _dry_run(tmp_path, CKVAL_VENV=sys.prefix)
    assert "torch: installed" in done.stdout.splitlines()
    assert not any(line.startswith("ray:") for line in done.stdout.splitlines())


def test_no_project_file_names_a_package_index():
    """The set-up and the README say where PyTorch's CPU build lies in words only."""
    for path in (SETUP, ROOT / ".ci" / "run", ROOT / "pyproject.toml"):
        text = path.read_text()
        assert "://" not in text, path
        assert "pytorch.org/whl" not in text, path
