"""What the benchmark scripts share: how a run is described, and shipping code to workers."""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import uuid


def command_line() -> str:
    """This run's command as the user would type it (.venv/bin/python from the repository)."""
    relative = os.path.relpath(sys.executable)
    python = relative if not relative.startswith("..") else sys.executable
    return " ".join(shlex.quote(a) for a in [python, *sys.argv])


def load_average() -> str:
    return "/".join(f"{v:.2f}" for v in os.getloadavg())


def pickle_by_value(module_name: str) -> None:
    """Ray workers cannot import a benchmark script: ship its functions by value."""
    import cloudpickle
    import ray.cloudpickle

    module = sys.modules[module_name]
    cloudpickle.register_pickle_by_value(module)
    ray.cloudpickle.register_pickle_by_value(module)


def fresh_ckval_home(prefix: str):
    """A new temporary folder as CKVAL_HOME, set before ray.init so that Ray's workers and
    the service inherit it; the embedded defaults apply and a new local Ray starts."""
    import tempfile
    from pathlib import Path

    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["CKVAL_HOME"] = str(workdir / "ckval")
    for name in ("CKVAL_DATABASE_URL", "CKVAL_STORAGE", "CKVAL_RAY_ADDRESS", "RAY_ADDRESS"):
        os.environ.pop(name, None)
    return workdir


def run_description(load_before: str) -> dict[str, str]:
    """The header every results file starts with: command, date, machine, versions, load."""
    import datetime as dt
    import platform

    import ray
    import torch

    gpu = "GPU present but unused" if torch.cuda.is_available() else "no GPU"
    return {
        "command": command_line(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), {gpu}",
        "versions": f"python {platform.python_version()}, ray {ray.__version__}, "
        f"torch {torch.__version__}",
        "load_before": load_before,
        "load_after": load_average(),
    }


POSTGRES_URL = os.environ.get(
    "CKVAL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


class Database:
    """A fresh database for one measurement, removed afterwards."""

    def __init__(self, backend: str, prefix: str = "bench-"):
        self.backend = backend
        if backend == "sqlite":
            self.url = f"sqlite:///{tempfile.mkdtemp(prefix=prefix)}/registry.db"
            return
        import sqlalchemy as sa

        self.name = f"ckval_bench_{uuid.uuid4().hex[:8]}"
        self.admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
        with self.admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{self.name}"'))
        self.url = (
            sa.engine.make_url(POSTGRES_URL)
            .set(database=self.name)
            .render_as_string(hide_password=False)
        )

    def drop(self) -> None:
        if self.backend == "sqlite":
            return
        import sqlalchemy as sa

        with self.admin.connect() as conn:
            conn.execute(
                sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname=:d"),
                {"d": self.name},
            )
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.name}"'))
        self.admin.dispose()


def fresh_registries(backends, prefix: str):
    """(backend, Registry) on a fresh database of each backend in turn (SQLite in a temp
    folder, PostgreSQL a new database on CKVAL_TEST_POSTGRES_URL's server), each closed
    and dropped once the caller moves on."""
    from validation_service.registry.registry import Registry

    for backend in backends:
        database = Database(backend, prefix)
        try:
            registry = Registry(database.url, upgrade=True)
            try:
                yield backend, registry
            finally:
                registry.close()
        finally:
            database.drop()


def time_get(client, url: str, warmup: int, repeats: int) -> dict:
    """GETs ``url`` ``warmup`` times unmeasured, then ``repeats`` times: the median and 95th
    percentile of the wall time (ms), the median CPU time of this process (ms: the API's,
    with a TestClient) and the answer's size in bytes."""
    import statistics
    import time

    for _ in range(warmup):
        assert client.get(url).status_code == 200, url
    times, cpu, size = [], [], 0
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        response = client.get(url)
        times.append((time.perf_counter() - start) * 1000)
        cpu.append((time.process_time() - start_cpu) * 1000)
        assert response.status_code == 200, (url, response.text[:300])
        size = len(response.content)
    times.sort()
    return {
        "median": statistics.median(times),
        "p95": times[min(len(times) - 1, int(0.95 * len(times)))],
        "cpu": statistics.median(cpu),
        "bytes": size,
    }
