"""The checkpoint registry, the only code that touches the database: ``Registry`` (the
users' queries) and, built by composition.py on the same database layer, the reporter's
``Ledger``, the scheduler's ``JobQueue``, ``Housekeeping`` and the dashboard's reads, each
opening its own transactions over the statements of the catalog, the queue, the
registration and the transitions.

``Registry`` loads on first use (PEP 562): importing the plain records of
``validation_service.registry.records`` does not import SQLAlchemy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Registry"]

if TYPE_CHECKING:
    from validation_service.registry.registry import Registry


def __getattr__(name: str) -> Any:
    if name == "Registry":
        from validation_service.registry.registry import Registry

        globals()["Registry"] = Registry
        return Registry
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
