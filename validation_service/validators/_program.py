"""How an outside program runs for a validation: its environment, its bounded output and
its end (CommandValidator's, validators/command.py).

The program gets a clean environment: this process's, less every ``CKVAL_*`` variable
and every variable whose name or value the secrets rule (validation_service/secrets.py)
holds secret, plus what the validator's ``env`` names. Its output is read as it comes
and only a bounded head and tail of each stream is kept, whatever it writes. It runs in
a session of its own, and the whole process group is killed when it ends, at its
timeout and when the attempt is cancelled: nothing it started outlives it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import subprocess
import threading
import time

from validation_service._home import ENV_PREFIX
from validation_service.errors import PermanentValidationError
from validation_service.secrets import is_secret_name, mask_value

# What is kept of each stream: its first HEAD_BYTES and its last TAIL_BYTES.
HEAD_BYTES = 8 * 1024
TAIL_BYTES = 24 * 1024
_CHUNK = 64 * 1024
# How long the readers may take to see the end of a stream once the program's group is
# gone (a process that left the group in a session of its own may hold it open).
_READERS_GRACE_S = 5.0


def program_environment(extra: dict[str, str]) -> dict[str, str]:
    """The environment an outside program gets: this process's, less CKVAL_* variables
    and variables with a secret name (``AWS_SECRET_ACCESS_KEY``, ``PGPASSWORD``,
    ``MLFLOW_TRACKING_TOKEN``...) or a secret in their value (a URL with a password),
    plus ``extra`` (the validator's ``env``)."""
    kept = {
        name: value
        for name, value in os.environ.items()
        if not name.upper().startswith(ENV_PREFIX)
        and not is_secret_name(name)
        and mask_value(value) == value
    }
    return {**kept, **extra}


class BoundedOutput:
    """One stream of a program, read on a thread of its own as it comes: its head and
    tail are kept, and how many bytes it wrote in all."""

    def __init__(self, stream):
        self.head = bytearray()
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_size = 0
        self.total = 0
        self._lock = threading.Lock()  # text() may read while a stray writer still writes
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        with stream:
            while chunk := stream.read1(_CHUNK):
                with self._lock:
                    self._keep(chunk)

    def _keep(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = HEAD_BYTES - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail.append(chunk)
            self.tail_size += len(chunk)
            while self.tail_size - len(self.tail[0]) >= TAIL_BYTES:
                self.tail_size -= len(self.tail.popleft())

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def text(self) -> str:
        """What was kept, with a line saying how much was left out between head and tail."""
        with self._lock:
            head, tail = bytes(self.head), b"".join(self.tail)[-TAIL_BYTES:]
            left_out = self.total - len(head) - len(tail)
        decode = lambda data: data.decode("utf-8", errors="replace")  # noqa: E731
        if left_out <= 0:
            return decode(head + tail)
        return f"{decode(head)}\n[... {left_out} bytes left out ...]\n{decode(tail)}"


@dataclasses.dataclass(frozen=True)
class ProgramRun:
    """How one run of the program ended, and what was kept of its output."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool


def run_program(
    argv: list[str], env: dict[str, str], cwd: str, timeout_s: float | None
) -> ProgramRun:
    """Runs ``argv`` in a session of its own with ``env`` (program_environment), its
    output read into BoundedOutput; past ``timeout_s`` its group is killed."""
    try:
        process = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        raise PermanentValidationError(
            f"could not start {argv[0]!r} ({exc.strerror or exc}): give the program's full "
            "path or a name on the PATH of the node that validates."
        ) from None
    stdout, stderr = BoundedOutput(process.stdout), BoundedOutput(process.stderr)
    try:
        ended = _exited_within(process, timeout_s)
    finally:  # also when the attempt is cancelled (KeyboardInterrupt in a Ray task)
        _kill_group(process)
        process.wait()
    for stream in (stdout, stderr):
        stream.join(_READERS_GRACE_S)
    return ProgramRun(process.returncode, stdout.text(), stderr.text(), not ended)


def _exited_within(process: subprocess.Popen, timeout_s: float | None) -> bool:
    """Whether the program exited within ``timeout_s`` (None: waits for it). It is left
    a zombie (WNOWAIT): its process group id stays its own until it is reaped, so that
    killing the group afterwards cannot reach another process that took the number."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delay = 0.001
    while os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return True


def _kill_group(process: subprocess.Popen) -> None:
    """Kills what is left of the program's process group (the program itself too, if it
    still runs); its leader is not reaped yet, so the group is still the program's."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
