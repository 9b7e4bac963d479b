"""House rules of the product code, held by the suite so that no feature grows a room back:
no file of validation_service/ or trainer_integration/ over 600 lines, no function over
60 lines (ARCHITECTURE.md says how the rooms are split)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("validation_service", "trainer_integration")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60


def _product_files() -> list[Path]:
    return sorted(path for package in PRODUCT for path in (ROOT / package).rglob("*.py"))


def test_no_product_file_is_over_600_lines():
    offenders = []
    for path in _product_files():
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
