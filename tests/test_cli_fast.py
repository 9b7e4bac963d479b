"""The command line starts light: importing it, `--help` and the registry listings load
neither Ray nor Alembic (the speed itself is measured in benchmarks/bench_cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import validation_service
from validation_service.registry import _migrate
from validation_service.registry.records import JobOutcome
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("ray", "torch", "fastapi", "alembic", "pandas")

# Runs the CLI in this process, then prints which heavy modules it loaded.
CLI_THEN_MODULES = """
import json, sys
from validation_service.cli import main
try:
    main(sys.argv[1:], prog_name="ckval")
except SystemExit as exc:
    code = exc.code
names = ("ray", "torch", "fastapi", "alembic", "pandas", "sqlalchemy", "pydantic")
print(json.dumps({"exit": code, "loaded": sorted(m for m in names if m in sys.modules)}))
"""


def python(*args: str, home: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKVAL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if home is not None:
        env["CKVAL_HOME"] = str(home)
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def run_cli(*args: str, home: Path | None = None) -> tuple[dict, str]:
    done = python("-c", CLI_THEN_MODULES, *args, home=home)
    assert done.returncode == 0, done.stderr
    *printed, state = done.stdout.strip().splitlines()
    return json.loads(state), "\n".join(printed)


def test_importing_the_cli_loads_nothing_heavy():
    done = python(
        "-c",
        "import validation_service.cli, sys; "
        "print(sorted(m for m in ('ray','torch','fastapi','alembic') if m in sys.modules))",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_help_loads_neither_ray_nor_sqlalchemy():
    state, out = run_cli("--help")
    assert state == {"exit": 0, "loaded": []}
    assert "Commands:" in out and "Exit status:" in out and "3  `status`, `stop`" in out


@pytest.fixture
def embedded_home(tmp_path) -> Path:
    """A CKVAL_HOME whose embedded registry holds one validated checkpoint of run "r"."""
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    run_id = registry.ledger.ensure_run("r", storage_root=str(tmp_path))
    request = ValidationRequest(
        executor_kind="ray_task", pool="CPU", validate_fn_name="v", validate_fn_ref="json:dumps"
    )
    registry.ledger.register_checkpoint(
        run_id,
        0,
        uri=str(tmp_path / "c0"),
        size_bytes=1,
        manifest_sha256=None,
        reported_metrics={"loss": 0.3},
        job=request,
    )
    [job] = registry.job_queue.claim_due_jobs("fast", {}, lease_s=60)
    registry.job_queue.finish_job(
        job.job_id, job.lease_token, JobOutcome(succeeded=True, metrics={"accuracy": 0.9})
    )
    registry.close()
    return tmp_path


@pytest.mark.parametrize(
    "args",
    [
        ("runs",),
        ("checkpoints", "r"),
        ("best", "r", "--metric", "accuracy"),
        ("best", "--metric", "accuracy", "--json"),
        ("jobs",),
    ],
)
def test_registry_listings_load_neither_ray_nor_alembic(embedded_home, args):
    state, out = run_cli(*args, home=embedded_home)
    assert state["exit"] == 0, out
    assert not set(state["loaded"]) & set(HEAVY), state
    assert "0.9" in out or "SUCCEEDED" in out


def test_public_names_still_import():
    done = python(
        "-c",
        "from validation_service import Registry, ValidationService, Settings, JobStatus, "
        "CkvalError, ServiceHandle, ValidationRequest, RegistryUnavailable; "
        "import validation_service as v; "
        "print(all(getattr(v, name) is not None for name in v.__all__))",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_an_unknown_package_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        validation_service.Nope  # noqa: B018


def test_declared_head_is_alembics_head():
    from alembic.script import ScriptDirectory

    heads = _migrate.declared_heads(_migrate.migrations_dir() / "versions")
    script = ScriptDirectory.from_config(_migrate.alembic_config("sqlite://"))
    assert heads == [script.get_current_head()]


def test_declared_heads_follow_annotated_and_merge_revisions(tmp_path):
    (tmp_path / "a.py").write_text('revision = "a"\ndown_revision = None\n')
    (tmp_path / "b.py").write_text('revision: str = "b"\ndown_revision: str | None = "a"\n')
    (tmp_path / "c.py").write_text('revision = "c"\ndown_revision = "a"\n')
    assert _migrate.declared_heads(tmp_path) == ["b", "c"]
    (tmp_path / "d.py").write_text('revision = "d"\ndown_revision = ("b", "c")\n')
    assert _migrate.declared_heads(tmp_path) == ["d"]


def test_declared_heads_give_up_on_a_computed_revision(tmp_path):
    (tmp_path / "a.py").write_text('revision = "a" + "1"\ndown_revision = None\n')
    assert _migrate.declared_heads(tmp_path) is None


def test_current_revision_matches_alembic(tmp_path):
    from alembic.runtime.migration import MigrationContext

    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", check_schema=False)
    try:
        assert _migrate.current_revision(registry.engine) is None
        registry.upgrade()
        with registry.engine.connect() as connection:
            expected = MigrationContext.configure(connection).get_current_revision()
        assert _migrate.current_revision(registry.engine) == expected
        assert expected == _migrate.head_revision(registry.url)
    finally:
        registry.close()


def test_benchmark_smoke(tmp_path):
    out_file = tmp_path / "cli.md"
    done = python("benchmarks/bench_cli.py", "--smoke", "--out", str(out_file))
    assert done.returncode == 0, done.stderr
    report = out_file.read_text()
    for label in ("`python -c pass`", "`ckval --help`", "`ckval runs`", "`ckval jobs run-0`"):
        assert f"| {label} |" in report
