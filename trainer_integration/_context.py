"""Where a report goes from this process: the Ray Train run it is a worker of, or the run
that ``start_run()`` named. Shared by the callbacks and ``should_stop()``."""

from __future__ import annotations

import sys


def train_context():
    """The Ray Train context of this worker, or None outside Ray Train."""
    if "ray.train" not in sys.modules:
        return None
    try:
        import ray.train

        context = ray.train.get_context()
        context.get_world_rank()
        return context
    except Exception:  # noqa: BLE001 - not inside a Ray Train worker
        return None


def started_run() -> str | None:
    """The run of ``trainer_integration.start_run()``, which report() outside Ray Train uses."""
    from trainer_integration._client import current_run

    return current_run()
