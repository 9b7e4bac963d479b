"""Imports of the heavy modules (SQLAlchemy, pydantic, the service) that a training process
loads on first use, one thread at a time.

``import trainer_integration`` loads none of them (tests/test_import_cost.py); they come
in on the reporter's threads and on the training thread. Two threads importing SQLAlchemy
at once can meet its modules half made (its package imports itself in a cycle, and Python
lets one of two waiting imports through with a partly made module): every such import in
a training process goes through ``import_once``, under one lock.
"""

from __future__ import annotations

import importlib
import sys
import threading
from types import ModuleType

_lock = threading.RLock()


def import_once(name: str) -> ModuleType:
    """``importlib.import_module(name)``, with no other thread importing through here.

    A module already made is returned at once, without the lock: the training thread
    never waits behind a reporter thread that is importing something else (the
    registry, on a new worker process, for a second or more)."""
    module = sys.modules.get(name)
    if module is not None and not _initializing(module):
        return module
    with _lock:
        return importlib.import_module(name)


def _initializing(module: ModuleType) -> bool:
    """Whether the module's code is still running (another thread is importing it):
    importlib's own mark on the module's spec."""
    return getattr(getattr(module, "__spec__", None), "_initializing", False) is True
