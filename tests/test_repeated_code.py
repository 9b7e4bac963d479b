"""No copied code in the product: no run of 6 or more identical lines stands in two places
of validation_service/ or trainer_integration/, except the repetition ARCHITECTURE.md lists
under "Deliberate repetition". One piece of code serves where the logic is the same."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("validation_service", "trainer_integration")
RUN_LINES = 6
# A run found in more places than this is a common idiom, not a copy.
MAX_PLACES = 8

# ARCHITECTURE.md, "Deliberate repetition": the callbacks' keyword signatures.
DELIBERATE = {
    ("trainer_integration/keras.py", "trainer_integration/lightning.py"),
    ("trainer_integration/keras.py", "trainer_integration/transformers.py"),
    ("trainer_integration/lightning.py", "trainer_integration/transformers.py"),
}

_PUNCTUATION_ONLY = re.compile(r"[\s()\[\]{}:,]*")


def significant_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text with white space folded) of the lines that count: not blank,
    not a comment, not punctuation alone, not part of an import statement."""
    imports = {
        number
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for number in range(node.lineno, node.end_lineno + 1)
    }
    counted = []
    for number, line in enumerate(source.splitlines(), 1):
        text = " ".join(line.split())
        if number in imports or text.startswith("#") or _PUNCTUATION_ONLY.fullmatch(text):
            continue
        counted.append((number, text))
    return counted


def repeated_runs(sources: dict[str, str]) -> dict[tuple[str, str], tuple[int, int]]:
    """(file, file) -> (first line there, first line here) of a run of RUN_LINES identical
    lines that stands in both places (in one file: places that do not overlap)."""
    places: dict[tuple[str, ...], list[tuple[str, int, int]]] = {}
    for name, source in sources.items():
        lines = significant_lines(source)
        for start in range(len(lines) - RUN_LINES + 1):
            run = lines[start : start + RUN_LINES]
            key = tuple(text for _, text in run)
            places.setdefault(key, []).append((name, run[0][0], run[-1][0]))
    pairs: dict[tuple[str, str], tuple[int, int]] = {}
    for found in places.values():
        if len(found) > MAX_PLACES:
            continue
        for (a, a_first, a_last), (b, b_first, b_last) in itertools.combinations(found, 2):
            if a == b and a_first <= b_last and b_first <= a_last:
                continue
            pairs.setdefault((a, b), (a_first, b_first))
    return pairs


def test_no_product_code_is_copied():
    sources = {
        str(path.relative_to(ROOT)): path.read_text()
        for package in PRODUCT
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    copies = [
        f"{a}:{a_line} ~ {b}:{b_line}"
        for (a, b), (a_line, b_line) in sorted(repeated_runs(sources).items())
        if (a, b) not in DELIBERATE
    ]
    assert copies == [], (
        f"runs of {RUN_LINES} or more identical lines in two places (make one helper, or a "
        f"table, serve both): {'; '.join(copies)}"
    )


def test_the_copy_rule_sees_a_copied_run_and_passes_over_imports_comments_and_blanks():
    lines = [f"    total += step_{n}(value)\n" for n in range(RUN_LINES)]
    imports = "from os import (\n" + "".join(f"    name_{n},\n" for n in range(RUN_LINES)) + ")\n"
    first = f"{imports}def first(value):\n    total = 0\n{''.join(lines)}    return total\n"
    spaced = "\n    # why\n".join(lines)
    second = f"{imports}def second(value):\n    total = 1\n{spaced}"
    assert repeated_runs({"a.py": first, "b.py": second}) == {("a.py", "b.py"): (11, 11)}
    third = f"def third(value):\n{''.join(lines[1:])}"
    assert repeated_runs({"a.py": first, "c.py": third}) == {}
