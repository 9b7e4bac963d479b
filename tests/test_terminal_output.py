"""What `ckval` prints is inert: tag values, metric names and error messages that hold
control characters (an OSC title sequence, a screen clear, a bell) reach the terminal as
visible escapes (\\x1b, \\x07), never as the characters a terminal acts on."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tests.registry_world import VALIDATION
from validation_service.cli import main
from validation_service.registry.records import JobOutcome
from validation_service.registry.registry import Registry

TITLE = "ok\x1b]0;TITLE\x07"  # sets the terminal window's title
CLEAR = "\x1b[2J\x1b[H"  # clears the screen
METRIC = "acc\x1b[8m"  # hides what follows


@pytest.fixture
def url(tmp_path, monkeypatch) -> str:
    """Run "r": checkpoint 0 tagged TITLE with the metric METRIC, and a FAILED job whose
    error message clears the screen. The storage (CKVAL_STORAGE) is tmp_path."""
    monkeypatch.setenv("CKVAL_STORAGE", str(tmp_path))
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    run_id = registry.ledger.ensure_run("r", storage_root=str(tmp_path))
    for index in (0, 1):
        registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=str(tmp_path / f"c{index}"),
            size_bytes=1,
            manifest_sha256=None,
            reported_metrics={METRIC: 0.5 + index, "loss": 1.0},
            job=VALIDATION if index else None,
        )
    registry.tag("r", 0, "split", TITLE)
    [job] = registry.job_queue.claim_due_jobs("test", {"CPU": 1}, lease_s=60)
    failure = JobOutcome(
        succeeded=False,
        error_type="ValueError",
        error_message=f"bad shape {CLEAR}",
        error_traceback=f"Traceback (most recent call last):\n  {CLEAR}\nValueError",
        retryable=False,
    )
    assert registry.job_queue.finish_job(job.job_id, job.lease_token, failure)
    registry.close()
    return registry.url


@pytest.mark.parametrize(
    "args",
    [
        ["search", "tags.split LIKE 'ok%'"],
        ["checkpoints", "r"],
        ["best", "r", "--metric", METRIC],
        ["jobs", "r"],
        ["jobs", "--watch"],
        ["job", "1"],
        ["tag", "r", "1", "split", TITLE],
        [
            "gc",
            "r",
            "--metric",
            METRIC,
            "--keep-latest",
            "0",
            "--keep-best-per-run",
            "0",
            "--dry-run",
        ],
    ],
)
def test_cli_output_has_no_control_characters(url, args):
    result = CliRunner().invoke(main, ["--database-url", url, *args])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output, result.output
    assert "\\x1b" in result.output  # shown, as an escape


def test_an_error_message_is_inert_too(url):
    result = CliRunner().invoke(main, ["--database-url", url, "best", "r", "--metric", CLEAR])
    assert result.exit_code == 2
    assert "\x1b" not in result.output and "\\x1b[2J" in result.output


def test_inert_keeps_text_and_line_breaks_but_not_control_characters():
    from validation_service.cli._format import inert

    assert inert(TITLE) == "ok\\x1b]0;TITLE\\x07"
    assert inert("line 1\n\tline 2\r") == "line 1\n\tline 2\\r"
    assert inert("a\nb", cell=True) == "a\\nb"
    assert inert("\u202etxt.exe\x9b") == "\\u202etxt.exe\\x9b"
