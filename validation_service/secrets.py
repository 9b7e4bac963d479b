"""What ckval treats as secret, and how a secret is kept out of text (URLs and settings)
and out of what Ray shows (the settings handed on to Ray workers).

``mask_url`` is the one function that makes a URL fit to print (errors, logs, ``repr``,
HTTP answers); ``public_settings`` is the one view of Settings fit to return or show.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_plus, urlsplit

from validation_service._home import ENV_PREFIX, env_field, env_var

if TYPE_CHECKING:
    from validation_service.config import Settings

MASK = "***"

# Settings fields that are secrets as a whole (a field another module adds is covered by name).
SECRET_FIELDS = ("secret_key", "secret_key_previous", "api_token")

# Query-string parameters (and storage option keys) whose value is a secret.
_SECRET_NAMES = {
    "password",
    "passwd",
    "pwd",
    "token",
    "secret",
    "key",
    "access_key",
    "secret_key",
    "aws_secret_access_key",
    "aws_session_token",
    "session_token",
    "sslpassword",
    "api_key",
    "apikey",
    "access_token",
    "client_secret",
    "credentials",
    "account_key",
    "sas_token",
}
_SECRET_PARTS = ("password", "passwd", "secret", "token", "credential")

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_secret_name(name: str) -> bool:
    """Whether a query parameter or option of this name holds a secret."""
    lowered = name.lower()
    return (
        lowered in _SECRET_NAMES
        or any(part in lowered for part in _SECRET_PARTS)
        or lowered.endswith("_key")
    )


def mask_url(url: Any) -> str:
    """A URL fit to print: its password and the values of secret query parameters
    (``password``, ``token``, ``aws_secret_access_key``, ...) become ***.

    The password is found as SQLAlchemy reads it (``make_url``: a raw '/', '#' or '?' in
    it included, as in ``postgresql+psycopg://u:Pa/ss@host/db``) and as urllib and fsspec
    read it (the last '@' of the authority); whatever either finds is masked. Takes a
    string or a SQLAlchemy URL; text that is not a URL comes back unchanged.
    """
    if url is None:
        return ""
    text = url if isinstance(url, str) else _sqlalchemy_url_text(url)
    if not _URL.match(text):
        return text
    return _mask_query(_mask_userinfo(_mask_sqlalchemy_password(text)))


def _mask_sqlalchemy_password(text: str) -> str:
    """``text`` with the password that SQLAlchemy's make_url reads in it shown as ***.

    make_url takes ``scheme://user:password@``, where the user holds no ':' or '/' and
    the password runs to the next '@', whatever else it holds.
    """
    if "@" not in text:
        return text
    try:
        from sqlalchemy.engine import make_url

        if make_url(text).password is None:
            return text
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy reads: the other readings apply
        return text
    start = text.index("://") + 3
    user_end = start + len(re.match(r"[^:/]*", text[start:]).group())  # type: ignore[union-attr]
    at = text.find("@", user_end)
    if text[user_end : user_end + 1] != ":" or at < 0:
        return text
    return f"{text[: user_end + 1]}{MASK}{text[at:]}"


def _mask_userinfo(text: str) -> str:
    """``text`` with a password in ``user:password@`` as urllib (and fsspec) read it."""
    parts = urlsplit(text)
    userinfo, at, host = parts.netloc.rpartition("@")
    user, colon, password = userinfo.partition(":")
    if not at or not colon or password == MASK:
        return text
    start = text.index("://") + 3
    return f"{text[:start]}{user}:{MASK}@{host}{text[start + len(parts.netloc) :]}"


def _mask_query(text: str) -> str:
    """Secret query parameters' values shown as ***. The query is everything after the
    first '?' (SQLAlchemy's reading: a '#' in a value is part of it)."""
    base, question, query = text.partition("?")
    if not question:
        return text
    pairs = [pair.partition("=") for pair in query.split("&")]
    if not any(is_secret_name(unquote_plus(name)) for name, _, _ in pairs):
        return text
    masked = [
        f"{name}{eq}{MASK if is_secret_name(unquote_plus(name)) else value}"
        for name, eq, value in pairs
    ]
    return f"{base}?{'&'.join(masked)}"


def without_credentials(url: str) -> str:
    """``url`` with no password, no user and no secret query parameter: fit to store and
    serve (e.g. the tracking URI a run was logged to); other text comes back unchanged."""
    text = mask_url(url)
    if not _URL.match(text):
        return text
    start = text.index("://") + 3
    at = text.find(f":{MASK}@", start)
    if at >= 0 and "/" not in text[start:at]:
        text = text[:start] + text[at + len(MASK) + 2 :]
    base, _, query = text.partition("?")
    kept = "&".join(pair for pair in query.split("&") if pair.partition("=")[2] != MASK)
    return f"{base}?{kept}" if kept else base


def has_secret(url: str | None) -> bool:
    """Whether a URL carries a password or a secret query parameter."""
    return bool(url) and mask_url(url) != url


def mask_options(options: dict[str, Any]) -> dict[str, Any]:
    """Options (fsspec keyword arguments, a sink's options) with secret values shown as
    ***: those of secret names, and passwords in URLs anywhere in them."""
    return {
        name: MASK if is_secret_name(str(name)) else mask_value(value)
        for name, value in options.items()
    }


def mask_value(value: Any) -> Any:
    """``value`` (a str, or dicts and lists of them) with every secret in it masked."""
    if isinstance(value, dict):
        return mask_options(value)
    if isinstance(value, (list, tuple)):
        return [mask_value(item) for item in value]
    return mask_url(value) if isinstance(value, str) else value


def public_settings(settings: Settings) -> Settings:
    """A copy of ``settings`` with no secret: fit to return from the service or to show.

    The database URL is masked, whole secret fields are cleared and secret storage
    options are shown as ***.
    """
    update: dict[str, Any] = {
        "database_url": mask_url(settings.database_url) if settings.database_url else None,
        "storage_options": mask_options(settings.storage_options),
        "storage": mask_url(settings.storage) if settings.storage else None,
        "sinks": mask_value(settings.sinks),
    }
    for name in SECRET_FIELDS:
        if name in type(settings).model_fields:
            update[name] = None
    return settings.model_copy(update=update)


# ---------------------------------------------- how settings and secrets reach Ray workers
# Ray workers and actors get this process's CKVAL_* variables through Ray's runtime_env
# (ckval_env()), less those holding a secret: Ray's state API and dashboard show a
# runtime_env to anyone who can see the cluster. The withheld ones are named in
# CKVAL_WITHHELD; a worker that lacks them in its own environment gets them, with the
# signing key, from the service actor (worker_settings(), over the actor's
# reporter_settings_json()).
WITHHELD_VAR = f"{ENV_PREFIX}WITHHELD"


def secret_env_vars(environ: dict[str, str] | None = None) -> list[str]:
    """The CKVAL_* variables of ``environ`` (default: this process) that hold a secret."""
    environ = dict(os.environ if environ is None else environ)
    secret = []
    for name, value in environ.items():
        field = env_field(name)
        if field is None or name == WITHHELD_VAR:
            continue
        if field in SECRET_FIELDS or has_secret(value):
            secret.append(name)
        elif field in JSON_FIELDS and _json_has_secret(value):
            secret.append(name)
    return sorted(secret)


def ckval_env(*, include_secrets: bool = False) -> dict[str, str]:
    """The CKVAL_* variables of this process, to hand on to Ray workers and actors.

    For Ray's ``runtime_env`` the variables that hold a secret (a database URL with a
    password, CKVAL_SECRET_KEY, CKVAL_API_TOKEN, storage credentials) are left out and
    named in CKVAL_WITHHELD instead. ``include_secrets`` is for channels that are not
    shown, such as a Dask task's arguments.
    """
    env = {k: v for k, v in os.environ.items() if env_field(k) and k != WITHHELD_VAR}
    if include_secrets:
        return env
    withheld = secret_env_vars(env)
    for name in withheld:
        del env[name]
    if withheld:
        env[WITHHELD_VAR] = ",".join(withheld)
    return env


def worker_settings(settings: Settings, served: Callable[[], Settings]) -> Settings:
    """The settings of a process that may be a Ray worker started with ``ckval_env()``:
    ``settings`` (its CKVAL_* variables) when it has every variable, else completed from
    ``served()``, the running service's full settings. A process with no CKVAL_* variable
    at all (a remote cluster) gets the service's settings; without a service, the
    defaults apply unless a variable was withheld (then SecretsUnavailable)."""
    withheld = [
        name
        for name in os.environ.get(WITHHELD_VAR, "").split(",")
        if name and name not in os.environ
    ]
    configured = any(env_field(k) and k != WITHHELD_VAR for k in os.environ)
    if configured and not withheld:
        return settings
    try:
        service = served()
    except Exception as exc:  # noqa: BLE001 - no service: the defaults apply, unless withheld
        if withheld:
            from validation_service.errors import SecretsUnavailable

            raise SecretsUnavailable(withheld, f"{type(exc).__name__}: {exc}") from None
        return settings
    if not configured:
        return service
    fields = {env_field(name) for name in withheld}
    # The service signs with the driver's key: take it unless this process has its own.
    for field in ("secret_key", "secret_key_previous"):
        if env_var(field) not in os.environ:
            fields.add(field)
    return settings.model_copy(update={field: getattr(service, field) for field in fields})


# Settings given as JSON that may hold credentials (storage options, a sink's tracking
# URI): withheld from Ray and never echoed in an error.
JSON_FIELDS = ("storage_options", "sinks")


def _json_has_secret(value: str) -> bool:
    text = (value or "").strip()
    if not text.startswith(("{", "[")):
        return False  # "mlflow,wandb": sink kinds, nothing else
    try:
        parsed = json.loads(text)
    except ValueError:
        return True  # not readable here: treat it as secret rather than show it
    return mask_value(parsed) != parsed


def _sqlalchemy_url_text(url: Any) -> str:
    render = getattr(url, "render_as_string", None)
    return render(hide_password=False) if render is not None else str(url)
