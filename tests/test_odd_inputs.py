"""The inputs round 3 found answered with a 500 or a traceback: each is a 422 (HTTP API,
SQLite and PostgreSQL) or one `error:` line and exit status 2 (CLI), and nothing is
stored. (A lone surrogate reaches the API only in a JSON body: a URL's percent-escapes
decode with replacement characters.)"""

from __future__ import annotations

import json
import uuid

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from tests.test_fuzz_inputs import RUN, populate
from validation_service.api import create_app
from validation_service.cli import main as ckval
from validation_service.config import Settings
from validation_service.registry.registry import Registry

SURROGATE = "acc\ud800"


@pytest.fixture
def api(registry, tmp_path):
    url = registry.engine.url.render_as_string(hide_password=False)
    config = Settings(database_url=url, namespace=f"odd-{uuid.uuid4().hex[:6]}", home=tmp_path)
    own = Registry(settings=config)
    populate(own, tmp_path)
    with TestClient(create_app(config, own), base_url="http://localhost") as client:
        yield client, own
    own.close()


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PUT", f"/runs/{RUN}/stop-policy", {"metric": "acc", "patience": 2**63}),
        ("PUT", f"/runs/{RUN}/stop-policy", {"metric": "acc", "median_of_runs": True,
                                             "warmup": 2**63}),
        ("PUT", f"/runs/{RUN}/stop-policy", {"metric": SURROGATE, "patience": 2}),
        ("PUT", f"/runs/{RUN}/checkpoints/0/tags/split", {"value": SURROGATE}),
        ("PUT", f"/runs/{RUN}/aliases/prod", {"track_metric": SURROGATE, "mode": "max"}),
    ],
    ids=["patience-2**63", "warmup-2**63", "stop-metric", "tag-value", "track-metric"],
)  # fmt: skip
def test_odd_inputs_are_a_422_and_store_nothing(api, method, path, body):
    client, registry = api
    # Sent as a real client sends it: JSON with the surrogate as a \ud800 escape.
    answer = client.request(
        method, path, content=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"] == "InvalidInput", answer.text
    assert registry.stop_policy(RUN) is None
    assert registry.checkpoints(RUN)[0].tags == {"split": "val"}


def test_a_job_id_beyond_the_id_column_is_a_404(api):
    client, _ = api
    for job_id in (2**31 - 1, 2**31, 2**63 - 1):
        answer = client.get(f"/jobs/{job_id}")
        assert answer.status_code == 404, (job_id, answer.text)


@pytest.fixture(scope="module")
def cli_url(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("odd-cli")
    registry = Registry(f"sqlite:///{root / 'registry.db'}")
    populate(registry, root)
    registry.close()
    return registry.url


BAD = "\udcff"  # a non-UTF-8 byte (0xff) as Python hands it over in sys.argv


@pytest.mark.parametrize(
    "args",
    [
        ["stop-policy", RUN, "--metric", "acc", "--patience", "99999999999999999999"],
        ["gc", RUN, "--metric", "acc", "--keep-best", "99999999999999999999", "--save", "--yes"],
        ["tag", RUN, "0", "split", f"v{BAD}"],
        ["tag", RUN, "0", f"k{BAD}", "v"],
        ["best", RUN, "--metric", f"acc{BAD}"],
        ["checkpoints", f"{RUN}{BAD}"],
        ["search", f"metrics.acc{BAD} > 0"],
        ["alias", RUN, f"a{BAD}", "0"],
        ["alias", RUN, "prod", "--track", "--metric", f"acc{BAD}"],
        ["jobs", "--pool", f"CPU{BAD}"],
        ["stop-policy", RUN, "--metric", f"acc{BAD}", "--patience", "2"],
    ],
    ids=["patience-huge", "gc-keep-best-huge", "tag-value", "tag-key", "best", "checkpoints",
         "search", "alias", "alias-track", "jobs-pool", "stop-policy-metric"],
)  # fmt: skip
def test_odd_cli_arguments_are_one_error_line_and_exit_2(cli_url, args):
    result = CliRunner().invoke(ckval, ["--database-url", cli_url, *args])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    registry = Registry(cli_url)
    assert registry.stop_policy(RUN) is None
    assert registry.checkpoints(RUN)[0].tags == {"split": "val"}
    registry.close()


def test_cli_names_the_argument_that_is_not_utf8(cli_url):
    result = CliRunner().invoke(ckval, ["--database-url", cli_url, "checkpoints", f"r{BAD}"])
    assert result.exit_code == 2
    assert r"'r\udcff'" in result.output and "UTF-8" in result.output, result.output
