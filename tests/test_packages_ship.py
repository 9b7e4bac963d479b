"""pyproject.toml ships every package of the code: a package missing from
[tool.setuptools] packages works from a checkout and is absent from the wheel."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def folder_of(package: str) -> Path:
    for name, folder in SETUPTOOLS.get("package-dir", {}).items():
        if package == name or package.startswith(name + "."):
            return ROOT / folder / Path(*package[len(name) :].split(".")[1:])
    return ROOT / Path(*package.split("."))


def test_every_package_is_listed():
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("validation_service", "trainer_integration")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert sorted(found - set(SETUPTOOLS["packages"])) == []


def test_listed_packages_and_their_data_exist():
    for package in SETUPTOOLS["packages"]:
        assert (folder_of(package) / "__init__.py").is_file(), package
    for package, patterns in SETUPTOOLS.get("package-data", {}).items():
        assert package in SETUPTOOLS["packages"], package
        for pattern in patterns:
            assert list(folder_of(package).glob(pattern)), f"{package}: {pattern}"
