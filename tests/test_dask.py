"""Dask: DDP over gloo on a real LocalCluster, checkpoints validated by the service in Ray."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import signal
import sys
import time
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import Client, LocalCluster
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import trainer_integration
from tests.test_examples import run as run_example
from trainer_integration.dask import NoDaskWorkers, ResultsHandler, WorkerLost, run
from validation_service.errors import InvalidInput
from validation_service.registry.registry import Registry

# The service's Ray workers unpickle validate_fn without importing this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 2


# ------------------------------------------------------------------ model, data, validation
def load_split():
    digits = load_digits()  # bundled with scikit-learn: nothing is downloaded
    x = (digits.data / 16.0).astype(np.float32)
    return train_test_split(x, digits.target, test_size=0.25, random_state=0)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def validate_state_dict(checkpoint, config: dict) -> dict:
    """The validate_fn: accuracy of the checkpoint's one file on the held-out split."""
    _, x_val, _, y_val = load_split()
    model = build_model()
    with checkpoint.as_directory() as directory:
        [name] = [n for n in os.listdir(directory) if n.endswith((".pt", ".pkl"))]
        path = os.path.join(directory, name)
        state = torch.load(path) if name.endswith(".pt") else pickle.load(open(path, "rb"))
    model.load_state_dict(state)
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_val)).argmax(dim=1).numpy()
    return {"accuracy": float((predicted == y_val).mean()), "file": name}


def accuracy_by_hand(state: dict) -> float:
    """The same accuracy computed independently of the validate_fn: numpy, no nn.Module."""
    _, x_val, _, y_val = load_split()
    w1, b1, w2, b2 = (state[k].numpy() for k in ("0.weight", "0.bias", "2.weight", "2.bias"))
    logits = np.maximum(x_val @ w1.T + b1, 0) @ w2.T + b2
    return float((logits.argmax(axis=1) == y_val).mean())


def stored_state(record) -> dict:
    files = [n for n in os.listdir(record.uri) if n.endswith((".pt", ".pkl"))]
    assert len(files) == 1, files
    path = os.path.join(record.uri, files[0])
    return torch.load(path) if path.endswith(".pt") else pickle.load(open(path, "rb"))


def assert_all_validated(run_name: str, count: int) -> list:
    registry = Registry()
    registry.wait(run_name, timeout_s=120)
    records = registry.checkpoints(run_name)
    assert [r.report_index for r in records] == list(range(count))
    assert [r.validation_status for r in records] == ["VALIDATED"] * count
    for record in records:
        expected = accuracy_by_hand(stored_state(record))
        assert record.metrics["accuracy"] == pytest.approx(expected, abs=1e-9)
    return records


# ------------------------------------------------------------------ training functions
def shard():
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, _, y_train, _ = load_split()
    return torch.from_numpy(x_train[rank::world]), torch.from_numpy(y_train[rank::world])


def train_epoch(model, optimizer, x, y) -> float:
    for start in range(0, len(x), 32):
        loss = nn.functional.cross_entropy(model(x[start : start + 32]), y[start : start + 32])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def train_with_report(epochs: int, workdir: str) -> dict:
    """Written as for Ray Train: rank 0 reports the checkpoint, the others metrics only."""
    from ray.train import Checkpoint

    x, y = shard()
    model = nn.parallel.DistributedDataParallel(build_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for epoch in range(epochs):
        loss = train_epoch(model, optimizer, x, y)
        if dist.get_rank() == 0:
            directory = os.path.join(workdir, f"epoch-{epoch}")
            os.makedirs(directory)
            torch.save(model.module.state_dict(), os.path.join(directory, "model.pt"))
            trainer_integration.report(
                {"epoch": epoch, "loss": loss},
                Checkpoint.from_directory(directory),
                validate_fn=validate_state_dict,
            )
        else:
            trainer_integration.report({"epoch": epoch, "loss": loss}, None)
    total = sum(float(p.detach().sum()) for p in model.parameters())
    return {"rank": dist.get_rank(), "parameter_sum": total}


def seed_program(rh: ResultsHandler, epochs: int, fail: dict | None = None) -> None:
    """Shaped like dask-pytorch-ddp's example: JSON every 10 batches, a pickle per epoch.

    ``fail``: {"rank": r, "epoch": e, "how": "raise" | "bad-data" | "slow"}.
    """
    x, y = shard()
    rank = dist.get_rank()
    model = nn.parallel.DistributedDataParallel(build_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    fail = fail or {}
    for epoch in range(epochs):
        if fail.get("rank") == rank and fail.get("epoch") == epoch:
            if fail["how"] == "raise":
                raise ValueError(f"rank {rank} cannot go on at epoch {epoch}")
            rh.submit_result(f"worker/{rank}/bad-{epoch}.json", {"loss": 1.0})
        for count, start in enumerate(range(0, len(x), 32)):
            loss = nn.functional.cross_entropy(model(x[start : start + 32]), y[start : start + 32])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if count % 10 == 0:
                stamp = datetime.datetime.now().isoformat()
                rh.submit_result(
                    f"worker/{rank}/data-{stamp}.json",
                    json.dumps({"loss": loss.item(), "epoch": epoch, "count": count}),
                )
        if fail.get("how") == "slow":
            time.sleep(0.5)  # gives the test time to kill a worker mid-run
        if rank == 0:
            rh.submit_result(f"checkpoint-{epoch}.pkl", pickle.dumps(model.module.state_dict()))


def launch_as_dask_pytorch_ddp(client, fn, **kwargs) -> list:
    """dask_pytorch_ddp.dispatch.run (0.2.2) with backend="gloo", written out: that package
    no longer imports on current distributed. It sets no ckval run: the handler brings it."""
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    host = client.scheduler_info(n_workers=-1)["workers"][workers[0]]["host"]
    port = client.run(_free_port, workers=[workers[0]])[workers[0]]
    return [
        client.submit(
            _dispatch_with_ddp,
            fn,
            host,
            port,
            rank,
            len(workers),
            workers=[w],
            pure=False,
            **kwargs,
        )
        for rank, w in enumerate(workers)
    ]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _dispatch_with_ddp(fn, master_addr, master_port, rank, world_size, **kwargs):
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    dist.init_process_group(backend="gloo")
    try:
        return fn(**kwargs)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def dask_client():
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


# ------------------------------------------------------------------ tests
def test_ddp_run_reports_every_epoch_and_each_is_validated(
    service, dask_client, unique_run, tmp_path
):
    futures = run(
        dask_client, train_with_report, run_name=unique_run, epochs=EPOCHS, workdir=str(tmp_path)
    )
    results = dask_client.gather(futures)
    # One process group: DDP kept both ranks' parameters equal.
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["parameter_sum"] == pytest.approx(results[1]["parameter_sum"], rel=1e-6)
    records = assert_all_validated(unique_run, EPOCHS)
    assert [r.epoch for r in records] == list(range(EPOCHS))
    assert all(r.metrics["file"] == "model.pt" for r in records)
    assert records[-1].metrics["accuracy"] > 0.8  # a real model on real data learns digits
    # The stored files are those rank 0 wrote, byte for byte.
    for record in records:
        written = tmp_path / f"epoch-{record.epoch}" / "model.pt"
        assert (Path(record.uri) / "model.pt").read_bytes() == written.read_bytes()


@pytest.mark.parametrize("launcher", ["ckval-run", "dask-pytorch-ddp-dispatch"])
def test_seed_program_with_results_handler(service, dask_client, unique_run, tmp_path, launcher):
    rh = ResultsHandler(unique_run, validate_fn=validate_state_dict)
    if launcher == "ckval-run":
        futures = run(dask_client, seed_program, run_name=unique_run, rh=rh, epochs=EPOCHS)
    else:
        futures = launch_as_dask_pytorch_ddp(dask_client, seed_program, rh=rh, epochs=EPOCHS)
    prefix = tmp_path / "results"
    rh.process_results(str(prefix), futures, raise_errors=True)

    records = assert_all_validated(unique_run, EPOCHS)
    for epoch, record in enumerate(records):
        name = f"checkpoint-{epoch}.pkl"
        assert record.metrics["file"] == name  # the file kept its name in the checkpoint
        # Written under prefix as DaskResultsHandler did, copied from storage.
        assert (prefix / name).read_bytes() == (Path(record.uri) / name).read_bytes()
    # Each rank's JSON results are written; rank 0's latest before each checkpoint is
    # that checkpoint's reported metrics.
    rank0 = sorted((prefix / "worker" / "0").glob("data-*.json"))
    rank1 = sorted((prefix / "worker" / "1").glob("data-*.json"))
    assert len(rank0) == len(rank1) == EPOCHS * 3  # 22 batches of 32 a rank: counts 0, 10, 20
    latest = [json.loads(p.read_text()) for p in rank0[2::3]]
    for record, sent in zip(records, latest, strict=True):
        assert record.reported_metrics == sent
        assert record.epoch == sent["epoch"]


def test_run_on_a_cluster_without_workers(unique_run):
    with (
        LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        with pytest.raises(NoDaskWorkers, match="has no workers.*wait_for_workers"):
            run(client, train_with_report, run_name=unique_run, epochs=1, workdir="/nowhere")
    assert Registry().find_run_id(unique_run) is None


def test_fn_that_raises_on_one_rank(service, dask_client, unique_run, tmp_path):
    rh = ResultsHandler(unique_run, validate_fn=validate_state_dict)
    fail = {"rank": 0, "epoch": 1, "how": "raise"}
    futures = run(dask_client, seed_program, run_name=unique_run, rh=rh, epochs=EPOCHS, fail=fail)
    with pytest.raises(ValueError, match="rank 0 cannot go on at epoch 1") as raised:
        rh.process_results(str(tmp_path), futures)
    assert any("rank 0 of 2 (Dask worker" in note for note in raised.value.__notes__)
    # The other rank did not stay blocked in its next collective: its worker is free.
    assert all(future.done() for future in futures)
    # Epoch 0's checkpoint was reported before the failure: kept and validated.
    [record] = assert_all_validated(unique_run, 1)
    assert (tmp_path / "checkpoint-0.pkl").read_bytes() == (
        Path(record.uri) / "checkpoint-0.pkl"
    ).read_bytes()


def test_submit_result_of_data_that_is_neither_bytes_nor_str(
    service, dask_client, unique_run, tmp_path
):
    rh = ResultsHandler(unique_run, validate_fn=validate_state_dict)
    with pytest.raises(InvalidInput, match="takes bytes or str, got int"):
        rh.submit_result("worker/0/data.json", 3)
    refused = ("/etc/passwd", "../outside.json", "worker/../../x.json", "\\\\host\\x.json")
    for path in (*refused, "C:", "C:/Windows/x.json", "c:\\x.json", "worker\\..\\..\\x.json"):
        with pytest.raises(InvalidInput, match="must stay inside the results folder"):
            rh.submit_result(path, "{}")
    fail = {"rank": 0, "epoch": 1, "how": "bad-data"}
    futures = run(dask_client, seed_program, run_name=unique_run, rh=rh, epochs=EPOCHS, fail=fail)
    with pytest.raises(InvalidInput, match="takes bytes or str, got dict.*json.dumps"):
        rh.process_results(str(tmp_path), futures)
    assert all(future.done() for future in futures)
    [record] = assert_all_validated(unique_run, 1)  # the checkpoint before it is kept
    assert (tmp_path / "checkpoint-0.pkl").read_bytes() == (
        Path(record.uri) / "checkpoint-0.pkl"
    ).read_bytes()
    assert not list(tmp_path.glob("**/bad-*"))


def test_worker_killed_mid_run(service, unique_run, tmp_path):
    """Rank 0's worker dies: what it had acknowledged is validated, the rest fails clearly."""
    rh = ResultsHandler(unique_run, validate_fn=validate_state_dict)
    registry = Registry()
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        fail = {"how": "slow"}
        futures = run(client, seed_program, run_name=unique_run, rh=rh, epochs=200, fail=fail)
        deadline = time.monotonic() + 120
        while registry.find_run_id(unique_run) is None or len(registry.checkpoints(unique_run)) < 2:
            assert time.monotonic() < deadline, "no second checkpoint within 120 s"
            assert not any(f.done() for f in futures), [f.exception() for f in futures]
            time.sleep(0.1)
        rank0 = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
        pid = client.run(os.getpid, workers=[rank0])[rank0]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerLost, match="Rank 0 of run .* lost its Dask worker"):
            rh.process_results(str(tmp_path / "results"), futures)
    acknowledged = len(registry.checkpoints(unique_run))
    assert 2 <= acknowledged < 200
    assert_all_validated(unique_run, acknowledged)


def test_example_dask_ddp(tmp_path):
    stdout = run_example(
        [sys.executable, "examples/dask_ddp.py", "--epochs", "2", "--run", "dask-ex"], tmp_path
    )
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    records = registry.checkpoints("dask-ex")
    assert [r.validation_status for r in records] == ["VALIDATED"] * 2
    best = registry.best_checkpoint_records("dask-ex", "accuracy", "max", k=1)[0]
    assert f"epoch {best.epoch} accuracy {best.metrics['accuracy']:.4f}" in stdout
