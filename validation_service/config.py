"""Settings for ckval: one place for every default, read from CKVAL_* environment variables."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

ENV_PREFIX = "CKVAL_"


def _default_home() -> Path:
    return Path(os.path.expanduser("~/.ckval"))


class Settings(BaseSettings):
    """Configuration shared by training workers, the service and the query side.

    Every field can be set with an environment variable named ``CKVAL_<FIELD>``.
    The embedded default keeps everything under ``home``: a SQLite registry and a
    local checkpoint folder.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    home: Path = Field(default_factory=_default_home)
    database_url: str | None = None
    storage: str | None = None
    # Passed to fsspec for the storage URI, e.g. {"endpoint_url": "http://127.0.0.1:9000"}.
    storage_options: dict[str, Any] = Field(default_factory=dict)
    ray_address: str | None = None
    namespace: str = "default"

    service_name: str = "ckval-service"
    ray_namespace: str = "ckval"
    # Concurrency per resource pool; a pool not named here gets default_pool_size.
    pools: dict[str, int] = Field(default_factory=dict)
    default_pool_size: int = 4
    lease_s: float = 60.0
    heartbeat_s: float = 10.0
    poll_interval_s: float = 1.0
    retry_backoff_s: float = 1.0
    retry_backoff_max_s: float = 300.0
    # How long report() keeps delivering a report in the background while the registry
    # is unreachable, before the next report() raises ReportNotDelivered.
    delivery_timeout_s: float = 600.0

    http_host: str = "127.0.0.1"
    http_port: int = 8780

    # Payload signing (validation_service/signing.py) and the modules validate_fn may name.
    secret_key: str | None = Field(default=None, repr=False)
    secret_key_previous: str | None = Field(default=None, repr=False)
    allowed_modules: Annotated[list[str] | None, NoDecode] = None

    @field_validator("allowed_modules", mode="before")
    @classmethod
    def _split_allowed_modules(cls, value: Any) -> Any:
        # CKVAL_ALLOWED_MODULES is a JSON list or comma-separated; empty means unrestricted.
        if isinstance(value, str):
            text = value.strip()
            value = json.loads(text) if text.startswith("[") else text.split(",")
        if isinstance(value, (list, tuple)):
            value = [str(item).strip() for item in value if str(item).strip()]
            return value or None
        return value

    def resolved_home(self) -> Path:
        return Path(os.path.expanduser(str(self.home)))

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.resolved_home() / 'registry.db'}"

    def resolved_storage(self) -> str:
        if self.storage:
            return self.storage
        return str(self.resolved_home() / "checkpoints")

    def pool_size(self, pool: str) -> int:
        return self.pools.get(pool, self.default_pool_size)


def ckval_env(*, include_secrets: bool = False) -> dict[str, str]:
    """The CKVAL_* variables of this process, to hand on to Ray workers and actors.

    For Ray's ``runtime_env``, which Ray's state API and dashboard show to anyone who can
    see the cluster, variables that hold a secret (a database URL with a password,
    CKVAL_SECRET_KEY, CKVAL_API_TOKEN, storage credentials) are left out and named in
    CKVAL_WITHHELD instead: a worker that lacks them in its own environment gets them
    from the service actor (trainer_integration's resolve_settings). ``include_secrets``
    is for channels that are not shown, such as a Dask task's arguments.
    """
    from validation_service.secrets import WITHHELD_VAR, secret_env_vars

    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX) and k != WITHHELD_VAR}
    if include_secrets:
        return env
    withheld = secret_env_vars(env)
    for name in withheld:
        del env[name]
    if withheld:
        env[WITHHELD_VAR] = ",".join(withheld)
    return env


def get_settings(**overrides) -> Settings:
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
