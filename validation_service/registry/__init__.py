"""The checkpoint registry: the Registry facade over the catalog, the queue and their
transitions, on one database layer (the only code that touches the database)."""

from validation_service.registry.registry import Registry

__all__ = ["Registry"]
