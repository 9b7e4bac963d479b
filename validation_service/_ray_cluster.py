"""Finding the Ray cluster a running service lives on, for commands that only look at it
(`ckval status`, `stop`, `jobs --watch`): they connect to a running cluster, never start one.
"""

from __future__ import annotations

import logging
import os
import socket

from validation_service import _ray_compat
from validation_service.config import Settings
from validation_service.errors import RayClusterNotFound

# How long a configured address may take to accept a connection before it counts as down
# (ray.init would otherwise retry for minutes against an address where nothing listens).
CONNECT_TIMEOUT_S = 3.0


def connect_existing_ray(settings: Settings) -> str:
    """Connects this process to a running Ray cluster and returns its address.

    Looks where ``ray.init(address="auto")`` looks: CKVAL_RAY_ADDRESS when set, else
    RAY_ADDRESS, else the cluster that ``ray start`` recorded on this machine, else a Ray
    running on this machine (as ``ckval serve`` starts one). Raises RayClusterNotFound,
    having started nothing, when there is none or nothing answers at the address.
    """
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    address, source = _configured_address(settings)
    discovered = address is None
    if discovered:
        address, source = _discovered_address(), "this machine's running Ray"
    if not _answers(address):
        raise RayClusterNotFound(address, source)
    # A Ray found on this machine is joined as ray.init(address="auto") joins it: with
    # its token when it has one (recent Ray releases give a new local Ray one, as to
    # `ckval serve`'s). With an explicit address Ray sends a token only under
    # RAY_AUTH_MODE=token. (RAY_ADDRESS=local would make "auto" start a new Ray.)
    join_as_found = discovered and os.environ.get("RAY_ADDRESS", "auto") == "auto"
    try:
        ray.init(
            address="auto" if join_as_found else address,
            log_to_driver=False,
            logging_level=logging.WARNING,
            ignore_reinit_error=True,
        )
    except ConnectionError as exc:
        raise RayClusterNotFound(address, source) from exc
    return address


def _configured_address(settings: Settings) -> tuple[str | None, str | None]:
    for address, source in (
        (settings.ray_address, "CKVAL_RAY_ADDRESS"),
        (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS"),
    ):
        # "auto" asks for discovery, as in ray.init; "local" would start a new Ray.
        if address and address not in ("auto", "local"):
            return address, source
    return None, None


def _discovered_address() -> str:
    """The address ray.init(address="auto") would connect to, found without connecting."""
    address = _ray_compat.bootstrap_address()
    if address is None:
        raise RayClusterNotFound()
    return address


def _answers(address: str) -> bool:
    """Whether something accepts connections at a Ray address (host:port, ray://host:port)."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return True  # not a host:port: let ray.init judge it
    try:
        with socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False
