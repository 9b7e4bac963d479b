"""A TCP forwarder on loopback that a test can switch off and on: a real network outage."""

from __future__ import annotations

import socket
import threading
import time


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, delay_s: float = 0.0, tap=None):
        self.target = (target_host, target_port)
        self.delay_s = delay_s  # per forwarded chunk: a slow network
        self.tap = tap  # called with every chunk the clients send, in order per connection
        self.port = _free_port()
        self._listener: socket.socket | None = None
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        """Refuses new connections and cuts every open one."""
        with self._lock:
            listener, self._listener = self._listener, None
            connections, self._connections = self._connections, []
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            except OSError:
                pass
            listener.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._connections += [client, upstream]
            for a, b, tap in ((client, upstream, self.tap), (upstream, client, None)):
                args = (a, b, self.delay_s, tap)
                threading.Thread(target=_pump, args=args, daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket, delay_s: float, tap=None) -> None:
    try:
        while data := source.recv(65536):
            if delay_s:
                time.sleep(delay_s)
            if tap is not None:
                tap(source, data)
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
