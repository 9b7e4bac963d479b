"""validate_fn references: an importable "package.module:function", or a pickled callable.

Used where a report is checked (a reference that does not import, or names a module
outside CKVAL_ALLOWED_MODULES, fails at report time) and where an attempt runs (the
function and its config are loaded there, signatures verified before unpickling).
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable
from typing import Any

import cloudpickle

from validation_service.errors import InvalidInput, ModuleNotAllowed, PayloadSignatureError
from validation_service.signing import VALIDATE_CONFIG, VALIDATE_FN, PayloadTrust, form_binding


def load_job_payloads(
    ref: str | None,
    pickled: bytes | None,
    config: bytes | None,
    *,
    trust: PayloadTrust,
    bound_to: bytes,
    job_id: int | None = None,
) -> tuple[Callable[..., Any], dict[str, Any]]:
    """A stored job's (validate_fn, validate_config), each verified for this job.

    The validate_config is verified first: its signature covers the form of the
    validate_fn (signing.form_binding: the whole reference, or that it is a pickle), so
    a reference that was set or changed in the row without the key, or a missing
    validate_config, raises PayloadSignatureError before any module is imported.
    """
    if config is None:
        raise PayloadSignatureError(
            job_id,
            VALIDATE_CONFIG,
            "it is missing: every job stores a signed validate_config, which binds the form "
            "of its validate_fn; the row was changed, or stored by a ckval that did not bind it",
        )
    form = form_binding(bound_to, None if pickled is not None else ref)
    loaded_config = load_validate_config(config, trust=trust, bound_to=form, job_id=job_id)
    fn = load_validate_fn(ref, pickled, trust=trust, bound_to=bound_to, job_id=job_id)
    return fn, loaded_config


def load_validate_fn(
    ref: str | None,
    pickled: bytes | None,
    *,
    trust: PayloadTrust,
    bound_to: bytes,
    job_id: int | None = None,
) -> Callable[..., Any]:
    """The job's validate_fn: its pickle once the signature verifies for this job
    (``bound_to``: signing.job_binding), or its reference once the module is allowed.
    Raises before anything untrusted is unpickled or imported. A reference's signature
    is its validate_config's: call load_job_payloads, which verifies that first."""
    if pickled is not None:
        return cloudpickle.loads(
            trust.verify(VALIDATE_FN, pickled, bound_to=bound_to, job_id=job_id)
        )
    if not ref:
        raise InvalidInput("the job has no validate_fn")
    return import_validate_fn(ref, trust.allowed_modules)


def load_validate_config(
    stored: bytes | None, *, trust: PayloadTrust, bound_to: bytes, job_id: int | None = None
) -> dict[str, Any]:
    """The job's validate_config, unpickled once its signature verifies for this job ({}
    if none)."""
    if stored is None:
        return {}
    return cloudpickle.loads(
        trust.verify(VALIDATE_CONFIG, stored, bound_to=bound_to, job_id=job_id)
    )


def check_module_allowed(ref: str, allowed_modules: tuple[str, ...] | list[str] | None) -> None:
    """Raises ModuleNotAllowed unless the reference's module is one of ``allowed_modules``
    or inside one of them ("pkg" allows "pkg" and "pkg.sub", not "pkgother")."""
    if allowed_modules and not _inside(ref.partition(":")[0].strip(), allowed_modules):
        raise ModuleNotAllowed(ref, list(allowed_modules))


def _inside(module_name: str, allowed_modules: tuple[str, ...] | list[str]) -> bool:
    for prefix in allowed_modules:
        prefix = prefix.strip()
        if prefix.endswith("."):
            if module_name.startswith(prefix):
                return True
        elif module_name == prefix or module_name.startswith(prefix + "."):
            return True
    return False


def parse_reference(ref: Any) -> tuple[str, list[str]]:
    """(module name, attribute names) of a "package.module:function" reference; raises
    InvalidInput for anything else (a relative ".module", an empty or dotted-wrong part)."""
    module_name, sep, attr_path = ref.partition(":") if isinstance(ref, str) else ("", "", "")
    parts = [*module_name.split("."), *attr_path.split(".")]
    if not sep or not all(part.isidentifier() for part in parts):
        raise InvalidInput(
            f"validate_fn reference {ref!r} is not of the form 'package.module:function' "
            "(an absolute module name, a ':', then the function's name; dots between "
            "names only)."
        )
    return module_name, attr_path.split(".")


# What the attribute walk of a reference may reach only inside the allowed modules: a
# module, or a function or class defined elsewhere ("json:codecs.open" reaches codecs).
_BOUND_KINDS = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)


def import_validate_fn(
    ref: str, allowed_modules: tuple[str, ...] | list[str] | None = None
) -> Callable[..., Any]:
    """Imports "package.module:function" (dots after the colon walk attributes), only from
    ``allowed_modules`` when given."""
    module_name, attributes = parse_reference(ref)
    attr_path = ".".join(attributes)
    check_module_allowed(ref, allowed_modules)
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInput(
            f"validate_fn reference {ref!r}: module {module_name!r} does not import ({exc}). "
            "Install the package that defines it on the cluster, or pass the function itself."
        ) from None
    for part in attributes:
        if part.startswith("__"):
            raise InvalidInput(f"validate_fn reference {ref!r} walks the special name {part!r}.")
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InvalidInput(
                f"validate_fn reference {ref!r}: {module_name!r} has no attribute {attr_path!r}."
            ) from None
        if allowed_modules and isinstance(target, (*_BOUND_KINDS, types.MethodType)):
            # The whole string is bounded, not only its module part.
            if isinstance(target, types.ModuleType):
                home = reached = target.__name__
            else:
                home = target.__module__ or ""
                reached = f"{home}.{getattr(target, '__qualname__', part)}"
            if not _inside(home, allowed_modules):
                raise ModuleNotAllowed(ref, list(allowed_modules), reached)
    if not callable(target):
        raise InvalidInput(f"validate_fn reference {ref!r} names a {type(target).__name__}.")
    return target


def call_validate_fn(fn: Callable[..., Any], checkpoint: Any, config: dict[str, Any]) -> Any:
    """Calls a validate_fn in the form it is written for.

    ckval's form is ``fn(checkpoint, config)``; Ray Train 2.60's ``ValidationFn`` is
    ``fn(checkpoint, **fn_kwargs)``, so a function written for Ray (``def
    validation_fn(checkpoint, train_run_name, epoch)``) gets the validate_config entries
    as keyword arguments. Raises InvalidInput when neither form binds.
    """
    if takes_config_as_keywords(fn, config):
        return fn(checkpoint, **config)
    return fn(checkpoint, config)


def takes_config_as_keywords(fn: Callable[..., Any], config: dict[str, Any]) -> bool:
    """Whether ``fn`` is called ``fn(checkpoint, **config)`` rather than ``fn(checkpoint, config)``.

    The keyword form is chosen when only it binds, or when both bind and every config
    key names a parameter of ``fn`` (``def validate(checkpoint, epoch)`` with
    ``{"epoch": 3}``). Raises InvalidInput naming both forms when neither binds.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: ckval's form
        return False
    positional = _binds(signature, None, config)
    keywords = _binds(signature, None, **config)
    if not positional and not keywords:
        raise InvalidInput(
            f"validate_fn {getattr(fn, '__qualname__', fn)!r}{signature} takes neither "
            f"(checkpoint, config) nor (checkpoint, **validate_config) with validate_config "
            f"keys {sorted(config)}: define it as def validate(checkpoint, config) -> dict, "
            "or with one parameter per validate_config key after the checkpoint."
        )
    if not positional:
        return True
    named = {
        p.name
        for p in list(signature.parameters.values())[1:]
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return keywords and bool(config) and set(config) <= named


def _binds(signature: inspect.Signature, *args: Any, **kwargs: Any) -> bool:
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True
