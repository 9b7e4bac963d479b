"""What a Ray cluster can offer a validation: the resources of its nodes and of the node
types its autoscaler can add, and whether a job's request fits any of them. Where it fits
none, the verdict names what is missing and lists what the cluster offers.

The judging (``ClusterOffer.judge``) needs no Ray; ``ClusterCapacity`` reads the offer of
the Ray cluster this process is connected to: its alive nodes (``ray.nodes()``) and the
node types, from CKVAL_NODE_TYPES, else the cluster config an autoscaler reported to the
GCS, else the cluster launcher's config on this node (``~/ray_bootstrap_config.yaml``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ACCELERATOR_TYPE_PREFIX = "accelerator_type:"
# Ray asks a sliver of the node's "accelerator_type:<T>" resource for accelerator_type=T.
ACCELERATOR_TYPE_SLIVER = 0.001
# Ray's accelerator resources: what an attempt's accelerator count is counted in.
ACCELERATOR_RESOURCES = ("GPU", "TPU", "NPU", "HPU", "neuron_cores")
# A node type read from a config that names no CPUs leaves these to Ray's detection from
# its instance type (unknown amounts, then): a launcher config before `ray up` fills it.
# One that names its CPUs (the filled config, CKVAL_NODE_TYPES) names its GPUs too, and
# leaves only memory. Accelerator types and custom resources a node type offers, it names.
DETECTED_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
DETECTED_MEMORY = frozenset({"memory", "object_store_memory"})
# The cluster launcher writes the config its autoscaler reads here, on the head node.
LAUNCHER_CONFIG = "~/ray_bootstrap_config.yaml"
_BOOKKEEPING = re.compile(r"^node:|^object_store_memory$")
# How many nodes and node types an error lists before it says "and N more".
LISTED_OFFERS = 8


def task_options(resources: Mapping[str, Any]) -> dict[str, Any]:
    """Ray task options from a job's validation_resources."""
    options: dict[str, Any] = {"num_cpus": resources.get("num_cpus", 1)}
    if resources.get("num_gpus"):
        options["num_gpus"] = resources["num_gpus"]
    if resources.get("memory"):
        options["memory"] = resources["memory"]
    if resources.get("resources"):
        options["resources"] = dict(resources["resources"])
    if resources.get("accelerator_type"):
        options["accelerator_type"] = resources["accelerator_type"]
    return options


def demand_of(resources: Mapping[str, Any]) -> dict[str, float]:
    """The Ray resources a validation's task asks of one node, as Ray counts them."""
    options = task_options(resources)
    demand = {
        "CPU": options["num_cpus"],
        "GPU": options.get("num_gpus", 0),
        "memory": options.get("memory", 0),
        **options.get("resources", {}),
    }
    if options.get("accelerator_type"):
        demand[ACCELERATOR_TYPE_PREFIX + options["accelerator_type"]] = ACCELERATOR_TYPE_SLIVER
    return {name: float(amount) for name, amount in demand.items() if amount}


def accelerators_held(assigned: Mapping[str, float]) -> float:
    """How many accelerators a task held, from the resources Ray assigned it."""
    return float(sum(assigned.get(name, 0.0) for name in ACCELERATOR_RESOURCES))


def accelerator_type_in(resources: Mapping[str, float]) -> str | None:
    """The accelerator type a node (or an assignment) names, e.g. "A10G"; None if none."""
    for name in sorted(resources):
        if name.startswith(ACCELERATOR_TYPE_PREFIX):
            return name[len(ACCELERATOR_TYPE_PREFIX) :]
    return None


@dataclasses.dataclass(frozen=True)
class Offer:
    """One node of the cluster, or one node type its autoscaler can add."""

    kind: str  # "node" or "node type"
    name: str
    resources: Mapping[str, float]
    max_count: int | None = None  # node types: at most this many nodes (None: no cap)
    # Resources whose amount it leaves to detection: any amount may come.
    open_amounts: frozenset[str] = frozenset()

    def amount(self, name: str) -> float:
        return math.inf if name in self.open_amounts else float(self.resources.get(name, 0.0))

    def fits(self, demand: Mapping[str, float]) -> bool:
        return all(self.amount(name) >= amount for name, amount in demand.items())

    def label(self) -> str:
        cap = "" if self.max_count is None else f", up to {self.max_count}"
        shown = [
            _named(name, value)
            for name, value in sorted(self.resources.items())
            if not _BOOKKEEPING.search(name)
        ]
        shown += [f"{name} (detected)" for name in sorted(self.open_amounts - set(self.resources))]
        return f"{self.kind} {self.name}{cap}: {', '.join(shown) or 'nothing'}"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether a demand can be served on the cluster: now by a node, later by a node the
    autoscaler adds, never (``feasible`` False), or cannot tell (None)."""

    demand: dict[str, float]
    fits_now: tuple[str, ...]
    fits_later: tuple[str, ...]
    feasible: bool | None
    reason: str

    def waiting_for(self) -> dict[str, Any]:
        """What a job that waits for these resources waits for, as the registry keeps it."""
        return {
            "resources": self.demand,
            "fits": [
                *(f"node {name}" for name in self.fits_now),
                *(f"node type {name}" for name in self.fits_later),
            ],
            "note": self.reason,
        }


@dataclasses.dataclass(frozen=True)
class ClusterOffer:
    """A cluster's alive nodes and the node types its autoscaler can add.

    ``node_types_from`` says where the node types were read (None: they are not known);
    ``autoscaler``: True where one can add nodes, False where none can (the cluster is
    its nodes), None where this cannot be told.
    """

    nodes: tuple[Offer, ...] = ()
    node_types: tuple[Offer, ...] = ()
    node_types_from: str | None = None
    autoscaler: bool | None = None

    def judge(self, demand: Mapping[str, float]) -> Verdict:
        demand = dict(demand)
        now = tuple(node.name for node in self.nodes if node.fits(demand))
        later = tuple(kind.name for kind in self.node_types if kind.fits(demand))
        if now:
            reason = "the node(s) that offer these resources are busy with other work"
            return Verdict(demand, now, later, True, reason)
        if later:
            reason = f"the autoscaler can add a node of type {', '.join(later)}"
            return Verdict(demand, now, later, True, reason)
        if self.node_types_from is not None or self.autoscaler is False:
            return Verdict(demand, now, later, False, self.explain(demand))
        reason = (
            "no node offers these resources now, and the node types the autoscaler can add "
            "are not known to ckval (set CKVAL_NODE_TYPES): the job waits for a node, at "
            "most CKVAL_RESOURCE_WAIT_S"
        )
        return Verdict(demand, now, later, None, reason)

    def explain(self, demand: Mapping[str, float]) -> str:
        """Why no node (type) fits ``demand``: what is missing, and what the cluster offers."""
        offers = [*self.nodes, *self.node_types]
        where = "no node of the cluster"
        if self.node_types_from is not None:
            where += f" and no node type its autoscaler can add ({self.node_types_from})"
        problems = []
        for name, amount in sorted(demand.items()):
            most = max((offer.amount(name) for offer in offers), default=0.0)
            if most <= 0:
                problems.append(f"none offers {name!r}{_did_you_mean(name, offers)}")
            elif most < amount:
                problems.append(
                    f"{_named(name, amount)} asked, at most {_amount(name, most)} on one node"
                )
        if not problems:
            problems.append("none offers all of them on one node")
        return (
            f"{where} can ever run a task that asks for {describe_resources(demand)}: "
            f"{'; '.join(problems)}. The cluster offers {self.describe()}"
        )

    def describe(self) -> str:
        """The accelerator types and resources of every node and node type, in a line."""
        offers = [*self.nodes, *self.node_types]
        kinds = sorted({kind for offer in offers if (kind := accelerator_type_in(offer.resources))})
        text = f"accelerator types {', '.join(kinds)}; " if kinds else "no accelerator type; "
        labels = list(dict.fromkeys(offer.label() for offer in offers))
        listed = "; ".join(labels[:LISTED_OFFERS])
        if len(labels) > LISTED_OFFERS:
            listed += f"; and {len(labels) - LISTED_OFFERS} more"
        return text + (listed or "no node")


def _did_you_mean(name: str, offers: Iterable[Offer]) -> str:
    """ " (did you mean 'X'?)" where an offered resource differs from ``name`` in case only."""
    for offer in offers:
        for offered in offer.resources:
            if offered.lower() == name.lower():
                return f" (did you mean {offered!r}?)"
    return ""


def _amount(name: str, value: float) -> str:
    if name.startswith(ACCELERATOR_TYPE_PREFIX):
        return ""
    if name == "memory":
        return f"{value / 2**30:.3g} GiB"
    return f"{value:g}"


def _named(name: str, value: float) -> str:
    """A resource and its amount as people read them: "GPU 1", "memory 2 GiB", and an
    accelerator type without Ray's sliver of it."""
    amount = _amount(name, value)
    return f"{name} {amount}" if amount else name


def describe_resources(demand: Mapping[str, float]) -> str:
    """Ray resources as people read them: {CPU 1, GPU 1, accelerator_type:A10G}."""
    return "{" + ", ".join(_named(name, value) for name, value in sorted(demand.items())) + "}"


# ---------------------------------------------------------------- node types
def node_types_from_config(config: Mapping[str, Any]) -> tuple[Offer, ...]:
    """The node types an autoscaler can add, from a cluster launcher config (its
    ``available_node_types``, less the head's type) or that mapping itself: those whose
    max_workers (default: the config's) is above 0."""
    types = config.get("available_node_types", config)
    if not isinstance(types, Mapping):
        raise ValueError("available_node_types must map node type names to their config")
    launcher = "available_node_types" in config
    cap = config.get("max_workers") if launcher else None
    head = config.get("head_node_type") if launcher else None
    offers = []
    for name, node_type in types.items():
        if not isinstance(node_type, Mapping):
            raise ValueError(f"node type {name!r} must be a mapping with 'resources'")
        resources = node_type.get("resources") or {}
        count = node_type.get("max_workers", cap)
        if name == head or count == 0 or cap == 0:
            continue  # the autoscaler never adds one (the head is a node already)
        values = {str(k): float(v) for k, v in resources.items()}
        detected = (DETECTED_MEMORY if "CPU" in values else DETECTED_RESOURCES) - set(values)
        offers.append(Offer("node type", str(name), values, count, detected))
    return tuple(offers)


def read_node_types(setting: str | None) -> tuple[tuple[Offer, ...], str] | None:
    """The node types CKVAL_NODE_TYPES gives (inline JSON, or a path to a launcher config
    in YAML or JSON), else the launcher's config on this node; None where neither is."""
    if setting and setting.lstrip().startswith("{"):
        return node_types_from_config(json.loads(setting)), "CKVAL_NODE_TYPES"
    path = Path(os.path.expanduser(setting or LAUNCHER_CONFIG))
    if not path.is_file():
        if setting:
            raise FileNotFoundError(f"CKVAL_NODE_TYPES names {path}, which is not a file")
        return None
    import yaml  # Ray's own dependency

    return node_types_from_config(yaml.safe_load(path.read_text()) or {}), str(path)


# ----------------------------------------------------- the cluster, read from Ray
class ClusterCapacity:
    """The offer of the Ray cluster this process is connected to, read at most every
    ``max_age_s`` seconds (the nodes, the node types and whether an autoscaler runs)."""

    def __init__(self, node_types_setting: str | None = None, max_age_s: float = 5.0):
        self.node_types_setting = node_types_setting
        self.max_age_s = max_age_s
        self._offer: ClusterOffer | None = None
        self._read_at = -math.inf
        self._accelerator_types: dict[str, str | None] = {}

    def offer(self, *, fresh: bool = False) -> ClusterOffer:
        if fresh or self._offer is None or time.monotonic() - self._read_at > self.max_age_s:
            self._offer = self._read()
            self._read_at = time.monotonic()
        return self._offer

    def judge(self, resources: Mapping[str, Any]) -> Verdict:
        """The verdict on a job's validation_resources; a "never" is read afresh before
        it stands (a node may have joined since the last read)."""
        demand = demand_of(resources)
        verdict = self.offer().judge(demand)
        if verdict.feasible is False:
            verdict = self.offer(fresh=True).judge(demand)
        return verdict

    def accelerator_type_of(self, node_id: str) -> str | None:
        """The accelerator type of a node (its "accelerator_type:<T>" resource)."""
        if node_id not in self._accelerator_types:
            import ray

            for node in ray.nodes():
                kind = accelerator_type_in(node.get("Resources") or {})
                self._accelerator_types[node["NodeID"]] = kind
        return self._accelerator_types.get(node_id)

    def _read(self) -> ClusterOffer:
        import ray

        from validation_service import _ray_compat

        alive = [node for node in ray.nodes() if node.get("Alive")]
        nodes = tuple(
            Offer("node", node["NodeID"][:8], dict(node.get("Resources") or {})) for node in alive
        )
        for node in alive:
            self._accelerator_types[node["NodeID"]] = accelerator_type_in(node["Resources"])
        found = self._node_types()
        if found is not None:
            return ClusterOffer(nodes, found[0], found[1], autoscaler=bool(found[0]))
        kind = _ray_compat.autoscaler_kind()
        autoscaler = None if kind is None else kind != "none"
        return ClusterOffer(nodes, (), None, autoscaler)

    def _node_types(self) -> tuple[tuple[Offer, ...], str] | None:
        from validation_service import _ray_compat

        try:
            if self.node_types_setting:
                return read_node_types(self.node_types_setting)
            reported = _ray_compat.autoscaler_node_types()
            if reported is not None:
                offers = tuple(
                    Offer("node type", name, resources, None if count < 0 else count)
                    for name, resources, count in reported
                    if count != 0
                )
                return offers, "the autoscaler's cluster config"
            return read_node_types(None)
        except Exception as exc:  # noqa: BLE001 - then the types are unknown: jobs wait
            logger.warning("the autoscaler's node types could not be read: %s", exc)
            return None
