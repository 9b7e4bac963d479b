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

# Settings that can hold a credential inside them, in every form each accepts: a URL
# (user info, secret query parameters), a JSON object (secret option names, URLs and
# connection strings anywhere in it), a JSON list or comma-separated URLs. A variable
# among them that holds one is withheld from Ray's runtime_env (ckval_env), and each is
# masked by public_settings. tests/test_credential_settings.py makes every new setting
# be put here, in SECRET_FIELDS, or among the plain ones.
CREDENTIAL_FIELDS = (
    "database_url",
    "storage",
    "storage_options",
    "sinks",
    "mlflow_allowed_uris",
    "deletable_roots",
)

# The rule for secret-looking names (query parameters, option keys, header names): the
# name is split into words at every character that is not a letter or a digit and where
# a lower-case letter is followed by an upper-case one ("x-api-key", "AccountKey",
# "connectionString"). It is secret when one of its words is a secret word, or its words
# run together contain a secret stem ("PGPASSWORD", "sessionToken", "conn_str").
_SECRET_WORDS = frozenset({"key", "pass", "pwd", "pw", "auth", "oauth", "dsn", "sig", "sas"})
_SECRET_STEMS = (
    "password",
    "passwd",
    "passphrase",
    "secret",
    "token",
    "credential",
    "apikey",
    "privatekey",
    "authoriz",
    "authentic",
    "connectionstring",
    "connstr",
    "signature",
    "cookie",
)
_WORD_BREAK = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
# Schemes whose user name alone may be a credential (a token given as the user name).
_TOKEN_AS_USER_SCHEMES = ("http", "https", "ws", "wss")


def is_secret_name(name: str) -> bool:
    """Whether a query parameter, option or header of this name holds a secret (the
    rule above: a secret word, or a secret stem in its words run together)."""
    words = [word.lower() for word in _WORD_BREAK.split(str(name)) if word]
    joined = "".join(words)
    return any(word in _SECRET_WORDS for word in words) or any(
        stem in joined for stem in _SECRET_STEMS
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
    """``text`` with a password in ``user:password@`` as urllib (and fsspec) read it; an
    HTTP(S) URL's user info with no password is a credential itself (a token given as
    the user name, as GitHub and many servers take it) and is masked whole."""
    parts = urlsplit(text)
    userinfo, at, host = parts.netloc.rpartition("@")
    user, colon, password = userinfo.partition(":")
    start = text.index("://") + 3
    rest = text[start + len(parts.netloc) :]
    if at and not colon and userinfo != MASK and parts.scheme.lower() in _TOKEN_AS_USER_SCHEMES:
        return f"{text[:start]}{MASK}@{host}{rest}"
    if not at or not colon or password == MASK:
        return text
    return f"{text[:start]}{user}:{MASK}@{host}{rest}"


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
    """``url`` with no user info at all (user and password, whatever the scheme) and no
    secret query parameter: fit to store and serve (e.g. the tracking URI a run was
    logged to); other text comes back unchanged."""
    text = mask_url(url)
    if not _URL.match(text):
        return text
    start = text.index("://") + 3
    netloc = urlsplit(text).netloc
    if "@" in netloc:
        text = text[:start] + netloc.rpartition("@")[2] + text[start + len(netloc) :]
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
    """``value`` (a str, or dicts and lists of them) with every secret in it masked: URLs'
    credentials, and secret parts of connection strings ("...;AccountKey=...;")."""
    if isinstance(value, dict):
        return mask_options(value)
    if isinstance(value, (list, tuple)):
        return [mask_value(item) for item in value]
    if not isinstance(value, str):
        return value
    return mask_url(value) if _URL.match(value) else _mask_connection_string(value)


# "Name=value" parts of a connection string, separated by ';' (Azure, ODBC, ADO.NET).
_CONNECTION_PART = re.compile(r"(?P<name>[^;=]+?)(?P<eq>\s*=\s*)(?P<value>[^;]*)")


def _mask_connection_string(text: str) -> str:
    if "=" not in text or ";" not in text:
        return text
    return _CONNECTION_PART.sub(
        lambda m: m.group() if not is_secret_name(m["name"]) else m["name"] + m["eq"] + MASK,
        text,
    )


def public_settings(settings: Settings) -> Settings:
    """A copy of ``settings`` with no secret: fit to return from the service or to show.

    Every credential-bearing setting (CREDENTIAL_FIELDS) is masked, and whole secret
    fields are cleared.
    """
    update: dict[str, Any] = {
        name: mask_value(getattr(settings, name))
        for name in CREDENTIAL_FIELDS
        if name in type(settings).model_fields
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
        elif field in CREDENTIAL_FIELDS and _text_has_secret(value):
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


def _text_has_secret(value: str) -> bool:
    """Whether a credential-bearing variable holds a secret in any form it is read in: a
    URL, JSON (an object or a list), or comma-separated URLs."""
    text = (value or "").strip()
    if has_secret(text) or mask_value(text) != text:
        return True
    if text.startswith(("{", "[")):
        try:
            parsed = json.loads(text)
        except ValueError:
            return True  # not readable here: treat it as secret rather than show it
        return mask_value(parsed) != parsed
    return any(has_secret(part.strip()) for part in text.split(","))


def _sqlalchemy_url_text(url: Any) -> str:
    render = getattr(url, "render_as_string", None)
    return render(hide_password=False) if render is not None else str(url)
