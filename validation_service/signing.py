"""Signed payloads: HMAC-SHA256 over the validate_fn and validate_config bytes a job stores.

Reporters sign what they store (``PayloadTrust.sign``); an attempt verifies before it
unpickles anything (``PayloadTrust.verify``). The key is CKVAL_SECRET_KEY, else one
generated once into ``CKVAL_HOME/secret_key``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from validation_service._home import make_private_folders
from validation_service.errors import InvalidInput, PayloadSignatureError
from validation_service.jobs import DEFAULT_VALIDATOR

if TYPE_CHECKING:
    from validation_service.config import Settings

logger = logging.getLogger(__name__)

# A signed payload is PREFIX + 32-byte MAC + the cloudpickled bytes: the signature travels
# in the same column as the payload, so no schema change was needed. The MAC covers the
# payload's kind, the job it is bound to (job_binding) and the bytes. "ckv1:" payloads
# (not bound to a job, from an older ckval) are refused.
PREFIX = b"ckv2:"
_UNBOUND_PREFIX = b"ckv1:"
MAC_SIZE = hashlib.sha256().digest_size
KEY_FILE = "secret_key"

VALIDATE_FN = "validate_fn"
VALIDATE_CONFIG = "validate_config"
# A SYNC report's record in storage (trainer_integration/_journal.py), bound to its run.
REPORT_RECORD = "report_record"
_KINDS = (VALIDATE_FN, VALIDATE_CONFIG, REPORT_RECORD)

_warned_shared = False


@dataclasses.dataclass(frozen=True, repr=False)
class PayloadTrust:
    """What a process trusts in a stored job: payloads signed with ``keys`` (the first
    signs, every one verifies) and validate_fn references into ``allowed_modules``
    (None: any module)."""

    keys: tuple[bytes, ...]
    allowed_modules: tuple[str, ...] | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> PayloadTrust:
        keys = [secret_key(settings)]
        if settings.secret_key_previous:
            keys.append(settings.secret_key_previous)
        allowed = tuple(settings.allowed_modules) if settings.allowed_modules else None
        return cls(tuple(key.encode() for key in keys), allowed)

    def __repr__(self) -> str:
        # Never the keys: this object travels into Ray tasks and may be logged.
        hidden = f"<{len(self.keys)} hidden>"
        return f"PayloadTrust(keys={hidden}, allowed_modules={self.allowed_modules})"

    def sign(self, kind: str, data: bytes | None, *, bound_to: bytes) -> bytes | None:
        """``data`` with its signature in front, valid only for the job ``bound_to``
        (job_binding) names; signed data and None are returned unchanged."""
        if data is None or is_signed(data):
            return data
        return PREFIX + _mac(self.keys[0], kind, bound_to, data) + data

    def verify(
        self, kind: str, signed: bytes, *, bound_to: bytes, job_id: int | None = None
    ) -> bytes:
        """The payload bytes, once the signature in front of them verifies with one of the
        keys for the job ``bound_to`` names; raises PayloadSignatureError otherwise
        (nothing is unpickled). A payload copied from another job's row never verifies."""
        if signed.startswith(_UNBOUND_PREFIX):
            raise PayloadSignatureError(
                job_id,
                kind,
                "it was signed by an older ckval without binding it to its job; report the "
                "checkpoint again",
            )
        if not is_signed(signed):
            raise PayloadSignatureError(
                job_id,
                kind,
                "it carries no signature: stored by a ckval without payload "
                "signing, or written into the database by something else",
            )
        mac = signed[len(PREFIX) : len(PREFIX) + MAC_SIZE]
        data = signed[len(PREFIX) + MAC_SIZE :]
        for key in self.keys:
            if hmac.compare_digest(mac, _mac(key, kind, bound_to, data)):
                return data
        raise PayloadSignatureError(
            job_id,
            kind,
            "no configured key produced its signature for this job: it was signed for "
            "another job, or with another key",
        )


def is_signed(data: bytes) -> bool:
    return data.startswith(PREFIX) and len(data) >= len(PREFIX) + MAC_SIZE


def job_binding(
    namespace: str,
    run: str,
    report_index: int,
    uri: str,
    *,
    validator: str = DEFAULT_VALIDATOR,
    job_key: str | None = None,
) -> bytes:
    """What a job's payloads are bound to: its checkpoint (namespace, run, report index,
    URI), known to the reporter before the job is stored and to every attempt, and for
    a named evaluation's job its validator and its job key (the idempotency key), so
    that a payload copied from one evaluation's job into the "default" job of the same
    checkpoint (or into another evaluation's) never verifies. A checkpoint has one
    "default" job, bound to the checkpoint alone (as it always was)."""
    if validator == DEFAULT_VALIDATOR:
        return json.dumps([namespace, run, report_index, uri]).encode()
    return json.dumps([namespace, run, report_index, uri, validator, job_key]).encode()


def form_binding(bound_to: bytes, validate_fn_ref: str | None) -> bytes:
    """What a job's validate_config is bound to: its checkpoint (``bound_to``,
    job_binding) and the form of its validate_fn, the whole reference when it is one
    (``validate_fn_ref``; None for a pickled validate_fn, which is signed itself).

    The reference is never run unsigned: changing it, or turning a pickled job into a
    reference, without the key leaves the validate_config's signature unverifiable.
    """
    if validate_fn_ref is None:
        return bound_to
    # job_binding is JSON, which holds no NUL byte: the two parts cannot run together.
    return bound_to + b"\x00validate_fn_ref\x00" + validate_fn_ref.encode("utf-8", "surrogatepass")


def _mac(key: bytes, kind: str, bound_to: bytes, data: bytes) -> bytes:
    if kind not in _KINDS:
        raise ValueError(f"unknown payload kind {kind!r}")
    # Domain separation: a signed validate_config is never valid as a validate_fn, and a
    # payload signed for one job is never valid for another.
    binding = len(bound_to).to_bytes(8, "big") + bound_to
    message = b"ckval-payload\x00" + kind.encode() + b"\x00" + binding + data
    return hmac.new(key, message, hashlib.sha256).digest()


def secret_key(settings: Settings) -> str:
    """The signing key: CKVAL_SECRET_KEY, else the one kept in ``CKVAL_HOME/secret_key``.

    A registry that is not the embedded SQLite is usually shared by machines that do not
    share CKVAL_HOME: without CKVAL_SECRET_KEY each would sign with its own key file and
    their jobs would fail to verify, so that case is warned about once.
    """
    if settings.secret_key:
        return settings.secret_key
    global _warned_shared
    url = settings.resolved_database_url()
    if not url.startswith("sqlite") and not _warned_shared:
        _warned_shared = True
        logger.warning(
            "CKVAL_SECRET_KEY is not set: payloads are signed with the key in %s. A shared "
            "deployment must set the same CKVAL_SECRET_KEY on the service and every "
            "reporter, or their validation jobs fail with a signature error.",
            settings.resolved_home() / KEY_FILE,
        )
    return key_file(settings.resolved_home())


def key_file(home: Path) -> str:
    """The key in ``home/secret_key``, generated there (mode 0600) if there is none.

    The new key is written to a private file first (``O_CREAT | O_EXCL``, 0600) and then
    linked into place, which fails if the name exists: the file never appears half
    written, and of two processes racing, both end up with the winner's key.
    """
    path = Path(home) / KEY_FILE
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    make_private_folders(path.parent)  # a fresh CKVAL_HOME is 0700 from the start
    draft = path.with_name(f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_bytes(32).hex().encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(draft, path)
    except FileExistsError:
        pass  # another process made it first: its key is the key
    finally:
        os.unlink(draft)
    return _read_key(path)


def _read_key(path: Path) -> str:
    key = path.read_text().strip()
    if not key:
        raise InvalidInput(
            f"The signing key file {path} is empty. Delete it (a new key is made) or set "
            "CKVAL_SECRET_KEY; jobs signed with the lost key must be reported again."
        )
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "the signing key file %s is readable by other users (mode %o): chmod 600 it",
            path,
            stat.S_IMODE(mode),
        )
    return key


def watch_binding(namespace: str, run: str, uri: str) -> bytes:
    """What a watch's payloads are bound to (registry/watches.py): its namespace, run and
    folder. The service verifies them so, then signs each step folder's job for it."""
    return json.dumps(["watch", namespace, run, uri]).encode()
