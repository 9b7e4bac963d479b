"""moto's S3 server on loopback, for tests that read or write S3 through real clients."""

from __future__ import annotations

import contextlib
import socket
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
