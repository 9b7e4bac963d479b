"""The training side's heavy imports, one thread at a time: validation_service.imports'
lock, which ckval's errors take too (see there)."""

from __future__ import annotations

from validation_service.imports import import_once

__all__ = ["import_once"]
