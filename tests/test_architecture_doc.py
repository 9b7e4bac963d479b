"""ARCHITECTURE.md names every module: a module added without a line there fails here.

The rule, as the document states it: under ``## Modules``, each package has a heading
(``### `validation_service/` ``) and each of its modules a list item that starts with its
path inside the package in backquotes (``- `registry/ledger.py`: ...``), followed by
what the module is. A package's ``__init__.py`` is left out of the rule.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "ARCHITECTURE.md"
PACKAGES = ("validation_service", "trainer_integration")
_ITEM = re.compile(r"^- `([^`]+\.py)`: \S")


def package_modules(package: str) -> list[str]:
    """Every module of the package by its path inside it, __init__.py files aside."""
    folder = ROOT / package
    return sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*.py")
        if path.name != "__init__.py"
    )


def named_modules(text: str) -> dict[str, set[str]]:
    """Package -> the modules ARCHITECTURE.md's ``## Modules`` lists under its heading."""
    named: dict[str, set[str]] = {}
    start = re.search(r"^## Modules$", text, re.MULTILINE)
    if start is None:
        return named
    section = re.split(r"^## ", text[start.end() :], maxsplit=1, flags=re.MULTILINE)[0]
    package = None
    for line in section.splitlines():
        heading = re.match(r"^### `(\w+)/`$", line)
        if heading:
            package = heading.group(1)
            named.setdefault(package, set())
            continue
        item = _ITEM.match(line)
        if item and package is not None:
            named[package].add(item.group(1))
    return named


def test_every_module_is_named_in_architecture_md():
    named = named_modules(DOC.read_text())
    missing = [
        f"{package}/{module}"
        for package in PACKAGES
        for module in package_modules(package)
        if module not in named.get(package, set())
    ]
    assert missing == [], (
        "modules without a line under ARCHITECTURE.md's ## Modules (add "
        "'- `<path inside the package>`: what it is' under the package's heading): "
        + ", ".join(missing)
    )


def test_the_rule_reads_items_under_their_own_package_only():
    text = (
        "## Modules\n\n### `validation_service/`\n\n- `stopping.py`: rules\n"
        "- `registry/ledger.py`: writes\n- `cli.py` without a line on it\n\n"
        "### `trainer_integration/`\n\n- `_stopping.py`: should_stop()\n\n## Next\n\n"
        "- `later.py`: not in the section\n"
    )
    assert named_modules(text) == {
        "validation_service": {"stopping.py", "registry/ledger.py"},
        "trainer_integration": {"_stopping.py"},
    }
