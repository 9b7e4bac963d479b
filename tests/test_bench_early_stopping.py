"""benchmarks/bench_early_stopping.py --smoke, run as a user would run it, so that the
script never rots: its lag part, on a small scale (one short TorchTrainer run; the saved
part adds two more runs, about 45 s, and shares the harness)."""

from __future__ import annotations

import sys

import pytest

from tests.test_examples import run

pytestmark = pytest.mark.ray


def test_benchmark_early_stopping_smoke(tmp_path):
    out_file = tmp_path / "early_stopping.md"
    out = run(
        [
            sys.executable,
            "benchmarks/bench_early_stopping.py",
            "--smoke",
            "--parts",
            "lag",
            "--out",
            str(out_file),
        ],
        tmp_path,
        timeout=600,
    )
    table = out_file.read_text()
    assert table in out
    # Two decisions measured, each seen by the training loop after it was taken.
    [summary] = [ln for ln in table.splitlines() if ln.startswith("| long-lived | top | 0.50 / ")]
    assert summary.split("|")[4].strip() == "2"
    rows = [line for line in table.splitlines() if line.startswith("| long-lived | top | 0.50 |")]
    assert len(rows) == 2
    for row in rows:
        decision_to_seen = float(row.split("|")[7])
        assert 0 < decision_to_seen < 30, row
