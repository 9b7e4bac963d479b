"""The files under deploy/ match their schemas (KubeRay's RayCluster CRD, a Kubernetes subset,
Ray's cluster-launcher schema) and keep the deployment's promises: two service replicas,
secrets only from Secrets, GCS fault tolerance on a Redis with a password from a Secret."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")
referencing = pytest.importorskip("referencing")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
LAUNCHER = DEPLOY / "ray-cluster-launcher" / "cluster.yaml"
LAUNCHER_ENV = DEPLOY / "ray-cluster-launcher" / "ckval.env.example"

KUBERAY_URI = "urn:ckval:schemas:kuberay-v1.6.2-raycluster-v1"
SUBSET_URI = "urn:ckval:schemas:k8s-core-subset"

# Variables whose value is a secret: in a pod they may only come from a Secret, by key.
SECRET_VARIABLES = {
    "CKVAL_DATABASE_URL",
    "CKVAL_API_TOKEN",
    "CKVAL_SECRET_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "REDIS_PASSWORD",
    "REDISCLI_AUTH",
}
# A user and a password in a URL: scheme://user:password@host.
CREDENTIALS_IN_URL = re.compile(r"://[^/\s:@]+:[^@\s]+@")


def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


@functools.cache
def _documents() -> tuple[tuple[Path, dict[str, Any]], ...]:
    """Every YAML document under deploy/, parsed once (tests that change one copy it)."""
    return tuple(
        (path, doc)
        for path in _yaml_files()
        for doc in yaml.safe_load_all(path.read_text())
        if doc is not None
    )


def _objects(kind: str | None = None) -> list[dict[str, Any]]:
    """The Kubernetes objects under deploy/, of one kind or all."""
    return [
        doc
        for _, doc in _documents()
        if "apiVersion" in doc and (kind is None or doc.get("kind") == kind)
    ]


def _one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in _objects(kind) if o["metadata"]["name"] == name]
    return found


def _object_id(path: Path, doc: dict[str, Any]) -> str:
    return f"{path.relative_to(DEPLOY)}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists the known ones and says
    nothing of others, as `kubectl apply --validate=strict` refuses them."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if (
        strict.get("type") == "object"
        and "properties" in strict
        and "additionalProperties" not in strict
        and not strict.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


def _kubernetes_validator(kind: str) -> Any:
    from referencing.jsonschema import DRAFT202012

    def load(name: str) -> Any:
        return _strict(json.loads((SCHEMAS / name).read_text()))

    subset = load("k8s-core-subset.schema.json")
    assert kind in subset["$defs"], f"no schema for kind {kind} in k8s-core-subset.schema.json"
    registry = referencing.Registry().with_resources(
        [
            (KUBERAY_URI, DRAFT202012.create_resource(load("kuberay-v1.6.2-raycluster-v1.json"))),
            (SUBSET_URI, DRAFT202012.create_resource(subset)),
        ]
    )
    return jsonschema.Draft202012Validator(
        {"$ref": f"{SUBSET_URI}#/$defs/{kind}"}, registry=registry
    )


def _pod_templates(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod template) of a Deployment, a Job or a RayCluster's head and groups."""
    spec = obj.get("spec", {})
    if obj["kind"] in ("Deployment", "Job"):
        yield obj["metadata"]["name"], spec["template"]
    elif obj["kind"] == "RayCluster":
        yield "head", spec["headGroupSpec"]["template"]
        for group in spec.get("workerGroupSpecs", []):
            yield group["groupName"], group["template"]


def _containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    pod = template["spec"]
    return pod.get("initContainers", []) + pod["containers"]


def _all_containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in _objects():
        for where, template in _pod_templates(obj):
            for container in _containers(template):
                name = f"{obj['kind']}/{obj['metadata']['name']}"
                yield f"{name}:{where}:{container['name']}", container


def _effective_env(container: dict[str, Any]) -> dict[str, Any]:
    """The container's variables as Kubernetes sets them: envFrom ConfigMaps of deploy/
    first, then env (which wins). Values from a Secret stay as their valueFrom."""
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            config_map = _one("ConfigMap", source["configMapRef"]["name"])
            env.update(config_map.get("data", {}))
    for variable in container.get("env", []):
        env[variable["name"]] = variable.get("value", variable.get("valueFrom"))
    return env


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _env_file(path: Path) -> dict[str, str]:
    """KEY=value lines of a file that bash sources with `set -a`; comments left out."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            (values[name],) = shlex.split(value) or [""]
    return values


# ----------------------------------------------------------------------------- schemas


def test_every_yaml_file_under_deploy_is_a_kubernetes_object_or_the_launcher_config():
    documents = _documents()
    assert {path.name for path, _ in documents} >= {
        "ckval-config.yaml",
        "ckval-service.yaml",
        "raycluster.yaml",
        "redis.yaml",
        "cluster.yaml",
    }
    for path, doc in documents:
        assert isinstance(doc, dict), path
        is_object = {"apiVersion", "kind", "metadata"} <= doc.keys()
        assert is_object or path == LAUNCHER, f"{path}: not a Kubernetes object"


@pytest.mark.parametrize(
    "path, obj",
    [
        pytest.param(path, doc, id=_object_id(path, doc))
        for path, doc in _documents()
        if "apiVersion" in doc
    ],
)
def test_kubernetes_object_matches_its_schema(path: Path, obj: dict[str, Any]):
    validator = _kubernetes_validator(obj["kind"])
    errors = [
        f"{'/'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(obj)
    ]
    assert not errors, f"{path.relative_to(DEPLOY)}: {obj['kind']}:\n" + "\n".join(errors)


def test_schemas_refuse_misspelt_and_mistyped_fields():
    """The strict schemas catch the mistakes the API server would drop or refuse."""
    cluster = _one("RayCluster", "ckval")
    misspelt = copy.deepcopy(cluster)
    (head,) = misspelt["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    head["env"][0]["valueFrom"]["secretKeyref"] = {"name": "x", "key": "y"}
    assert not _kubernetes_validator("RayCluster").is_valid(misspelt)
    serve = _one("Deployment", "ckval-serve")
    mistyped = copy.deepcopy(serve)
    mistyped["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "CKVAL_HTTP_PORT", "value": 8780}
    )
    assert not _kubernetes_validator("Deployment").is_valid(mistyped)
    assert _kubernetes_validator("Deployment").is_valid(serve)


def _launcher_schema() -> dict[str, Any]:
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.submodule_search_locations
    location = Path(next(iter(spec.submodule_search_locations)))
    return json.loads((location / "autoscaler" / "ray-schema.json").read_text())


def test_launcher_config_matches_rays_cluster_launcher_schema():
    schema = _launcher_schema()
    config = yaml.safe_load(LAUNCHER.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [
        f"{'/'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(config)
    ]
    assert not errors, "\n".join(errors)
    assert config["head_node_type"] in config["available_node_types"]


def test_rays_own_launcher_checks_accept_the_config():
    """What `ray up` runs before it starts anything: defaults filled in, then validated."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(yaml.safe_load(LAUNCHER.read_text()))
    validate_config(config)
    assert config["available_node_types"][config["head_node_type"]]["max_workers"] == 0


# ----------------------------------------------------------------------------- facts


def test_the_service_runs_two_replicas():
    """CKVAL_REPLICAS=2 reaches `ckval serve` (which starts the replicas with its settings)
    and every Ray pod (where a report() that finds no service starts one); the launcher
    loads it from ckval.env on every node."""
    serve = _one("Deployment", "ckval-serve")
    (container,) = serve["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["ckval", "serve"]
    assert _effective_env(container).get("CKVAL_REPLICAS") == "2"
    # One pod serves the API; the replicas are Ray actors, not pods.
    assert serve["spec"]["replicas"] == 1
    for where, template in _pod_templates(_one("RayCluster", "ckval")):
        (ray_container,) = template["spec"]["containers"]
        assert _effective_env(ray_container).get("CKVAL_REPLICAS") == "2", where

    assert _env_file(LAUNCHER_ENV)["CKVAL_REPLICAS"] == "2"
    config = yaml.safe_load(LAUNCHER.read_text())
    assert config["file_mounts"]["~/ckval.env"] == "deploy/ray-cluster-launcher/ckval.env"
    assert any(". ~/ckval.env" in command for command in config["setup_commands"])
    assert any("ckval serve --detach" in command for command in config["head_start_ray_commands"])


def test_secrets_come_from_secret_key_refs():
    """Every secret variable of every container is read from a Secret by key; no container
    takes a whole Secret (envFrom), so each pod reads only the secrets it names."""
    seen = set()
    for where, container in _all_containers():
        for source in container.get("envFrom", []):
            assert "secretRef" not in source, f"{where}: envFrom secretRef {source}"
        for variable in container.get("env", []):
            if variable["name"] not in SECRET_VARIABLES:
                continue
            seen.add(variable["name"])
            assert "value" not in variable, f"{where}: {variable['name']} is inline"
            reference = variable.get("valueFrom", {}).get("secretKeyRef", {})
            assert reference.get("name") and reference.get("key"), f"{where}: {variable}"

    def secret_of(container: dict[str, Any], name: str) -> tuple[str, str] | None:
        value = _effective_env(container).get(name)
        if not isinstance(value, dict) or "secretKeyRef" not in value:
            return None
        return value["secretKeyRef"]["name"], value["secretKeyRef"]["key"]

    (serve,) = _one("Deployment", "ckval-serve")["spec"]["template"]["spec"]["containers"]
    assert secret_of(serve, "CKVAL_DATABASE_URL") == ("ckval-secrets", "CKVAL_DATABASE_URL")
    assert secret_of(serve, "CKVAL_API_TOKEN") == ("ckval-api-token", "token")
    assert secret_of(serve, "CKVAL_SECRET_KEY") == ("ckval-secret-key", "key")
    (upgrade,) = _one("Job", "ckval-db-upgrade")["spec"]["template"]["spec"]["containers"]
    assert secret_of(upgrade, "CKVAL_DATABASE_URL") == ("ckval-secrets", "CKVAL_DATABASE_URL")
    for where, template in _pod_templates(_one("RayCluster", "ckval")):
        (ray_container,) = template["spec"]["containers"]
        assert secret_of(ray_container, "CKVAL_DATABASE_URL") == (
            "ckval-secrets",
            "CKVAL_DATABASE_URL",
        ), where
        assert secret_of(ray_container, "CKVAL_SECRET_KEY") == ("ckval-secret-key", "key")
        # The API token guards the HTTP API only: no Ray pod gets it.
        assert "CKVAL_API_TOKEN" not in _effective_env(ray_container), where
    assert {"CKVAL_DATABASE_URL", "CKVAL_API_TOKEN", "REDIS_PASSWORD"} <= seen


def test_no_password_or_token_is_inline():
    """No file under deploy/ holds a secret: no Secret objects with data (they are created
    from the shell), no secret in a ConfigMap, no credentials in a URL, no Redis password
    in the RayCluster or the launcher's config."""
    for path, doc in _documents():
        if doc.get("kind") == "Secret":
            assert not doc.get("data") and not doc.get("stringData"), _object_id(path, doc)
        if doc.get("kind") == "ConfigMap":
            leaked = SECRET_VARIABLES & set(doc.get("data", {}))
            assert not leaked, f"{_object_id(path, doc)}: {leaked}"
        for text in _strings(doc):
            assert not CREDENTIALS_IN_URL.search(text), f"{path}: {text!r}"

    cluster = _one("RayCluster", "ckval")
    password = cluster["spec"]["gcsFaultToleranceOptions"]["redisPassword"]
    assert "value" not in password
    assert "redis-password" not in cluster["spec"]["headGroupSpec"]["rayStartParams"]

    config = yaml.safe_load(LAUNCHER.read_text())
    for command in _strings(config):
        assert "CKVAL_DATABASE_URL=" not in command and "CKVAL_API_TOKEN=" not in command
        for match in re.finditer(r"--redis-password[= ](\S+)", command):
            assert match.group(1).strip("\"'").startswith("$"), command
    # The launcher's secrets file is git-ignored; its template holds placeholders only.
    ignored = (LAUNCHER.parent / ".gitignore").read_text().split()
    assert "ckval.env" in ignored
    template = _env_file(LAUNCHER_ENV)
    for name in SECRET_VARIABLES & template.keys():
        assert "CHANGE_ME" in template[name], name


def test_gcs_fault_tolerance_keeps_state_in_redis():
    """The RayCluster turns on GCS fault tolerance the way KubeRay v1.6 expects it, against
    the Redis of redis.yaml, which requires the same password and persists its data."""
    cluster = _one("RayCluster", "ckval")
    options = cluster["spec"]["gcsFaultToleranceOptions"]
    # The legacy switch, which KubeRay refuses next to gcsFaultToleranceOptions.
    assert "ray.io/ft-enabled" not in cluster["metadata"].get("annotations", {})
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    head_env = {variable["name"] for variable in head.get("env", [])}
    assert not head_env & {"RAY_REDIS_ADDRESS", "REDIS_PASSWORD"}

    host, _, port = options["redisAddress"].partition(":")
    service = _one("Service", host)
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    (redis,) = [
        d
        for d in _objects("Deployment")
        if service["spec"]["selector"].items()
        <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    pod = redis["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"].startswith("redis:")

    password_ref = options["redisPassword"]["valueFrom"]["secretKeyRef"]
    redis_env = {v["name"]: v.get("valueFrom", {}).get("secretKeyRef") for v in container["env"]}
    assert redis_env["REDIS_PASSWORD"] == password_ref
    command = " ".join(container["command"] + container["args"])
    assert "requirepass" in command and "$REDIS_PASSWORD" in command
    # Persistence: the append-only file on a PersistentVolumeClaim of deploy/.
    assert "--appendonly yes" in command
    (data,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/data"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == data["name"]]
    _one("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])


def test_launcher_can_turn_on_gcs_fault_tolerance_from_ckval_env():
    """The launcher keeps GCS fault tolerance off by default (deploy/README.md says why);
    the head's `ray start` takes the Redis password from ckval.env when it is turned on."""
    config = yaml.safe_load(LAUNCHER.read_text())
    (start,) = [c for c in config["head_start_ray_commands"] if "ray start --head" in c]
    assert '${RAY_REDIS_ADDRESS:+--redis-password="$REDIS_PASSWORD"}' in start
    template = LAUNCHER_ENV.read_text()
    for name in ("RAY_REDIS_ADDRESS", "REDIS_PASSWORD", "RAY_external_storage_namespace"):
        assert re.search(rf"^# {name}=", template, re.MULTILINE), name


def test_the_node_types_ckval_reads_on_kuberay_are_the_worker_groups_of_the_raycluster():
    """CKVAL_NODE_TYPES (ckval-config.yaml) lists raycluster.yaml's worker groups: a
    validation no group offers fails at once, one a group offers waits for its pod."""
    from validation_service.capacity import read_node_types

    config = _one("ConfigMap", "ckval-config")["data"]
    offers, source = read_node_types(config["CKVAL_NODE_TYPES"])
    assert source == "CKVAL_NODE_TYPES"
    declared = {
        offer.name: (dict(offer.resources), offer.max_count, offer.open_amounts) for offer in offers
    }
    groups = {}
    for group in _one("RayCluster", "ckval")["spec"]["workerGroupSpecs"]:
        [container] = _containers(group["template"])
        limits = container["resources"]["limits"]
        resources = {"CPU": float(limits["cpu"])}
        if "nvidia.com/gpu" in limits:
            resources["GPU"] = float(limits["nvidia.com/gpu"])
        custom = group["rayStartParams"].get("resources")
        if custom:
            resources.update(json.loads(json.loads(custom)))  # KubeRay's quoting, twice
        # Memory is left to Ray's detection: any amount may come.
        open_amounts = frozenset({"memory", "object_store_memory"})
        groups[group["groupName"]] = (resources, group["maxReplicas"], open_amounts)
    assert declared == groups
    assert int(config["CKVAL_RESOURCE_WAIT_S"]) >= 600  # a GPU node takes minutes
