"""The floors of validation_service/: no module imports from a floor above its own.

Each module's floor comes from its path (ARCHITECTURE.md, "Floors"), top to bottom:

    cli        cli/                       the `ckval` command line, `ckval ui`, the demo
    api        api/                       HTTP: the API, its guard, the dashboard, /metrics
    core       service/ executors/        the service's actors and loop, how one attempt
               validators/                runs, the ready-made validate_fns
    registry   registry/                  the only code that touches the database
    base       the package's top          settings, errors, states, names, metrics,
               and sinks/                 storage, signing, secrets, Ray's internals

Every import counts: at module level, inside functions, under ``if TYPE_CHECKING:``, and
the modules named to ``importlib.import_module`` or ``import_once``. The package's own
``__init__.py`` is its public face, above every floor: its names load on first use from
the floors, and ``from validation_service import X`` counts as an import of X's module.

The training side (trainer_integration/) stands beside the command line and the API: it
may use the core and what lies below, never cli/ or api/. validation_service/ imports
nothing of trainer_integration/, except ALLOWED_TRAINER_IMPORTS (the demo trains a model).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "validation_service"
TRAINER = "trainer_integration"

# Top to bottom; ARCHITECTURE.md states the same order.
FLOORS = ("cli", "api", "core", "registry", "base")
# A module's floor is the one of the longest prefix that names it; "base" for any other.
FLOOR_OF = {
    f"{PACKAGE}.cli": "cli",
    f"{PACKAGE}.api": "api",
    f"{PACKAGE}.service": "core",
    f"{PACKAGE}.executors": "core",
    f"{PACKAGE}.validators": "core",
    f"{PACKAGE}.registry": "registry",
}
# The floors trainer_integration/ may import from.
TRAINER_MAY_IMPORT = ("core", "registry", "base")
# validation_service modules that may import trainer_integration, and why.
ALLOWED_TRAINER_IMPORTS = {
    f"{PACKAGE}.cli.demo": "`ckval demo` is a training program: it reports with report()",
}
_DYNAMIC_IMPORTERS = ("import_module", "import_once")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    line: int
    target: str  # the module imported, dotted


def floor_of(module: str) -> str | None:
    """The floor of a validation_service module; None for the package's own __init__
    and for modules of other packages."""
    if not module.startswith(PACKAGE + "."):
        return None
    for prefix in sorted(FLOOR_OF, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return FLOOR_OF[prefix]
    return "base"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def root_exports() -> dict[str, str]:
    """validation_service/__init__.py's ``_EXPORTS``: public name -> defining module."""
    tree = ast.parse((ROOT / PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("validation_service/__init__.py has no _EXPORTS")


def _resolve_from(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(source: str, module: str, *, is_package: bool = False) -> list[Import]:
    """Every module of ours that ``source`` imports, wherever the import statement is."""
    exports = root_exports()
    found: list[Import] = []
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parent = _resolve_from(module, node, is_package)
            for alias in node.names:
                child = f"{parent}.{alias.name}"
                if is_module(child):
                    targets.append(child)
                elif parent == PACKAGE and alias.name in exports:
                    targets.append(exports[alias.name])
                else:
                    targets.append(parent)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if (
                name in _DYNAMIC_IMPORTERS
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                targets = [first.value]
        for target in targets:
            if target.split(".")[0] in (PACKAGE, TRAINER):
                found.append(Import(module, node.lineno, target))
    return sorted(found, key=lambda imp: imp.line)


def package_imports(package: str) -> list[Import]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        found += imports_of(
            path.read_text(), module_name(path), is_package=path.name == "__init__.py"
        )
    return found


def upward(imp: Import) -> str | None:
    """Why ``imp`` breaks the floors, or None when it goes down or stays level."""
    if imp.target.split(".")[0] == TRAINER:
        if imp.module.split(".")[0] == PACKAGE and imp.module not in ALLOWED_TRAINER_IMPORTS:
            return "validation_service imports nothing of trainer_integration"
        return None
    below = floor_of(imp.target)
    if imp.module.split(".")[0] == TRAINER:
        if below is not None and below not in TRAINER_MAY_IMPORT:
            return f"trainer_integration uses no {below}/ floor"
        return None
    above = floor_of(imp.module)
    if above is None or below is None:
        return None  # the package's public face, or the face imported
    if FLOORS.index(below) < FLOORS.index(above):
        return f"floor {above} imports floor {below}, which is above it"
    return None


def describe(imp: Import, why: str) -> str:
    return f"{imp.module} (line {imp.line}) imports {imp.target}: {why}"


def test_no_module_imports_from_a_floor_above_its_own():
    breaks = [
        describe(imp, why)
        for imp in package_imports(PACKAGE) + package_imports(TRAINER)
        if (why := upward(imp))
    ]
    assert breaks == [], "imports that climb (ARCHITECTURE.md, Floors):\n" + "\n".join(breaks)


def test_every_floor_holds_modules_and_every_prefix_names_a_module():
    modules = {module_name(path) for path in (ROOT / PACKAGE).rglob("*.py")}
    assert {floor_of(m) for m in modules} - {None} == set(FLOORS)
    assert all(is_module(prefix) for prefix in FLOOR_OF)
    assert set(FLOOR_OF.values()) | {"base"} == set(FLOORS)
    assert all(is_module(m) for m in ALLOWED_TRAINER_IMPORTS)


def test_architecture_md_states_the_same_floors_in_the_same_order():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    assert " > ".join(FLOORS) in text
    for prefix in FLOOR_OF:
        assert f"`{prefix.removeprefix(PACKAGE + '.')}/`" in text, prefix


def test_the_rule_sees_every_kind_of_import_that_climbs():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from validation_service.jobs import JobStatus\n"
        "if TYPE_CHECKING:\n"
        "    from validation_service.api.views import run_json\n"
        "def f():\n"
        "    import validation_service.cli\n"
        "    from validation_service import service\n"
        "    from validation_service import ValidationService\n"
        "    import_once('validation_service.executors.ray_task')\n"
        "    import trainer_integration\n"
    )
    found = imports_of(source, "validation_service.registry.example")
    assert [(imp.line, floor_of(imp.target), bool(upward(imp))) for imp in found] == [
        (2, "base", False),
        (4, "api", True),
        (6, "cli", True),
        (7, "core", True),
        (8, "core", True),
        (9, "core", True),
        (10, None, True),
    ]
    training = imports_of(source, "trainer_integration.example")
    assert [imp.line for imp in training if upward(imp)] == [4, 6]


def test_relative_imports_resolve_inside_their_package():
    [imp] = imports_of("from .views import run_json\n", "validation_service.api.app")
    assert imp.target == "validation_service.api.views"
    [imp] = imports_of("from . import views\n", "validation_service.api", is_package=True)
    assert imp.target == "validation_service.api.views"
