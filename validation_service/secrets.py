"""What ckval treats as secret, and how a secret is kept out of text: URLs and settings.

``mask_url`` is the one function that makes a URL fit to print (errors, logs, ``repr``,
HTTP answers); ``public_settings`` is the one view of Settings fit to return or show.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit

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
    """A URL fit to print: a password in ``user:password@`` and the values of secret
    query parameters (``password``, ``token``, ``aws_secret_access_key``, ...) become ***.

    Takes a string or a SQLAlchemy URL; text that is not a URL comes back unchanged.
    """
    if url is None:
        return ""
    text = url if isinstance(url, str) else _sqlalchemy_url_text(url)
    if not _URL.match(text):
        return text
    parts = urlsplit(text)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, sep, _password = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if sep else netloc
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(is_secret_name(name) for name, _ in pairs):
            masked = [(name, MASK if is_secret_name(name) else value) for name, value in pairs]
            query = urlencode(masked, safe="*/:")
    if netloc == parts.netloc and query == parts.query:
        return text
    # Rebuilt by hand: urlunsplit drops the empty authority of "sqlite:///path".
    masked = f"{parts.scheme}://{netloc}{parts.path}"
    if query:
        masked += f"?{query}"
    if parts.fragment:
        masked += f"#{parts.fragment}"
    return masked


def has_secret(url: str | None) -> bool:
    """Whether a URL carries a password or a secret query parameter."""
    return bool(url) and mask_url(url) != url


def mask_options(options: dict[str, Any]) -> dict[str, Any]:
    """Storage options (fsspec keyword arguments) with secret values shown as ***."""
    masked: dict[str, Any] = {}
    for name, value in options.items():
        if is_secret_name(str(name)):
            masked[name] = MASK
        elif isinstance(value, dict):
            masked[name] = mask_options(value)
        else:
            masked[name] = value
    return masked


def public_settings(settings: Settings) -> Settings:
    """A copy of ``settings`` with no secret: fit to return from the service or to show.

    The database URL is masked, whole secret fields are cleared and secret storage
    options are shown as ***.
    """
    update: dict[str, Any] = {
        "database_url": mask_url(settings.database_url) if settings.database_url else None,
        "storage_options": mask_options(settings.storage_options),
        "storage": mask_url(settings.storage) if settings.storage else None,
    }
    for name in SECRET_FIELDS:
        if name in type(settings).model_fields:
            update[name] = None
    return settings.model_copy(update=update)


# CKVAL_* variables whose value is withheld from Ray's runtime_env (see ckval_env()).
WITHHELD_VAR = "CKVAL_WITHHELD"


def secret_env_vars(environ: dict[str, str] | None = None) -> list[str]:
    """The CKVAL_* variables of ``environ`` (default: this process) that hold a secret."""
    environ = dict(os.environ if environ is None else environ)
    secret = []
    for name, value in environ.items():
        if not name.startswith("CKVAL_") or name == WITHHELD_VAR:
            continue
        field = name[len("CKVAL_") :].lower()
        if field in SECRET_FIELDS:
            secret.append(name)
        elif field in ("database_url", "storage") and has_secret(value):
            secret.append(name)
        elif field == "storage_options" and _options_have_secret(value):
            secret.append(name)
    return sorted(secret)


def _options_have_secret(value: str) -> bool:
    try:
        options = json.loads(value or "{}")
    except ValueError:
        return True  # not readable here: treat it as secret rather than show it
    return isinstance(options, dict) and mask_options(options) != options


def _sqlalchemy_url_text(url: Any) -> str:
    render = getattr(url, "render_as_string", None)
    return render(hide_password=False) if render is not None else str(url)
