"""Settings for ckval: one place for every default, read from CKVAL_* environment variables."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from validation_service import _home
from validation_service._home import ENV_PREFIX, env_var
from validation_service.errors import InvalidSettings
from validation_service.names import RULE as NAME_RULE
from validation_service.names import is_safe_name, suggested_name
from validation_service.secrets import ckval_env  # noqa: F401 - also imported from here

# More replicas than this only add claim contention on one database.
MAX_REPLICAS = 16

# What each bounded number setting must be: the test of a value, and the error's words.
_NUMBER_RULES: dict[str, tuple[Callable[[float], bool], str]] = {
    **dict.fromkeys(
        (
            "lease_s",
            "poll_interval_s",
            "delivery_timeout_s",
            "watch_interval_s",
            "watch_settle_s",
            "resource_wait_s",
        ),
        (lambda value: math.isfinite(value) and value > 0, "must be a positive number of seconds"),
    ),
    # 0 is meaningful here: a heartbeat every loop, a retry without waiting.
    **dict.fromkeys(
        ("heartbeat_s", "retry_backoff_s", "retry_backoff_max_s"),
        (
            lambda value: math.isfinite(value) and value >= 0,
            "must be a number of seconds, 0 or more",
        ),
    ),
    "replicas": (
        lambda value: 1 <= value <= MAX_REPLICAS,
        f"must be 1 to {MAX_REPLICAS} service replicas (2 or 3 keep validations going when "
        "one is lost)",
    ),
    # 0 pauses a pool: its jobs stay queued until it is given a size again.
    "default_pool_size": (
        lambda value: value >= 0,
        "must be 0 (paused) or more (validations at once per pool)",
    ),
    "http_port": (lambda value: 0 <= value <= 65535, "must be a TCP port from 0 to 65535"),
}

# Settings given as JSON objects, with an example for the error that says how.
_JSON_OBJECT_EXAMPLES = {
    "storage_options": '{"endpoint_url": "http://127.0.0.1:9000"}',
    "pools": '{"A10G": 4, "CPU": 2}',
}


class Settings(BaseSettings):
    """Configuration shared by training workers, the service and the query side.

    Every field can be set with an environment variable named ``CKVAL_<FIELD>``.
    The embedded default keeps everything under ``home``: a SQLite registry and a
    local checkpoint folder.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    home: Path = Field(default_factory=_home.default_home)
    # Left out of repr(Settings): a URL or the options may carry a password or a key
    # (secrets.mask_url and secrets.public_settings show them masked).
    database_url: str | None = Field(default=None, repr=False)
    storage: str | None = None
    # Passed to fsspec for the storage URI, e.g. {"endpoint_url": "http://127.0.0.1:9000"}.
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    ray_address: str | None = None
    namespace: str = "default"

    # A namespace is a folder under the storage root: one safe path segment.
    @field_validator("namespace")
    @classmethod
    def _namespace_is_a_safe_name(cls, value: str) -> str:
        if not is_safe_name(value):
            raise ValueError(
                f"{value!r} is not allowed: use {NAME_RULE}; rename it, for example to "
                f"{suggested_name(value)!r}"
            )
        return value

    service_name: str = "ckval-service"
    ray_namespace: str = "ckval"
    # Service replicas claiming from one registry (PostgreSQL; SQLite has one writer, so
    # one replica). Each is a detached actor; the first supervises the others.
    replicas: int = 1
    # Concurrency per resource pool; a pool not named here gets default_pool_size.
    pools: dict[str, int] = Field(default_factory=dict)
    default_pool_size: int = 4
    lease_s: float = 60.0
    heartbeat_s: float = 10.0
    poll_interval_s: float = 1.0
    retry_backoff_s: float = 1.0
    retry_backoff_max_s: float = 300.0
    # The service starts its CPU pool's worker processes as a run sets up, and keeps them
    # started while the cluster is idle, with the frameworks the run uses imported, so
    # that a run's first validations start warm (Scheduler.warm_up and keep_warm).
    keep_warm: bool = True
    # How long report() keeps delivering a report in the background while the registry
    # is unreachable, before the next report() raises ReportNotDelivered.
    delivery_timeout_s: float = 600.0
    # Watched folders (Registry.watch): how often the service lists each one, and how
    # long a step folder without a completion marker must stay unchanged to be ready.
    watch_interval_s: float = 5.0
    watch_settle_s: float = 30.0
    # How long a claimed validation may wait for its Ray task to start (for a node the
    # autoscaler adds, for GPUs other work holds) before it ends FAILED
    # (ResourcesUnavailable). Its timeout_s counts only from when it runs.
    resource_wait_s: float = 1800.0
    # The node types the cluster's autoscaler can add, for telling a request no node can
    # ever serve (it fails at once) from one that waits for a node: a path to the cluster
    # launcher's config (YAML or JSON with available_node_types), or that mapping as JSON.
    # Unset: the config an autoscaler reported to Ray, else ~/ray_bootstrap_config.yaml.
    node_types: str | None = None

    @field_validator("node_types")
    @classmethod
    def _node_types_parse(cls, value: str | None) -> str | None:
        if value is not None and value.lstrip().startswith("{"):
            from validation_service.capacity import node_types_from_config

            try:
                node_types_from_config(json.loads(value))
            except (ValueError, TypeError, AttributeError) as exc:
                raise ValueError(
                    f"is not a node types mapping ({exc}); give "
                    '{"a10g": {"resources": {"CPU": 8, "GPU": 1, "accelerator_type:A10G": 1}, '
                    '"max_workers": 4}} or a path to the cluster launcher\'s config'
                ) from None
        return value or None

    http_host: str = "127.0.0.1"
    http_port: int = 8780

    def __init__(self, **values: Any) -> None:
        # A bad CKVAL_* variable is the user's to fix: one error naming each of them,
        # not pydantic's traceback.
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise InvalidSettings(_validation_message(exc, values)) from None
        except SettingsError as exc:
            raise InvalidSettings(_parsing_message(exc)) from None

    @field_validator(*_NUMBER_RULES)
    @classmethod
    def _within_bounds(cls, value: float, info: ValidationInfo) -> float:
        allowed, rule = _NUMBER_RULES[info.field_name]
        if not allowed(value):
            raise ValueError(f"{rule}, got {value!r}")
        return value

    @field_validator("pools")
    @classmethod
    def _pool_sizes(cls, pools: dict[str, int]) -> dict[str, int]:
        for name, size in pools.items():
            if not name or len(name) > 128:
                raise ValueError(f"has a pool name {name!r}; use 1 to 128 characters")
            if size < 0:
                raise ValueError(
                    f"gives pool {name!r} the size {size!r}; a pool runs 0 (paused) or more "
                    'validations at once, e.g. {"A10G": 4, "CPU": 2}'
                )
        return pools

    # Payload signing (validation_service/signing.py) and the modules validate_fn may name.
    secret_key: str | None = Field(default=None, repr=False)
    secret_key_previous: str | None = Field(default=None, repr=False)
    allowed_modules: Annotated[list[str] | None, NoDecode] = None

    @field_validator("allowed_modules", "allowed_commands", mode="before")
    @classmethod
    def _split_allowed_modules(cls, value: Any) -> Any:
        # CKVAL_ALLOWED_MODULES (CKVAL_ALLOWED_COMMANDS) is a JSON list or comma-separated;
        # empty means unrestricted (no command over HTTP).
        if isinstance(value, str):
            text = value.strip()
            value = json.loads(text) if text.startswith("[") else text.split(",")
        if isinstance(value, (list, tuple)):
            value = [str(item).strip() for item in value if str(item).strip()]
            return value or None
        return value

    # Programs (argv[0], exactly as given) that a command sent to the HTTP API's
    # POST /runs/{run}/revalidate may run (CKVAL_ALLOWED_COMMANDS, comma-separated or a
    # JSON list); unset: the API runs no command. Separate from allowed_modules, which
    # bounds what reporters' references import.
    allowed_commands: Annotated[list[str] | None, NoDecode] = None
    # Evaluations over history (revalidate) QUEUED or RUNNING per namespace beyond which
    # the HTTP API queues no more (CKVAL_MAX_QUEUED_EVALUATIONS).
    max_queued_evaluations: int = Field(default=10_000, ge=0)

    # Trackers that validated metrics are logged to: CKVAL_SINKS="mlflow,wandb" or a JSON
    # list such as [{"kind": "mlflow", "tracking_uri": "sqlite:///mlflow.db"}] (see sinks/).
    # Left out of repr(Settings): a tracking URI may carry a password.
    sinks: Annotated[list[dict[str, Any]], NoDecode] = Field(default_factory=list, repr=False)
    sink_attempts: int = 4
    sink_backoff_s: float = 2.0
    # MLflow tracking servers the MLflow sink may log to besides its own (the sink's
    # tracking_uri, else the service's MLFLOW_TRACKING_URI): a run's recorded server is
    # used only when it is one of these. CKVAL_MLFLOW_ALLOWED_URIS, comma-separated or a
    # JSON list; credentials in them stay with the service.
    mlflow_allowed_uris: Annotated[list[str], NoDecode] = Field(default_factory=list, repr=False)

    # MLflow experiments (names or ids; "*": any) whose runs the MLflow sink may log into
    # when a reporter recorded one; other runs get nothing, and the metrics go to the
    # sink's own run. CKVAL_MLFLOW_ALLOWED_EXPERIMENTS, comma-separated or a JSON list.
    mlflow_allowed_experiments: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # W&B entities ("*": any; "" for the API key's default one) whose recorded runs the
    # W&B sink may resume (CKVAL_WANDB_ALLOWED_ENTITIES); others get the sink's own run.
    wandb_allowed_entities: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Storage roots besides CKVAL_STORAGE under which gc, retention and the service may
    # delete checkpoint files (CKVAL_DELETABLE_ROOTS, comma-separated or a JSON list). A
    # run records the storage root its reporter chose: files under no root named here or
    # in CKVAL_STORAGE are kept.
    deletable_roots: Annotated[list[str], NoDecode] = Field(default_factory=list, repr=False)

    @field_validator(
        "mlflow_allowed_uris",
        "deletable_roots",
        "mlflow_allowed_experiments",
        "wandb_allowed_entities",
        mode="before",
    )
    @classmethod
    def _split_mlflow_allowed_uris(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else [u for u in text.split(",") if u]
        return value

    @field_validator("sinks", mode="before")
    @classmethod
    def _parse_sinks(cls, value: Any) -> list[dict[str, Any]]:
        from validation_service.sinks import parse_sinks

        return parse_sinks(value)

    # Run attempts: a run name reused after the run ended keeps adding to its last attempt.
    append: bool = False
    # Ranks of one sharded report that wrote different content under one file name:
    # "warn" keeps one rank's file (local storage: the lowest rank's; object storage: the
    # last written) and warns; "error" fails the report.
    shard_conflicts: Literal["warn", "error"] = "warn"

    def resolved_home(self) -> Path:
        return _home.resolved_home(self.home)

    def resolved_database_url(self) -> str:
        return _home.resolved_database_url(self.database_url, self.home)

    def resolved_storage(self) -> str:
        if self.storage:
            return self.storage
        return str(self.resolved_home() / "checkpoints")

    def deletion_roots(self) -> list[str]:
        """The storage roots checkpoint files may be deleted under: CKVAL_STORAGE (or the
        embedded default) and CKVAL_DELETABLE_ROOTS."""
        return [self.resolved_storage(), *self.deletable_roots]

    def replicas_for(self, database_url: str) -> int:
        """How many replicas the service runs on this database; raises InvalidSettings
        where more than one is set on SQLite."""
        if self.replicas > 1 and database_url.startswith("sqlite"):
            raise InvalidSettings(
                f"CKVAL_REPLICAS={self.replicas} needs a PostgreSQL registry: SQLite lets one "
                "process write at a time, so replicas would only wait on each other. Set "
                "CKVAL_REPLICAS=1, or CKVAL_DATABASE_URL=postgresql+psycopg://..."
            )
        return self.replicas

    def pool_size(self, pool: str) -> int:
        return self.pools.get(pool, self.default_pool_size)

    # HTTP API access control (api/guard.py): token, allowed Host headers, retry cap.
    # Bearer token of every route but /healthz; excluded from dumps and from ckval_env(),
    # so it never travels to Ray.
    api_token: SecretStr | None = Field(default=None, exclude=True)
    # Host headers the API answers; None: localhost, 127.0.0.1, ::1 and a non-wildcard
    # http_host; ["*"]: any.
    api_hosts: Annotated[list[str] | None, NoDecode] = None
    # Retries through the API: each grants max_attempts afresh, and a job makes at most
    # max_attempts x (1 + max_manual_retries) attempts in all.
    max_manual_retries: int = Field(default=3, ge=0)

    @field_validator("api_token", mode="before")
    @classmethod
    def _strip_api_token(cls, value: Any) -> Any:
        # A token read from a file often ends in a newline; an empty one means "unset".
        if isinstance(value, str):
            return value.strip() or None
        return value

    @field_validator("api_hosts", mode="before")
    @classmethod
    def _split_api_hosts(cls, value: Any) -> Any:
        # CKVAL_API_HOSTS is a JSON list or comma-separated names.
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [host.strip() for host in text.split(",") if host.strip()]
        return value


def get_settings(**overrides) -> Settings:
    """The CKVAL_* settings with ``overrides`` (None: not given) on top.

    Raises InvalidSettings naming each bad variable and what it must be.
    """
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def _validation_message(exc: ValidationError, given: dict[str, Any]) -> str:
    problems = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "?"
        name = env_var(field) if field not in given else f"{field} (or {env_var(field)})"
        got = _shown(field, error.get("input"))
        if field in _JSON_OBJECT_EXAMPLES and error["type"] in ("dict_type", "json_invalid"):
            problems.append(
                f"{name} must be a JSON object such as '{_JSON_OBJECT_EXAMPLES[field]}', got {got}"
            )
        elif error["type"] == "value_error":
            problems.append(f"{name} {error['ctx']['error']}")
        else:
            detail = error["msg"][0].lower() + error["msg"][1:]
            problems.append(f"{name}: {detail}, got {got}")
    return _settings_message(problems)


def _parsing_message(exc: SettingsError) -> str:
    """pydantic-settings could not parse a variable (a dict field's value is no JSON)."""
    found = re.search(r'field "(\w+)"', str(exc))
    if found is None:
        return _settings_message([str(exc)])
    field = found.group(1)
    value = os.environ.get(env_var(field), os.environ.get(env_var(field).lower()))
    example = _JSON_OBJECT_EXAMPLES.get(field)
    what = f"a JSON object such as '{example}'" if example else "valid JSON"
    return _settings_message([f"{env_var(field)} must be {what}, got {_shown(field, value)}"])


def _shown(field: str, value: Any) -> str:
    """A bad value as an error shows it: never one of a setting that may hold credentials."""
    from validation_service.secrets import CREDENTIAL_FIELDS, SECRET_FIELDS

    if field in (*CREDENTIAL_FIELDS, *SECRET_FIELDS):
        return "a value that is not shown here, as it may hold credentials"
    return repr(value)


def _settings_message(problems: list[str]) -> str:
    if len(problems) == 1:
        return f"Invalid setting: {problems[0]}. Fix that environment variable."
    listed = "; ".join(problems)
    return f"Invalid settings: {listed}. Fix those environment variables."
