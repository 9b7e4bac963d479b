"""Cross-run search on SQLite and PostgreSQL: results against a brute-force evaluation
over every record, grammar errors with their position, and the CLI and HTTP surfaces."""

from __future__ import annotations

import fnmatch
import json
import math
import random

import pytest
from click.testing import CliRunner
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.registry_world import cli_group, delete_checkpoint, finish_validations, report
from validation_service.api.registry import registry_router
from validation_service.errors import InvalidInput, InvalidSearch
from validation_service.registry.registry import Registry
from validation_service.storage import CheckpointStorage

RUNS = ["exp-a", "exp-b", "other"]


@pytest.fixture
def world(registry, tmp_path) -> Registry:
    """Three runs of eight checkpoints: accuracy (some missing, one NaN), val-loss, a split
    tag on most, steps, and validations that override some reported accuracies."""
    rng = random.Random(7)
    storage = CheckpointStorage(str(tmp_path / "storage"))
    splits = ["val", "train", "test", None]
    for run in RUNS:
        reported = []
        for i in range(8):
            metrics = {"step": 10 * i, "val-loss": round(rng.uniform(0, 1), 2)}
            if i % 5 != 4:
                metrics["accuracy"] = round(rng.uniform(0, 1), 2)
            reported.append(metrics)
        reported[6]["accuracy"] = math.nan
        report(registry, storage, run, reported[:5], workdir=tmp_path)
        report(registry, storage, run, reported[5:], validate=True, workdir=tmp_path)
        for i in range(8):
            split = splits[(i + RUNS.index(run)) % 4]
            if split is not None:
                registry.tag(run, i, "split", split)
    # A validated accuracy overrides the reported one of report 5 of every run; the
    # validations of reports 6 and 7 are left RUNNING.
    finish_validations(registry, {5: {"accuracy": 0.99}})
    return registry


def _records(registry: Registry) -> list:
    return [record for run in RUNS for record in registry.checkpoints(run)]


def _number(record, name):
    value = record.metrics.get(name)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


def _has(record, name, test):
    value = _number(record, name)
    return value is not None and test(value)


def _like(value, pattern, fold=False):
    if value is None:
        return False
    glob = pattern.replace("%", "*").replace("_", "?")
    return fnmatch.fnmatchcase(value.lower() if fold else value, glob.lower() if fold else glob)


CASES = [
    ("metrics.accuracy > 0.5", lambda r: _has(r, "accuracy", lambda v: v > 0.5)),
    (
        "metrics.accuracy >= 0.5 and tags.split = 'val'",
        lambda r: _has(r, "accuracy", lambda v: v >= 0.5) and r.tags.get("split") == "val",
    ),
    ("metrics.`val-loss` < 0.3", lambda r: _has(r, "val-loss", lambda v: v < 0.3)),
    ('metrics."val-loss" <= 0.3', lambda r: _has(r, "val-loss", lambda v: v <= 0.3)),
    (
        "tags.split IN ('val', \"test\") AND attributes.step >= 20",
        lambda r: r.tags.get("split") in ("val", "test") and r.step >= 20,
    ),
    ("run LIKE 'exp-%'", lambda r: _like(r.run, "exp-%")),
    ("attributes.run ILIKE 'EXP-A%'", lambda r: _like(r.run, "EXP-A%", fold=True)),
    ("attributes.run != 'exp-b'", lambda r: r.run != "exp-b"),
    ("tags.split LIKE 'v_l'", lambda r: _like(r.tags.get("split"), "v_l")),
    ("tags.split ILIKE 'V%'", lambda r: _like(r.tags.get("split"), "V%", fold=True)),
    ("tags.split != 'train'", lambda r: "split" in r.tags and r.tags["split"] != "train"),
    ("attributes.validation_status = 'validated'", lambda r: r.validation_status == "VALIDATED"),
    ("metrics.accuracy = 0.99", lambda r: _has(r, "accuracy", lambda v: v == 0.99)),
    ("metrics.accuracy != 0.99", lambda r: _has(r, "accuracy", lambda v: v != 0.99)),
    (
        "attributes.report_index < 2 and metric.accuracy > 0",
        lambda r: r.report_index < 2 and _has(r, "accuracy", lambda v: v > 0),
    ),
    ("", lambda r: True),
]


def _expected(registry, predicate, order, k):
    run_order = {run.name: run.id for run in registry.runs()}
    matches = [r for r in _records(registry) if predicate(r)]
    matches.sort(key=lambda r: (run_order[r.run], r.report_index))
    for key, descending in reversed(order):
        present = [r for r in matches if key(r) is not None]
        missing = [r for r in matches if key(r) is None]
        present.sort(key=key, reverse=descending)  # stable: ties keep report order
        matches = present + missing
    return [(r.run, r.report_index) for r in matches[:k]]


@pytest.mark.parametrize("text, predicate", CASES, ids=[c[0] or "all" for c in CASES])
def test_search_matches_a_brute_force_evaluation(world, text, predicate):
    found = world.search(text, k=1000)
    assert [(r.run, r.report_index) for r in found] == _expected(world, predicate, [], 1000)
    assert found, "every case of the world matches something"


@pytest.mark.parametrize(
    "order_by, order",
    [
        (["metrics.accuracy DESC"], [(lambda r: _number(r, "accuracy"), True)]),
        (["metrics.`val-loss`"], [(lambda r: _number(r, "val-loss"), False)]),
        (
            ["tags.split ASC", "metrics.accuracy desc"],
            [(lambda r: r.tags.get("split"), False), (lambda r: _number(r, "accuracy"), True)],
        ),
        (["attributes.step DESC", "run"], [(lambda r: r.step, True), (lambda r: r.run, False)]),
    ],
)
def test_search_order_and_k_match_a_brute_force_sort(world, order_by, order):
    for k in (1, 5, 100):
        found = world.search("metrics.`val-loss` > 0.1", order_by=order_by, k=k)
        predicate = lambda r: _has(r, "val-loss", lambda v: v > 0.1)  # noqa: E731
        assert [(r.run, r.report_index) for r in found] == _expected(world, predicate, order, k)


def test_like_is_case_sensitive_and_ilike_is_not(world):
    assert world.search("tags.split LIKE 'V%'") == []
    found = world.search("tags.split ILIKE 'V%'", k=1000)
    assert found and {r.tags["split"] for r in found} == {"val"}


def test_search_records_carry_aliases_tags_and_skip_deleted(world):
    world.set_alias("exp-a", "best", 5)
    found = world.search("run = 'exp-a' and metrics.accuracy = 0.99")
    assert [(r.report_index, r.aliases, r.tags) for r in found] == [
        (5, ("best",), {"split": "train"})
    ]
    delete_checkpoint(world, world.checkpoints("exp-b")[0].id)
    assert [
        r.report_index for r in world.search("run = 'exp-b' and attributes.report_index = 0")
    ] == []


@pytest.mark.parametrize(
    "text, position, expected",
    [
        ("metrics.accuracy >", 18, "a number to compare metrics.accuracy with, found the end"),
        ("metrics.accuracy > 'high'", 19, "a number to compare metrics.accuracy with"),
        ("tags.split > 'a'", 11, "an operator for tags.split (= != LIKE ILIKE IN)"),
        ("metrics.a > 1 or metrics.b > 1", 14, "'and' (the grammar has no 'or'"),
        ("foo.bar = 1", 0, "metrics.<name>, tags.<key>, attributes.<name> or run"),
        ("tags.split = 'val", 13, "a quote that is closed"),
        (
            "attributes.color = 'red'",
            11,
            "an attribute (report_index, run, step, validation_status)",
        ),
        ("tags.split IN ('a' 'b')", 19, "',' or ')' in the list of IN"),
        ("metrics.acc-uracy > 1", 11, "a name, a number, a quoted string or an operator"),
        ("attributes.validation_status = 'DONE'", 31, "a validation status"),
        ("metrics.accuracy > 0.5 metrics.loss < 1", 23, "'and' or the end of the filter"),
        ("metrics. > 1", 9, "a name (quote it with backticks"),
    ],
)
def test_a_filter_that_does_not_parse_says_where_and_what_was_expected(
    registry, text, position, expected
):
    with pytest.raises(InvalidSearch) as caught:
        registry.search(text)
    assert caught.value.position == position
    message = str(caught.value)
    assert f"position {position}: expected {expected}" in message
    assert message.endswith("\n  " + " " * position + "^")


def test_an_order_by_that_does_not_parse_is_refused(registry):
    with pytest.raises(InvalidSearch, match="position 17: expected ASC, DESC"):
        registry.search("", order_by=["metrics.accuracy DOWN"])


@pytest.mark.parametrize("k", [0, -1, 10_001, 2.5, True])
def test_a_bad_k_is_refused(registry, k):
    with pytest.raises(InvalidInput, match="k must be an int from 1 to 10000"):
        registry.search("", k=k)


def test_an_order_by_given_as_one_string_is_refused(registry):
    with pytest.raises(InvalidInput, match="order_by must be a list of str"):
        registry.search("", order_by="metrics.accuracy DESC")


def test_search_command_and_route(world):
    text = "metrics.accuracy > 0.5 and tags.split = 'val'"
    expected = [
        (r.run, r.report_index) for r in world.search(text, order_by=["metrics.accuracy DESC"])
    ]
    assert expected
    app = FastAPI()
    app.include_router(registry_router(world, world.settings))
    client = TestClient(app)
    response = client.get("/search", params={"filter": text, "order_by": "metrics.accuracy DESC"})
    assert response.status_code == 200, response.text
    assert [(r["run"], r["report_index"]) for r in response.json()] == expected
    response = client.get("/search", params={"filter": "metrics.accuracy >"})
    assert response.status_code == 400
    assert response.json()["error"] == "InvalidSearch"
    assert "position 18" in response.json()["detail"]
    result = CliRunner().invoke(
        cli_group(),
        [
            "--database-url",
            world.url,
            "search",
            text,
            "--order-by",
            "metrics.accuracy DESC",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert [(r["run"], r["report_index"]) for r in json.loads(result.output)] == expected
    result = CliRunner().invoke(cli_group(), ["--database-url", world.url, "search", "run = "])
    assert result.exit_code == 2 and "Invalid search at position 6" in result.output
