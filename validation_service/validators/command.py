"""CommandValidator: an outside program as a validator, with a small file contract.

The program runs once per checkpoint, in the validation's Ray task, with the checkpoint's
files on local disk. Its argv may name four placeholders, each replaced in one pass (a
value that holds a placeholder's text is not replaced again):

- ``{checkpoint_dir}``: the local folder holding the checkpoint's files;
- ``{output_dir}``: an empty folder the program may write into (removed afterwards);
- ``{step}``: the checkpoint's report index;
- ``{result_path}``: where the program writes its result, as JSON: ``{"metrics": {...}}``
  (a ``"step"`` key beside it is allowed) or a flat object of numbers, at most
  MAX_RESULT_BYTES.

Exit code 0 with a readable result is a success; any other exit code, or no readable
result, fails the job with the last lines of the program's standard error; past
``timeout_s`` the program's whole process group is killed and the job ends TIMED_OUT.
A bounded head and tail of its standard output and error are kept with the attempt
(``ckval job N --log``). The program's environment holds no CKVAL_* variable and no
secret of the node (validators/_program.py), only what ``env`` adds.

A job of a CommandValidator stores no pickle: only the reference to ``run_command`` and
the argv, env and timeout as its validate_config, signed like any payload.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from typing import Any

from validation_service.context import current_validation
from validation_service.errors import InvalidInput, PermanentValidationError, ValidationTimedOut
from validation_service.validation import check_resources, check_timeout_s
from validation_service.validators._program import program_environment, run_program

REFERENCE = "validation_service.validators.command:run_command"
PLACEHOLDERS = ("{checkpoint_dir}", "{output_dir}", "{step}", "{result_path}")
_PLACEHOLDER = re.compile("|".join(re.escape(placeholder) for placeholder in PLACEHOLDERS))
# What an error message quotes of the program's standard error: its last lines, each cut
# to STDERR_LINE_CHARS.
STDERR_TAIL_LINES = 50
STDERR_LINE_CHARS = 500
# The result file is read only up to this size: a result holds metrics (at most 1,000,
# metrics.MAX_METRICS), not data.
MAX_RESULT_BYTES = 1024 * 1024
# The job's own time limit leaves the program's this much longer, so that the program is
# killed (and its output kept) before the service gives up on the attempt.
JOB_TIMEOUT_GRACE_S = 30.0


class CommandValidator:
    """Runs ``argv`` for each checkpoint (see the module's docstring for the contract).

    ``env``: variables added to the program's environment, which otherwise holds no
    CKVAL_* variable and no secret of the node (stored with the job, in clear);
    ``timeout_s``: the program's time limit; ``validation_resources``: what its
    Ray task reserves (default one CPU), e.g. ``{"num_gpus": 1}``.
    """

    def __init__(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        validation_resources: dict[str, Any] | None = None,
    ):
        self.argv = _checked_argv(argv)
        self.env = _checked_env(env)
        self.timeout_s = check_timeout_s(timeout_s, "CommandValidator's timeout_s")
        self.validation_resources = (
            dict(check_resources(validation_resources)) if validation_resources else None
        )

    def __repr__(self) -> str:
        return f"CommandValidator({self.argv!r}, timeout_s={self.timeout_s!r})"

    @property
    def recommended_resources(self) -> dict[str, Any]:
        return dict(self.validation_resources or {"num_cpus": 1})

    @property
    def job_timeout_s(self) -> float | None:
        """The job's time limit: the program's, and a grace to kill it and keep its output."""
        return None if self.timeout_s is None else self.timeout_s + JOB_TIMEOUT_GRACE_S

    def job_payload(self) -> tuple[str, dict[str, Any]]:
        """(reference, validate_config) of the job: no pickle, only these settings."""
        return REFERENCE, {"argv": self.argv, "env": self.env, "timeout_s": self.timeout_s}

    def __call__(self, checkpoint: Any, config: dict[str, Any] | None = None) -> dict[str, Any]:
        return _run(self, checkpoint)


def run_command(checkpoint: Any, config: dict[str, Any]) -> dict[str, Any]:
    """A CommandValidator job's validate_fn: the validator rebuilt from its stored config."""
    if not isinstance(config, dict) or "argv" not in config:
        raise InvalidInput(
            "a CommandValidator job needs its validate_config {'argv': [...], 'env': {...}, "
            f"'timeout_s': ...}}, got {config!r}"
        )
    validator = CommandValidator(
        config["argv"], env=config.get("env"), timeout_s=config.get("timeout_s")
    )
    return validator(checkpoint)


def _run(validator: CommandValidator, checkpoint: Any) -> dict[str, Any]:
    context = current_validation()
    step = "" if context is None else str(context.report_index)
    with tempfile.TemporaryDirectory(prefix="ckval-command-") as scratch:
        output_dir = os.path.join(scratch, "output")
        os.mkdir(output_dir)
        result_path = os.path.join(scratch, "result.json")
        values = {
            "{checkpoint_dir}": str(checkpoint.path),
            "{output_dir}": output_dir,
            "{step}": step,
            "{result_path}": result_path,
        }
        argv = [_substituted(arg, values) for arg in validator.argv]
        env = program_environment(validator.env)
        ran = run_program(argv, env, scratch, validator.timeout_s)
        if context is not None:
            context.keep_output(
                _log_text(argv, ran.returncode, ran.stdout, ran.stderr, ran.timed_out)
            )
        if ran.timed_out:
            raise ValidationTimedOut(
                f"{argv[0]} ran past its timeout_s={validator.timeout_s:g}s and was killed "
                f"with its process group.{_stderr_tail(ran.stderr)}"
            )
        if ran.returncode != 0:
            raise PermanentValidationError(
                f"{argv[0]} exited with code {ran.returncode}.{_stderr_tail(ran.stderr)}"
            )
        return _read_result(result_path, argv[0], ran.stderr)


def _read_result(result_path: str, program: str, stderr: str) -> dict[str, Any]:
    """The metrics of the result file: {"metrics": {...}} or a flat object of numbers."""
    try:
        info = os.lstat(result_path)
    except FileNotFoundError:
        raise PermanentValidationError(
            f"{program} exited 0 but wrote no result to {{result_path}}: it must write "
            f'JSON such as {{"metrics": {{"accuracy": 0.9}}}} there.{_stderr_tail(stderr)}'
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise PermanentValidationError(
            f"{program}'s result at {{result_path}} is not a plain file (a link, a pipe or "
            "a folder): write the JSON result into the file itself."
        )
    if info.st_size > MAX_RESULT_BYTES:
        raise PermanentValidationError(
            f"{program}'s result file is {info.st_size} bytes, over the {MAX_RESULT_BYTES} "
            "bytes a result may have: it holds metrics only (at most 1,000); write other "
            "output into {output_dir}. Nothing of it was read."
        )
    try:
        with open(result_path, "rb") as file:
            result = json.loads(file.read(MAX_RESULT_BYTES + 1).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PermanentValidationError(
            f"{program} exited 0 but its result file is not readable JSON ({exc})."
        ) from None
    if isinstance(result, dict) and isinstance(result.get("metrics"), dict):
        return result["metrics"]
    if isinstance(result, dict) and all(_is_number(value) for value in result.values()):
        return result
    raise PermanentValidationError(
        f'{program}\'s result must be {{"metrics": {{...}}}} or a flat object of numbers, '
        f"got {json.dumps(result)[:200]}"
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _substituted(arg: str, values: dict[str, str]) -> str:
    """``arg`` with every placeholder replaced in one pass: a value that holds a
    placeholder's text (a checkpoint folder named "{output_dir}") stays as it is."""
    return _PLACEHOLDER.sub(lambda found: values[found.group()], arg)


def _stderr_tail(stderr: str) -> str:
    lines = [
        line if len(line) <= STDERR_LINE_CHARS else line[:STDERR_LINE_CHARS] + " [line cut]"
        for line in stderr.rstrip().splitlines()[-STDERR_TAIL_LINES:]
    ]
    if not lines:
        return " It wrote nothing to its standard error."
    return f" The last {len(lines)} line(s) of its standard error:\n" + "\n".join(lines)


def _log_text(argv, returncode, stdout: str, stderr: str, timed_out: bool) -> str:
    ended = "killed on timeout" if timed_out else f"exit code {returncode}"
    return (
        f"$ {' '.join(argv)}\n[{ended}]\n"
        f"--- stdout ---\n{stdout}{'' if stdout.endswith(chr(10)) or not stdout else chr(10)}"
        f"--- stderr ---\n{stderr}"
    )


def _checked_argv(argv: Any) -> list[str]:
    if (
        not isinstance(argv, (list, tuple))
        or not argv
        or not all(isinstance(arg, str) for arg in argv)
    ):
        raise InvalidInput(
            "CommandValidator's argv must be a non-empty list of strings, e.g. "
            "['python', 'eval.py', '--checkpoint', '{checkpoint_dir}', '--out', "
            f"'{{result_path}}'], got {argv!r}"
        )
    if not argv[0].strip():
        raise InvalidInput("CommandValidator's argv[0] (the program) is empty.")
    return list(argv)


def _checked_env(env: Any) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in env.items()
    ):
        raise InvalidInput(f"CommandValidator's env must be a dict of str -> str, got {env!r}")
    return dict(env)
