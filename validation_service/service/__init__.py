"""The long-running service: a detached, named Ray actor that owns a Scheduler.

This package is the service core (scheduler.py holds the loop); with executors/ and
validators/ it is the floor above the registry and below the HTTP API and the command
line (ARCHITECTURE.md, "Floors").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import ray

from validation_service._ray_compat import head_node_resources
from validation_service.config import Settings, get_settings
from validation_service.logs import configure_logging
from validation_service.registry.replicas import replica_name
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

    def __init__(self, settings_json: str, replica: int = 0):
        from validation_service.registry.composition import open_service_parts
        from validation_service.service.scheduler import Scheduler

        configure_logging()
        self.settings = Settings.model_validate_json(settings_json)
        self.replica = replica
        self.name = replica_name(self.settings.service_name, replica)
        # The registry's job queue and replicas' rows (composition.ServiceParts). Only an
        # embedded SQLite is migrated here; a server database is migrated as a deploy
        # step (`ckval db upgrade`), so a service never races a migration.
        self.parts = open_service_parts(self.settings)
        self.scheduler = Scheduler(self.parts, self.settings, name=self.name)
        self.started_at = time.time()
        self._thread = threading.Thread(
            target=self.scheduler.run_forever, name="ckval-scheduler", daemon=True
        )
        self._thread.start()
        # The first replica starts the others, and starts again any that is gone.
        self.supervisor = None
        if replica == 0:
            self._forget_replicas_past(self.settings.replicas)
            self.supervisor = ReplicaSupervisor(self.settings, settings_json)

    def _forget_replicas_past(self, count: int) -> None:
        """The registry forgets replicas an earlier, larger service ran."""
        try:
            self.parts.replicas.forget(self.settings.service_name, keep=count)
        except Exception:  # noqa: BLE001 - status only
            logger.warning("forgetting earlier replicas failed", exc_info=True)

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

    def replica_status(self) -> dict[str, Any]:
        """This replica's own part of the status."""
        return {
            "name": self.name,
            "owner": self.scheduler.owner,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "alive": self._thread.is_alive(),
            "in_flight": self.scheduler.in_flight,
            "waiting_for_resources": self.scheduler.waiting_for_resources(),
            "uptime_s": round(time.time() - self.started_at, 1),
            **self.scheduler.stats,
        }

    def status(self) -> dict[str, Any]:
        replicas = self.supervisor.replicas(self.parts.replicas) if self.supervisor else []
        return {
            "replicas_set": len(replicas) or 1,
            "replicas": replicas,
            "owner": self.scheduler.owner,
            "database_url": self.parts.display_url,
            "storage": mask_url(self.settings.resolved_storage()),
            "pools": self.settings.pools,
            "default_pool_size": self.settings.default_pool_size,
            "in_flight": self.scheduler.in_flight,
            "waiting_for_resources": self.scheduler.waiting_for_resources(),
            "cluster": self.scheduler.cluster_offer(),
            "uptime_s": round(time.time() - self.started_at, 1),
            "pid": os.getpid(),
            "alive": self._thread.is_alive(),
            **self.scheduler.stats,
        }

    def shutdown(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
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
        settings = settings or get_settings()
        # Refused before Ray is started or anything written.
        given = settings.model_copy(update={k: v for k, v in update.items() if v is not None})
        given.replicas_for(given.resolved_database_url())
        settings = _settled(settings, update)
        actor = replica_actor(settings, settings.model_dump_json(), 0)
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


def replica_actor(settings: Settings, settings_json: str, replica: int):
    """Starts replica ``replica`` of the service (or finds it running): a detached actor
    that Ray restarts when its process dies. The first runs on the head node (autoscaling
    never takes it away with an idle worker); the others go to worker nodes
    (_replica_placement), so that one node's loss leaves a replica claiming."""
    if replica == 0:
        placement: dict[str, Any] = {"resources": head_node_resources()}
    else:
        placement = {"scheduling_strategy": _replica_placement(replica)}
    return (
        ray.remote(_ServiceActor)
        .options(
            name=replica_name(settings.service_name, replica),
            namespace=settings.ray_namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,
            max_task_retries=-1,
            max_concurrency=16,
            runtime_env={"env_vars": ckval_env()},
            **placement,
        )
        .remote(settings_json, replica)
    )


def _replica_placement(replica: int):
    """Where replica ``replica`` (1..N-1) starts: a worker node, not the head node where the
    first replica runs; replicas take the alive worker nodes in turn, and with none (one
    machine) Ray spreads them. Ray's SPREAD alone may put one on the head node, next to
    the first replica, and so would a soft affinity while a new node's resources are not
    yet in the scheduler's view. When that node is lost, Ray cannot restart the replica
    there and gives it up; the supervisor then starts it again on a node that is alive."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head = ray.get_runtime_context().get_node_id()
    workers = sorted(
        node["NodeID"] for node in ray.nodes() if node.get("Alive") and node["NodeID"] != head
    )
    if not workers:
        return "SPREAD"
    return NodeAffinitySchedulingStrategy(workers[(replica - 1) % len(workers)], soft=False)


class ReplicaSupervisor:
    """Kept by the first replica: starts replicas 1..N-1, and every heartbeat starts again
    any that is gone (Ray restarts a replica whose process died; this covers one whose
    actor Ray gave up, say with its node). Its status lists every replica."""

    def __init__(self, settings: Settings, settings_json: str):
        self.settings = settings
        self.settings_json = settings_json
        self.count = settings.replicas
        self._actors: dict[int, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckval-replicas", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.ensure()
            except Exception:  # noqa: BLE001 - tried again at the next heartbeat
                logger.warning("starting service replicas failed", exc_info=True)
            self._stop.wait(max(self.settings.heartbeat_s, 1.0))

    def ensure(self) -> None:
        for replica in range(1, self.count):
            name = replica_name(self.settings.service_name, replica)
            try:
                self._actors[replica] = ray.get_actor(name, namespace=self.settings.ray_namespace)
            except ValueError:
                logger.warning("service replica %s is gone; starting it", name)
                self._actors[replica] = replica_actor(self.settings, self.settings_json, replica)

    def replicas(self, book) -> list[dict[str, Any]]:
        """Every replica: its row in the registry's ``book`` (a ReplicaBook: pid, node,
        leases, last heartbeat) and whether its actor answers now."""
        names = [replica_name(self.settings.service_name, i) for i in range(self.count)]
        answers = {name: self._answer(name) for name in names}
        rows = {row.name: row for row in book.list(self.settings.service_name)}
        return [_replica_entry(name, rows.get(name), answers[name]) for name in names]

    def _answer(self, name: str) -> dict[str, Any] | None:
        try:
            actor = ray.get_actor(name, namespace=self.settings.ray_namespace)
            return ray.get(actor.replica_status.remote(), timeout=REPLICA_ANSWER_S)
        except Exception:  # noqa: BLE001 - a replica that does not answer is not alive
            return None

    def stop(self) -> None:
        """Stops replicas 1..N-1 (the first stops itself)."""
        self._stop.set()
        self._thread.join(timeout=5)
        for replica in range(1, self.count):
            name = replica_name(self.settings.service_name, replica)
            try:
                actor = ray.get_actor(name, namespace=self.settings.ray_namespace)
            except ValueError:
                continue
            try:
                ray.get(actor.shutdown.remote(), timeout=60)
            finally:
                ray.kill(actor, no_restart=True)


# How long status waits for a replica's answer before it counts as not alive.
REPLICA_ANSWER_S = 5.0


def _replica_entry(name: str, row, answer: dict[str, Any] | None) -> dict[str, Any]:
    """One replica in status: what it answered, else what its last heartbeat wrote."""
    entry: dict[str, Any] = {"name": name, "alive": answer is not None and answer["alive"]}
    if row is not None:
        entry.update(
            owner=row.owner,
            pid=row.pid,
            node_id=row.node_id,
            hostname=row.hostname,
            leases=row.leases,
            last_heartbeat=row.heartbeat_at.isoformat(),
            heartbeat_age_s=round(row.heartbeat_age_s(), 1),
            stopped=row.stopped_at is not None,
        )
    if answer is not None:
        entry.update(owner=answer["owner"], pid=answer["pid"], node_id=answer["node_id"])
        entry.update(in_flight=answer["in_flight"], uptime_s=answer["uptime_s"])
    entry.setdefault("pid", None)
    entry.setdefault("node_id", None)
    return entry


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
        for name in (
            "database_url",
            "storage_options",
            "sinks",
            "mlflow_allowed_uris",
            *SECRET_FIELDS,
        )
        if name in Settings.model_fields
    }
    if has_secret(settings.storage):
        secrets_here["storage"] = settings.storage
    return running.model_copy(update=secrets_here)
