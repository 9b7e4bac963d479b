"""The long-running service: a detached, named Ray actor that owns a Scheduler."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import ray

from validation_service.config import Settings, get_settings
from validation_service.logs import configure_logging
from validation_service.secrets import (
    SECRET_FIELDS,
    ckval_env,
    has_secret,
    mask_url,
    public_settings,
)

logger = logging.getLogger(__name__)


class _ServiceActor:
    """Runs the scheduler loop in a thread; its methods answer while the loop works.

    Its settings, secrets included, arrive as the constructor's argument: Ray's state API
    and dashboard show an actor's runtime_env, never its arguments.
    """

    def __init__(self, settings_json: str):
        from validation_service.registry.registry import Registry
        from validation_service.scheduler import Scheduler

        configure_logging()
        self.settings = Settings.model_validate_json(settings_json)
        # Only an embedded SQLite is migrated here; a server database is migrated as a
        # deploy step (`ckval db upgrade`), so a service never races a migration.
        self.registry = Registry(settings=self.settings)
        self.scheduler = Scheduler(self.registry, self.settings)
        self.started_at = time.time()
        self._thread = threading.Thread(
            target=self.scheduler.run_forever, name="ckval-scheduler", daemon=True
        )
        self._thread.start()

    def nudge(self) -> None:
        self.scheduler.wake()

    def check_leases(self) -> None:
        self.scheduler.check_leases()

    def warm_up(self, modules: list[str]) -> list[tuple[int, list[str]]]:
        """A run is starting: warm validation workers; returns each one's pid and imports."""
        try:
            return ray.get(self.scheduler.warm_up(modules), timeout=300)
        except Exception:  # noqa: BLE001 - best effort: validations start workers anyway
            logger.warning("warming validation workers failed", exc_info=True)
            return []

    def ping(self) -> str:
        return self.scheduler.owner

    def settings_json(self) -> str:
        """The service's settings without secrets (masked URL, no keys or tokens)."""
        return public_settings(self.settings).model_dump_json()

    def reporter_settings_json(self) -> str:
        """The full settings, signing key included, for reporters on Ray workers that lack
        the secrets the driver withheld from runtime_env. An actor call's result is not
        shown by Ray's state API; anyone who can run code on the cluster can call it, as
        they could read the workers' environment."""
        return self.settings.model_dump_json()

    def status(self) -> dict[str, Any]:
        return {
            "owner": self.scheduler.owner,
            "database_url": self.registry.display_url,
            "storage": mask_url(self.settings.resolved_storage()),
            "pools": self.settings.pools,
            "default_pool_size": self.settings.default_pool_size,
            "in_flight": self.scheduler.in_flight,
            "uptime_s": round(time.time() - self.started_at, 1),
            "pid": os.getpid(),
            "alive": self._thread.is_alive(),
            **self.scheduler.stats,
        }

    def shutdown(self) -> None:
        self.scheduler.stop()
        self._thread.join(timeout=30)


class ServiceHandle:
    """A handle on the running service actor."""

    def __init__(self, actor, settings: Settings):
        self.actor = actor
        self.settings = settings

    def nudge(self) -> None:
        self.actor.nudge.remote()

    def check_leases(self) -> None:
        """After a cancellation: the service stops the cancelled attempts at once."""
        self.actor.check_leases.remote()

    def warm_up(self, modules: Iterable[str] = ()) -> ray.ObjectRef:
        """Asks the service to start validation worker processes now, importing those
        of the named frameworks it allows (RayTaskExecutor.warm_up), so that a run's
        first validations start warm. Does not wait: ray.get() the returned ref for the
        workers' pids and imports."""
        return self.actor.warm_up.remote(list(modules))

    def status(self, timeout_s: float = 30.0) -> dict[str, Any]:
        return ray.get(self.actor.status.remote(), timeout=timeout_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stops the scheduler loop and removes the actor; queued jobs stay queued."""
        try:
            ray.get(self.actor.shutdown.remote(), timeout=timeout_s)
        finally:
            ray.kill(self.actor, no_restart=True)


class ValidationService:
    """Starts or finds the detached service actor of a Ray cluster."""

    @staticmethod
    def start(
        database_url: str | None = None,
        storage: str | None = None,
        pools: dict[str, int] | None = None,
        *,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> ServiceHandle:
        """Starts the service on the connected Ray cluster (connecting first if needed).

        Returns the running one when it already exists with the same database; raises
        when one exists for another database, naming both (passwords masked). The
        settings, secrets included, reach the actor as its constructor argument; only
        the CKVAL_* variables that hold no secret go into its runtime_env.
        """
        update = {"database_url": database_url, "storage": storage, "pools": pools, **overrides}
        settings = _settled(settings or get_settings(), update)
        actor_cls = ray.remote(_ServiceActor)
        actor = actor_cls.options(
            name=settings.service_name,
            namespace=settings.ray_namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            # On the head node: autoscaling never takes it away with an idle worker.
            resources={"node:__internal_head__": 0.001},
            max_restarts=-1,
            max_task_retries=-1,
            max_concurrency=16,
            runtime_env={"env_vars": ckval_env()},
        ).remote(settings.model_dump_json())
        handle = ServiceHandle(actor, settings)
        running = Settings.model_validate_json(ray.get(actor.settings_json.remote(), timeout=120))
        # settings_json() masks the URL: compare masked (a password does not change which
        # database it is) and never print one.
        ours = mask_url(settings.resolved_database_url())
        if running.resolved_database_url() != ours:
            raise RuntimeError(
                f"A ckval service named {settings.service_name!r} already runs on this Ray "
                f"cluster with database {running.resolved_database_url()!r}, not "
                f"{ours!r}. Stop it (`ckval stop`) or pick another CKVAL_SERVICE_NAME."
            )
        handle.settings = _with_secrets_of(running, settings)
        return handle

    @staticmethod
    def get(settings: Settings | None = None) -> ServiceHandle | None:
        """The running service, or None."""
        settings = settings or get_settings()
        ensure_ray(settings)
        try:
            actor = ray.get_actor(settings.service_name, namespace=settings.ray_namespace)
        except ValueError:
            return None
        return ServiceHandle(actor, settings)


_ray_lock = threading.Lock()


def ensure_ray(settings: Settings) -> None:
    """Connects to Ray: the configured cluster, else a new local one."""
    with _ray_lock:
        if ray.is_initialized():
            return
        ray.init(
            address=settings.ray_address,
            ignore_reinit_error=True,
            log_to_driver=False,
            runtime_env={"env_vars": ckval_env()},
        )


def _settled(settings: Settings, update: dict[str, Any]) -> Settings:
    """The settings with start()'s arguments (those not None), Ray connected, and the
    embedded defaults settled here, so that the actor uses this process's CKVAL_HOME and
    this process's signing key (its reporters sign with it)."""
    from validation_service.signing import secret_key

    settings = settings.model_copy(update={k: v for k, v in update.items() if v is not None})
    ensure_ray(settings)
    return settings.model_copy(
        update={
            "database_url": settings.resolved_database_url(),
            "storage": settings.resolved_storage(),
            "secret_key": secret_key(settings),
        }
    )


def _with_secrets_of(running: Settings, settings: Settings) -> Settings:
    """The running service's settings, with this process's secrets for the same database."""
    secrets_here = {
        name: getattr(settings, name)
        for name in ("database_url", "storage_options", "sinks", *SECRET_FIELDS)
        if name in Settings.model_fields
    }
    if has_secret(settings.storage):
        secrets_here["storage"] = settings.storage
    return running.model_copy(update=secrets_here)
