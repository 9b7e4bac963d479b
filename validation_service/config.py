"""Settings for ckval: one place for every default, read from CKVAL_* environment variables."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

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

    # Run attempts: a run name reused after the run ended keeps adding to its last attempt.
    append: bool = False

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


def ckval_env() -> dict[str, str]:
    """The CKVAL_* variables of this process, to hand on to Ray workers and actors."""
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}


def get_settings(**overrides) -> Settings:
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
