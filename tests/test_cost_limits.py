"""Documented caps on what one request may ask of the database (search terms, order
keys, IN lists: a 422 naming the cap), and a run page whose data grows linearly with
its checkpoints and metrics (plotted metrics capped, the rest counted)."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from tests.test_fuzz_inputs import RUN, populate
from validation_service.api import create_app
from validation_service.config import Settings
from validation_service.dashboard import data
from validation_service.registry import search
from validation_service.registry.records import CheckpointRecord
from validation_service.registry.registry import Registry


@pytest.fixture
def api(registry, tmp_path):
    url = registry.engine.url.render_as_string(hide_password=False)
    config = Settings(database_url=url, namespace=f"cost-{uuid.uuid4().hex[:6]}", home=tmp_path)
    own = Registry(settings=config)
    populate(own, tmp_path)
    with TestClient(create_app(config, own), base_url="http://localhost") as client:
        yield client
    own.close()


def test_too_many_search_terms_are_a_422_naming_the_cap(api):
    terms = " and ".join(f"metrics.m{i} > 0" for i in range(search.MAX_TERMS + 1))
    answer = api.get("/search", params={"filter": terms})
    assert answer.status_code == 422, answer.text
    assert f"at most {search.MAX_TERMS}" in answer.json()["detail"]
    allowed = " and ".join(f"metrics.acc > {i / 100}" for i in range(search.MAX_TERMS))
    assert api.get("/search", params={"filter": allowed}).status_code == 200


def test_too_many_order_keys_are_a_422_naming_the_cap(api):
    keys = [f"metrics.m{i} DESC" for i in range(search.MAX_ORDER_KEYS + 1)]
    answer = api.get("/search", params={"order_by": keys})
    assert answer.status_code == 422, answer.text
    assert f"at most {search.MAX_ORDER_KEYS}" in answer.json()["detail"]


def test_too_long_an_in_list_is_a_422_naming_the_cap(api):
    values = ", ".join(f"'v{i}'" for i in range(search.MAX_IN_VALUES + 1))
    answer = api.get("/search", params={"filter": f"tags.split IN ({values})"})
    assert answer.status_code == 422, answer.text
    assert f"at most {search.MAX_IN_VALUES}" in answer.json()["detail"]


def _checkpoint(index: int, metrics: dict) -> CheckpointRecord:
    """A run page's checkpoint as the registry returns it (only what series read)."""
    fields = {name: None for name in CheckpointRecord.__dataclass_fields__}
    fields.update(
        report_index=index, reported_metrics=metrics, validated_metrics={}, metrics=metrics
    )
    return CheckpointRecord(**fields)


def test_the_run_pages_series_are_capped_and_the_rest_counted():
    metrics = {f"m{i:04d}": float(i) for i in range(1000)}
    checkpoints = [_checkpoint(i, metrics) for i in range(20)]

    names = data.metric_names(checkpoints)
    series = data.series_by_metric(checkpoints)

    assert names == sorted(metrics) and len(names) == 1000
    assert list(series) == names[: data.MAX_PLOTTED_METRICS]
    assert series["m0003"]["reported"] == [3.0] * 20


def test_the_run_page_says_how_many_metrics_it_leaves_unplotted(tmp_path):
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    populate(registry, tmp_path)
    page = data.run_json(registry, RUN, "/ui")
    registry.close()
    assert page["metrics_total"] == 2 and set(page["series"]) == {"acc", "step"}
