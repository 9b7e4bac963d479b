"""What the cluster programs share: a private Ray temp dir, free ports, cleanup, the summary.

Every Ray process a program starts (GCS, raylets, agents, workers, the autoscaler's fake
nodes) carries the program's private temp dir in its command line, so cleanup can find
exactly those processes and no one else's Ray on the same machine.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port nothing listens on now (never Redis' 6379)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def private_ray_tmpdir() -> str:
    """RAY_TMPDIR for this program: the caller's, else a new short one under /tmp.

    Ray writes `ray_current_cluster` under it, so a plain `ray.init()` elsewhere on the
    machine never finds this program's cluster; it must stay short because Ray puts
    Unix socket paths (at most 107 bytes) under it.
    """
    path = os.environ.get("RAY_TMPDIR")
    if not path:
        path = tempfile.mkdtemp(prefix="ckc-", dir="/tmp")
        os.environ["RAY_TMPDIR"] = path
    return path


def ckval_home() -> Path:
    """CKVAL_HOME for this program: the caller's, else a new temporary one."""
    home = os.environ.get("CKVAL_HOME")
    if not home:
        home = tempfile.mkdtemp(prefix="ckval-cluster-home-")
        os.environ["CKVAL_HOME"] = home
    for inherited in ("RAY_ADDRESS", "CKVAL_RAY_ADDRESS", "CKVAL_DATABASE_URL", "CKVAL_STORAGE"):
        os.environ.pop(inherited, None)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    return Path(home)


def processes_with(marker: str) -> list[int]:
    """Pids of the live processes whose command line contains `marker`, except this one."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


def kill_processes_with(marker: str, grace_s: float = 5.0) -> int:
    """SIGTERM, then SIGKILL, every process whose command line names `marker`.

    `marker` is a private temp dir that only this program's Ray processes name, so this
    never touches another Ray on the machine. Returns how many were still alive.
    """
    if len(marker) < 8 or not marker.startswith("/"):
        raise ValueError(f"refusing to kill by a marker as broad as {marker!r}")
    pids = processes_with(marker)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and processes_with(marker):
        time.sleep(0.2)
    for pid in processes_with(marker):
        _signal(pid, signal.SIGKILL)
    return len(pids)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def run_all(*steps: Callable[[], object] | None) -> list[str]:
    """Runs every teardown step even when one fails; returns the failures' tracebacks."""
    errors = []
    for step in steps:
        if step is None:
            continue
        try:
            step()
        except BaseException:  # noqa: BLE001 - the next steps must run regardless
            errors.append(traceback.format_exc())
            log(errors[-1])
    return errors


def attempts_of(registry, run: str) -> list[dict[str, Any]]:
    """Every attempt of every validation job of the run, as JSON-ready dicts."""
    rows = []
    for job in registry.validations(run):
        for attempt in job.attempt_history:
            rows.append(
                {
                    "job_id": job.id,
                    "report_index": job.report_index,
                    "job_status": job.status,
                    "pool": job.pool,
                    "attempt": attempt.attempt,
                    "status": attempt.status,
                    "node_id": attempt.node_id,
                    "claimed_at": _iso(attempt.claimed_at),
                    "started_at": _iso(attempt.started_at),
                    "finished_at": _iso(attempt.finished_at),
                    "accelerator_type": attempt.accelerator_type,
                    "accelerators": attempt.accelerators,
                    "running_s": attempt.running_s,
                }
            )
    return rows


def _iso(value: dt.datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return value.isoformat()


def emit(summary: dict[str, Any]) -> None:
    """Prints the summary as one JSON line, the last line of stdout."""
    print(json.dumps(summary, sort_keys=True), flush=True)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
