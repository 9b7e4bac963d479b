"""What a cluster offers a validation, judged without Ray: the demand of a job's
resources, node types read from a launcher config or CKVAL_NODE_TYPES, and the verdict
(runs now, waits for a node the autoscaler adds, never, cannot tell) with its message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from validation_service.capacity import (
    ClusterCapacity,
    ClusterOffer,
    Offer,
    accelerator_type_in,
    accelerators_held,
    demand_of,
    node_types_from_config,
    read_node_types,
)
from validation_service.config import Settings
from validation_service.errors import InvalidSettings

ROOT = Path(__file__).resolve().parent.parent
HEAD = Offer("node", "1a2b3c4d", {"CPU": 1.0, "memory": 4 * 2**30, "node:10.0.0.1": 1.0})
A10G = Offer("node type", "a10g", {"CPU": 2.0, "GPU": 1.0, "accelerator_type:A10G": 1.0}, 2)
AUTOSCALING = ClusterOffer((HEAD,), (A10G,), "cluster.yaml", autoscaler=True)


def test_the_demand_of_a_jobs_resources_is_what_ray_asks_of_one_node():
    assert demand_of({}) == {"CPU": 1.0}
    assert demand_of({"num_cpus": 0}) == {}
    assert demand_of(
        {
            "num_cpus": 2,
            "num_gpus": 0.5,
            "memory": 2**30,
            "accelerator_type": "A10G",
            "resources": {"tpu_slot": 1},
        }
    ) == {
        "CPU": 2.0,
        "GPU": 0.5,
        "memory": float(2**30),
        "tpu_slot": 1.0,
        "accelerator_type:A10G": 0.001,
    }


def test_what_an_attempt_held_is_read_from_rays_assignment():
    assigned = {"CPU": 1.0, "GPU": 1.0, "accelerator_type:A10G": 0.001}
    assert (accelerators_held(assigned), accelerator_type_in(assigned)) == (1.0, "A10G")
    assert (accelerators_held({"CPU": 4.0}), accelerator_type_in({"CPU": 4.0})) == (0.0, None)
    assert accelerators_held({"TPU": 4.0, "CPU": 1.0}) == 4.0


def test_a_request_a_node_type_offers_waits_for_the_autoscaler():
    verdict = AUTOSCALING.judge(demand_of({"num_gpus": 1, "accelerator_type": "A10G"}))
    assert (verdict.feasible, verdict.fits_now, verdict.fits_later) == (True, (), ("a10g",))
    assert verdict.waiting_for() == {
        "resources": {"CPU": 1.0, "GPU": 1.0, "accelerator_type:A10G": 0.001},
        "fits": ["node type a10g"],
        "note": "the autoscaler can add a node of type a10g",
    }
    busy = AUTOSCALING.judge({"CPU": 1.0})
    assert busy.feasible and busy.fits_now == ("1a2b3c4d",) and "busy" in busy.reason


@pytest.mark.parametrize(
    ("resources", "said"),
    [
        ({"num_gpus": 1, "accelerator_type": "H100"}, "none offers 'accelerator_type:H100'"),
        (
            {"num_gpus": 1, "accelerator_type": "A10g"},
            "none offers 'accelerator_type:A10g' (did you mean 'accelerator_type:A10G'?)",
        ),
        ({"num_gpus": 2}, "GPU 2 asked, at most 1 on one node"),
        ({"num_cpus": 1, "memory": 8 * 2**30}, "memory 8 GiB asked, at most 4 GiB on one node"),
        # Each fits some node, but no node holds both.
        ({"num_cpus": 1, "memory": 2**30, "num_gpus": 1}, "none offers all of them on one node"),
    ],
)
def test_a_request_no_node_and_no_node_type_offers_is_never_feasible(resources, said):
    verdict = AUTOSCALING.judge(demand_of(resources))
    assert verdict.feasible is False
    assert said in verdict.reason, verdict.reason
    assert verdict.reason.startswith(
        "no node of the cluster and no node type its autoscaler can add (cluster.yaml) "
    )
    # It lists what the cluster offers, without Ray's bookkeeping resources.
    assert verdict.reason.endswith(
        "The cluster offers accelerator types A10G; node 1a2b3c4d: CPU 1, memory 4 GiB; "
        "node type a10g, up to 2: CPU 2, GPU 1, accelerator_type:A10G"
    )
    assert "node:10.0.0.1" not in verdict.reason


def test_without_an_autoscaler_the_nodes_are_all_there_is_and_unknown_types_wait():
    fixed = ClusterOffer((HEAD,), (), None, autoscaler=False)
    verdict = fixed.judge({"GPU": 1.0})
    assert verdict.feasible is False
    assert verdict.reason.startswith("no node of the cluster can ever run")
    unknown = ClusterOffer((HEAD,), (), None, autoscaler=None).judge({"GPU": 1.0})
    assert unknown.feasible is None and "CKVAL_NODE_TYPES" in unknown.reason


def test_the_launcher_config_of_deploy_gives_its_worker_node_types():
    import yaml

    config = yaml.safe_load((ROOT / "deploy/ray-cluster-launcher/cluster.yaml").read_text())
    types = {offer.name: offer for offer in node_types_from_config(config)}
    assert sorted(types) == ["a100", "a10g", "cpu"]  # the head's type adds no node
    assert types["a10g"].max_count == 4
    # GPUs, CPUs and memory come from the instance type: any amount may come.
    assert "GPU" in types["a10g"].open_amounts
    offer = ClusterOffer((HEAD,), tuple(types.values()), "cluster.yaml", autoscaler=True)
    assert offer.judge(demand_of({"num_gpus": 1, "accelerator_type": "A10G"})).fits_later == (
        "a10g",
    )
    assert offer.judge(demand_of({"num_gpus": 1, "accelerator_type": "A10g"})).feasible is False


def test_node_types_come_from_json_a_file_or_the_launchers_config_on_this_node(
    tmp_path, monkeypatch
):
    inline = json.dumps({"a10g": {"resources": {"GPU": 1, "accelerator_type:A10G": 1}}})
    [offer], source = read_node_types(inline)
    assert (offer.name, offer.max_count, source) == ("a10g", None, "CKVAL_NODE_TYPES")
    path = tmp_path / "cluster.yaml"
    path.write_text("max_workers: 0\navailable_node_types:\n  a10g: {resources: {GPU: 1}}\n")
    assert read_node_types(str(path)) == ((), str(path))  # max_workers 0: it adds nothing
    with pytest.raises(FileNotFoundError, match="CKVAL_NODE_TYPES names .*missing.yaml"):
        read_node_types(str(tmp_path / "missing.yaml"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert read_node_types(None) is None  # no ~/ray_bootstrap_config.yaml here
    (tmp_path / "ray_bootstrap_config.yaml").write_text(path.read_text().replace(" 0", " 3"))
    [offer], source = read_node_types(None)
    assert (offer.name, offer.max_count) == ("a10g", 3)
    assert source == str(tmp_path / "ray_bootstrap_config.yaml")


class CountingCapacity(ClusterCapacity):
    """The cluster's offer from a list of offers, one per read."""

    def __init__(self, offers):
        super().__init__(max_age_s=3600)
        self.offers = list(offers)
        self.reads = 0

    def _read(self) -> ClusterOffer:
        self.reads += 1
        return self.offers.pop(0)


def test_a_never_is_read_afresh_before_it_stands():
    grown = ClusterOffer((HEAD, Offer("node", "5e6f7a8b", {"CPU": 1.0, "GPU": 1.0})), (), None)
    capacity = CountingCapacity([ClusterOffer((HEAD,), (), None, False), grown])
    verdict = capacity.judge({"num_gpus": 1})
    assert verdict.feasible and verdict.fits_now == ("5e6f7a8b",) and capacity.reads == 2
    assert capacity.judge({"num_cpus": 1}).feasible and capacity.reads == 2  # cached


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("CKVAL_NODE_TYPES", '{"a10g": 4}', "CKVAL_NODE_TYPES is not a node types mapping"),
        ("CKVAL_NODE_TYPES", "{not json", "CKVAL_NODE_TYPES is not a node types mapping"),
        ("CKVAL_RESOURCE_WAIT_S", "-1", "CKVAL_RESOURCE_WAIT_S must be a positive number"),
    ],
)
def test_bad_settings_are_named_before_anything_starts(monkeypatch, name, value, said):
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidSettings, match=said):
        Settings()
