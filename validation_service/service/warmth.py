"""How many CPU-pool attempts may start now: as many as there are warm worker processes,
growing while work waits.

A cold worker process (Ray's, importing Ray Train, ckval and the frameworks) takes
seconds of CPU. On a fresh cluster, where training starts on the same CPUs, several
started at once each take longer than one alone, and every later checkpoint's result
waits for them (results are read in report order). So the CPU pool starts as many
attempts as it knows warm workers for (at least one), and grows by one each
GROW_AFTER_S that due work waits for that limit: validations that take long still get
the pool's concurrency within seconds, short ones run one after another on the warm
workers, milliseconds each.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

# How long due CPU work waits for a warm worker before one more process may start.
GROW_AFTER_S = 1.0


class WarmWorkers:
    """The CPU pool's workers known warm (by pid) and the limit they allow."""

    def __init__(self, pool_size: int):
        self.pool_size = pool_size
        self._warm: set[int] = set()
        self._grown = 0
        self._waiting_since: float | None = None
        self._warming = 0  # warm-up tasks under way: each is a process starting

    def saw(self, pids: Iterable[int | None]) -> None:
        """Worker processes ran an attempt or a warm-up: they are warm now."""
        self._warm.update(pid for pid in pids if pid is not None)

    def warming(self, count: int) -> None:
        """``count`` warm-up tasks are under way (0 once they ended)."""
        self._warming = count

    def limit(self, busy: int, work_waits: bool, now: float | None = None) -> int:
        """How many CPU attempts may run, ``busy`` running and due work waiting or not."""
        now = time.monotonic() if now is None else now
        allowed = min(self.pool_size, max(1, len(self._warm)) + self._grown)
        if work_waits and busy + self._warming >= allowed:
            if self._waiting_since is None:
                self._waiting_since = now
            elif now - self._waiting_since >= GROW_AFTER_S:
                self._grown += 1
                self._waiting_since = now
                allowed = min(self.pool_size, allowed + 1)
        else:
            self._waiting_since = None
        return max(0, allowed - self._warming)
