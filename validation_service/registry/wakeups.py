"""Wake-ups without polling on PostgreSQL: every transaction that queues a job (a report, a
retry) or frees a pool's slot from outside the service (a cancel) sends NOTIFY on one
channel at its commit, and each service replica LISTENs on its own connection and ticks at
once. A replica's own finishes and lease expiries send none: that replica ticks next and
claims for the slot itself, and waking the others would only have them read the queue for
nothing. Polling stays as the fallback (a lost connection, SQLite, a notification sent
while a replica reconnects)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy import func, select
from sqlalchemy.engine import Connection, Engine

logger = logging.getLogger(__name__)

CHANNEL = "ckval_jobs"
# A notification's payload: nothing; the replica reads the queue itself.
NOTIFY = select(func.pg_notify(CHANNEL, ""))
# How long a listener waits on its connection before it looks whether it should stop.
LISTEN_WAIT_S = 1.0
# Backoff between reconnections after the database went away (seconds, doubling).
RECONNECT_FIRST_S = 0.5
RECONNECT_MAX_S = 10.0


def wake_replicas(conn: Connection) -> None:
    """Sends the wake-up with this transaction's commit (PostgreSQL; nothing on SQLite).
    PostgreSQL folds identical notifications of one transaction into one."""
    if conn.dialect.name == "postgresql":
        conn.execute(NOTIFY)


class QueueListener:
    """LISTENs on the queue's channel in a daemon thread and calls ``on_wake`` for each
    notification; reconnects with backoff when the database goes away."""

    def __init__(self, engine: Engine, on_wake: Callable[[], None]):
        self.engine = engine
        self.on_wake = on_wake
        self.notifications = 0
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckval-listen", daemon=True)

    @staticmethod
    def applies_to(engine: Engine) -> bool:
        return engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg"

    def start(self) -> QueueListener:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * LISTEN_WAIT_S + 1)

    def _run(self) -> None:
        backoff = RECONNECT_FIRST_S
        while not self._stop.is_set():
            try:
                self._listen()
                backoff = RECONNECT_FIRST_S
            except Exception as exc:  # noqa: BLE001 - polling covers the gap; reconnect
                self.connected.clear()
                logger.warning("listening for queued jobs failed (%s); polling meanwhile", exc)
                # Whatever was notified while away: the next tick reads the queue.
                self.on_wake()
                self._stop.wait(backoff)
                backoff = min(2 * backoff, RECONNECT_MAX_S)

    def _listen(self) -> None:
        import psycopg

        from validation_service.registry import raw_sql

        args, kwargs = self.engine.dialect.create_connect_args(self.engine.url)
        with psycopg.connect(*args, **kwargs, autocommit=True) as conn:
            conn.execute(raw_sql.LISTEN_FOR_JOBS)
            self.connected.set()
            # Notifications sent before LISTEN took effect: read the queue once.
            self.on_wake()
            while not self._stop.is_set():
                for _ in conn.notifies(timeout=LISTEN_WAIT_S):
                    self.notifications += 1
                    self.on_wake()
