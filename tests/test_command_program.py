"""An outside program run by CommandValidator: what it inherits (no secret of the node),
how much of its output is held and stored (bounded, whatever it writes), how its result
file is read (size checked first) and how its placeholders are replaced (one pass)."""

from __future__ import annotations

import json
import sys
import tracemalloc

import pytest
from fastapi.testclient import TestClient
from ray.train import Checkpoint

from tests.test_revalidate import reported_run, settle
from validation_service.api import create_app
from validation_service.config import Settings
from validation_service.errors import PermanentValidationError
from validation_service.registry.registry import Registry
from validation_service.validation import MAX_STORED_TEXT
from validation_service.validators import CommandValidator

SECRETS = {
    "CKVAL_SECRET_KEY": "k" * 32,
    "CKVAL_API_TOKEN": "t" * 32,
    "CKVAL_DATABASE_URL": "postgresql+psycopg://ckval:hunter2@db/ckval",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "PGPASSWORD": "hunter2",
    "MLFLOW_TRACKING_TOKEN": "mlflow-token",
    "HTTP_PROXY": "http://proxyuser:proxypass@proxy:3128",
}


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def checkpoint(tmp_path, name: str = "ckpt") -> Checkpoint:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "value.json").write_text("{}")
    return Checkpoint.from_directory(str(folder))


def test_the_program_inherits_no_secret_of_the_node(tmp_path, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CKVAL_NAMESPACE", "team-a")
    monkeypatch.setenv("EVAL_HARNESS_THREADS", "3")
    dump = tmp_path / "env.json"
    code = (
        "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w')); "
        "json.dump({'ok': 1}, open(sys.argv[2], 'w'))"
    )
    validator = CommandValidator(
        python(code, str(dump), "{result_path}"), env={"HF_TOKEN": "given on purpose"}
    )

    assert validator(checkpoint(tmp_path)) == {"ok": 1}
    seen = json.loads(dump.read_text())
    assert sorted(set(SECRETS) & set(seen)) == []
    assert not [name for name in seen if name.startswith("CKVAL_")]
    assert "hunter2" not in json.dumps(seen)
    assert seen["EVAL_HARNESS_THREADS"] == "3" and "PATH" in seen  # the rest stays
    assert seen["HF_TOKEN"] == "given on purpose"  # what env= names, as named


def test_a_huge_stderr_line_is_cut_and_output_is_never_held_whole(tmp_path):
    code = (
        "import sys; sys.stdout.write('o' * 60_000_000); sys.stdout.flush(); "
        "sys.stderr.write('x' * 20_000_000 + '\\nCUDA out of memory\\n'); sys.exit(1)"
    )
    validator = CommandValidator(python(code))

    tracemalloc.start()
    try:
        with pytest.raises(PermanentValidationError) as failed:
            validator(checkpoint(tmp_path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    message = str(failed.value)
    assert "exited with code 1" in message and "CUDA out of memory" in message
    assert len(message) < 30_000
    assert peak < 5_000_000, peak  # 80 MB written, a few hundred kB held


def test_a_result_file_over_the_cap_fails_naming_its_size(tmp_path):
    code = (
        "import json, sys; json.dump({'metrics': {'acc': 0.9}, 'pad': 'x' * 5_000_000}, "
        "open(sys.argv[1], 'w'))"
    )
    with pytest.raises(PermanentValidationError, match=r"result file is \d+ bytes, over the"):
        CommandValidator(python(code, "{result_path}"))(checkpoint(tmp_path))


def test_placeholders_are_replaced_in_one_pass(tmp_path):
    """A checkpoint folder whose name holds "{output_dir}" reaches the program as it is."""
    code = (
        "import json, os, sys; "
        "json.dump({'found': float(os.path.isfile(sys.argv[1] + '/value.json'))}, "
        "open(sys.argv[2], 'w'))"
    )
    validator = CommandValidator(python(code, "{checkpoint_dir}", "{result_path}"))

    assert validator(checkpoint(tmp_path, "model-{output_dir}-{step}")) == {"found": 1.0}


@pytest.fixture
def settings(registry, tmp_path) -> Settings:
    url = registry.engine.url.render_as_string(hide_password=False)
    return Settings(home=tmp_path / "home", database_url=url, storage=str(tmp_path / "s"))


def test_what_a_failed_program_leaves_in_the_registry_is_capped(
    registry, settings, tmp_path, unique_run
):
    """30 MB on one stderr line once made a 30 MB error_message (twice stored, served by
    /jobs/N, the run's validations and its page): every stored text is capped."""
    reg = Registry(settings=settings)
    try:
        reported_run(tmp_path, settings, reg, unique_run)
        code = "import sys; sys.stderr.write('e' * 30_000_000); sys.exit(3)"
        [job_id] = reg.revalidate(
            unique_run, CommandValidator(python(code)), validator="loud", reports=[0]
        )
        [job] = settle(reg, settings, [job_id])
        with TestClient(create_app(settings, reg), base_url="http://localhost") as client:
            served = client.get(f"/jobs/{job_id}")
            listed = client.get(f"/runs/{unique_run}/validations")
    finally:
        reg.close()

    assert job.status == "FAILED" and "exited with code 3" in job.error_message
    texts = [job.error_message, job.error_traceback, *(a.log for a in job.attempt_history)]
    texts += [a.error_message for a in job.attempt_history]
    assert max(len(text or "") for text in texts) <= MAX_STORED_TEXT
    assert len(served.content) < 400_000 and len(listed.content) < 600_000


def test_nothing_the_program_started_outlives_it(tmp_path):
    """A child left running (holding the program's output open) is killed with its group
    when the program exits: the validation neither waits for it nor leaves it behind."""
    import os
    import time

    pid_file = tmp_path / "child.pid"
    code = (
        "import json, subprocess, sys; child = subprocess.Popen(['sleep', '120']); "
        "open(sys.argv[1], 'w').write(str(child.pid)); "
        "json.dump({'ok': 1}, open(sys.argv[2], 'w'))"
    )
    started = time.monotonic()
    result = CommandValidator(python(code, str(pid_file), "{result_path}"))(checkpoint(tmp_path))

    assert result == {"ok": 1} and time.monotonic() - started < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and "Z" not in _state(child):
        assert time.monotonic() < deadline, f"child {child} still runs"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "Z"
