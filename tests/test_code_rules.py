"""House rules of the product code, held by the suite so that no feature grows a room back:
no file of validation_service/, trainer_integration/ or benchmarks/ over 600 lines, no
product function over 60 lines (ARCHITECTURE.md says how the rooms are split); Ray's
internals named only in validation_service/_ray_compat.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("validation_service", "trainer_integration")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60


def _product_files() -> list[Path]:
    return sorted(path for package in PRODUCT for path in (ROOT / package).rglob("*.py"))


def _benchmark_files() -> list[Path]:
    return sorted((ROOT / "benchmarks").glob("*.py"))


def test_no_product_or_benchmark_file_is_over_600_lines():
    offenders = []
    for path in _product_files() + _benchmark_files():
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            offenders.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert offenders == [], (
        f"files over {MAX_FILE_LINES} lines (split them by concept): {', '.join(offenders)}"
    )


def test_no_product_function_is_over_60_lines():
    """Counted from ``def`` to its last line, docstring included; a nested function
    counts in its own right and inside the function that holds it."""
    offenders = []
    for path in _product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - first + 1
                if lines > MAX_FUNCTION_LINES:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    offenders.append(f"{where} {node.name} ({lines})")
    assert offenders == [], (
        f"functions over {MAX_FUNCTION_LINES} lines (split them): {', '.join(offenders)}"
    )


# ------------------------------------------------------------------- Ray's internals
# Code that may name Ray's internals: only validation_service/_ray_compat.py, which lists
# each one with the releases that have it (tests/test_ray_compat.py checks them).
RAY_COMPAT = ROOT / "validation_service" / "_ray_compat.py"
RAY_RULED = (*PRODUCT, "benchmarks", "examples")
# A module path of Ray with a part that starts with one underscore: ray._private,
# ray._raylet, ray._common, ray.train.v2._internal, ray.autoscaler._private.
_RAY_INTERNAL_PATH = re.compile(r"\bray(?:\.\w+)*?\._[A-Za-z]\w*")
# Resources that Ray gives its nodes for its own use, e.g. "node:__internal_head__".
_RAY_INTERNAL_RESOURCE = re.compile(r"node:__internal\w*")


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _imported_names(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level or not node.module:  # relative imports are ckval's own
        return []
    return [f"{node.module}.{alias.name}" for alias in node.names]


def ray_internals_named(source: str) -> list[tuple[int, str]]:
    """(line, text) for each import, attribute chain or string that names Ray's
    internals; an attribute chain counts once, however long."""
    tree = ast.parse(source)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            texts = [name for name in _imported_names(node) if _is_ray_internal_path(name)]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            dotted = _dotted(node)
            texts = [dotted] if dotted and _is_ray_internal_path(dotted) else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts = _RAY_INTERNAL_PATH.findall(node.value)
            texts += _RAY_INTERNAL_RESOURCE.findall(node.value)
        else:
            continue
        found += [(node.lineno, text) for text in texts]
    return sorted(found)


def _is_ray_internal_path(dotted: str) -> bool:
    return dotted.startswith("ray.") and _RAY_INTERNAL_PATH.match(dotted) is not None


def test_ray_internals_are_named_only_in_ray_compat():
    """Imports, attribute chains (``ray._private.services``) and strings
    (``"ray.train.v2._internal..."``, ``"node:__internal_head__"``) alike."""
    offenders = []
    for folder in RAY_RULED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == RAY_COMPAT:
                continue
            for line, text in ray_internals_named(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {text}")
    assert offenders == [], (
        "Ray internals named outside validation_service/_ray_compat.py (move them there, "
        "behind a named function, with the releases that have them and a fallback): "
        + "; ".join(offenders)
    )


def test_the_ray_internals_rule_sees_each_way_of_naming_them():
    source = (
        "import ray._private.services\n"
        "from ray.train.v2._internal.execution import context\n"
        "from ray import _raylet\n"
        "address = ray._private.services.get_node_ip_address()\n"
        "MODULE = 'ray.train.v2._internal.execution.callback'\n"
        "placement = {'resources': {'node:__internal_head__': 0.001}}\n"
        "import ray.train\n"
        "version = ray.__version__ + ray.train.report.__name__\n"
        "name = 'array._private' + 'ray.train'\n"
    )
    assert ray_internals_named(source) == [
        (1, "ray._private.services"),
        (2, "ray.train.v2._internal.execution.context"),
        (3, "ray._raylet"),
        (4, "ray._private.services.get_node_ip_address"),
        (5, "ray.train.v2._internal"),
        (6, "node:__internal_head__"),
    ]
