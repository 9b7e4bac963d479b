"""The checkpoint registry: typed ORM models and the Registry that owns every query."""

from validation_service.registry.registry import Registry

__all__ = ["Registry"]
