"""moto's S3 server on loopback, for tests that read or write S3 through real clients."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Iterator

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def moto_s3_server(*buckets: str) -> Iterator[str]:
    """Starts the server with ``buckets`` created; yields its endpoint URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()


def environment(endpoint: str) -> dict[str, str]:
    """The AWS variables that point boto3 and s3fs at the server (AWS_ENDPOINT_URL)."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}


def png_bytes(colour: tuple[int, int, int], size: tuple[int, int] = (6, 4)) -> bytes:
    """A small PNG of one colour, made by Pillow."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


_REQUEST = re.compile(rb"(GET|PUT|POST|DELETE|HEAD) (/[^ \r\n]*) HTTP/1\.1\r\n")
_COPY_SOURCE = re.compile(rb"\r\n[Xx]-[Aa]mz-[Cc]opy-[Ss]ource: ([^\r\n]+)\r\n")
_TAIL = 8192  # longer than any request line or header the clients send


class S3Traffic:
    """What S3 clients send to an endpoint, counted on the way by a loopback proxy:
    the bytes, the requests (method, path) and the server-side copies they ask for.

    Request lines and copy headers are found in the byte stream itself (checkpoint
    bytes that happen to read as one are as likely as a hash collision)."""

    def __init__(self, endpoint: str):
        from tests.tcp_proxy import TcpProxy

        host, port = endpoint.rsplit("//", 1)[1].split(":")
        self._proxy = TcpProxy(host, int(port), tap=self._seen)
        self._lock = threading.Lock()
        self._tails: dict[int, bytes] = {}
        self.sent_bytes = 0
        self.requests: list[tuple[str, str]] = []
        self.copies: list[tuple[str, str]] = []  # each copy's (target path, source)
        self._last_path: dict[int, str] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._proxy.port}"

    def __enter__(self) -> S3Traffic:
        self._proxy.start()
        return self

    def __exit__(self, *exc) -> None:
        self._proxy.stop()

    def reset(self) -> None:
        with self._lock:
            self.sent_bytes, self.requests, self.copies = 0, [], []

    def _seen(self, connection, data: bytes) -> None:
        with self._lock:
            self.sent_bytes += len(data)
            tail = self._tails.get(id(connection), b"")
            window = tail + data
            found = [(m.start(), "request", m) for m in _REQUEST.finditer(window)]
            found += [(m.start(), "copy", m) for m in _COPY_SOURCE.finditer(window)]
            for _, kind, match in sorted(found, key=lambda item: item[0]):
                if kind == "request":
                    self._last_path[id(connection)] = match[2].decode()
                    if match.end() > len(tail):
                        self.requests.append((match[1].decode(), match[2].decode()))
                elif match.end() > len(tail):
                    target = self._last_path.get(id(connection), "")
                    self.copies.append((target, match[1].decode()))
            self._tails[id(connection)] = window[-_TAIL:]
