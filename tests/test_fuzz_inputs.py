"""Property-based tests (Hypothesis): whatever the path and query parameters of an HTTP
request, or the integer arguments of a `ckval` command, the answer is a 2xx, 3xx or 4xx
(never a 500) and the command ends with exit status 0, 1 or 2 and no traceback. Text
includes lone surrogates (a JSON escape) and, for the CLI, bytes that are not UTF-8.

The registry is real (SQLite, and PostgreSQL for the API), with a run, checkpoints, an
alias and a tag for the parameters to hit. Examples are bounded so that the module runs
in about twenty seconds.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from validation_service.api import create_app
from validation_service.cli import main as ckval
from validation_service.config import Settings
from validation_service.registry.registry import Registry
from validation_service.storage import CheckpointStorage

RUN = "fuzzed"

# Numbers around every bound the columns and the API have, and any others.
BOUNDS = [0, 1, -1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 10**25]
numbers = st.one_of(st.sampled_from(BOUNDS), st.integers(), st.integers(-(2**80), 2**80))
# What a path or query parameter may carry: numbers, names, and any text at all
# (control characters, NUL, '/', '%', non-ASCII, very long).
texts = st.text(min_size=1, max_size=60)
# Lone surrogates: what a JSON body's "\ud800" escape decodes to, and what bytes that are
# not UTF-8 decode to in sys.argv (surrogateescape).
surrogates = st.sampled_from(["\ud800", "\udfff", "\udcff", "\udc80"])
odd_texts = st.one_of(
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=10), surrogates, st.text(max_size=10)),
    st.binary(min_size=1, max_size=20).map(lambda b: b.decode("utf-8", "surrogateescape")),
)
values = st.one_of(
    numbers.map(str), st.sampled_from([RUN, "best", "split", "acc", "a\x00b", "..", "%"]), texts
)
floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e25]))

# (method, path template, query parameters the route reads)
ROUTES = [
    ("GET", "/runs", []),
    ("GET", "/runs/{run}/checkpoints", []),
    ("GET", "/runs/{run}/best", ["metric", "mode", "k"]),
    ("GET", "/best", ["metric", "mode", "k"]),
    ("GET", "/runs/{run}/validations", []),
    ("GET", "/jobs/{job}", []),
    ("POST", "/jobs/{job}/cancel", []),
    ("POST", "/jobs/{job}/retry", []),
    ("POST", "/runs/{run}/cancel", []),
    ("POST", "/runs/{run}/retry", []),
    ("GET", "/runs/{run}/aliases", []),
    ("GET", "/runs/{run}/aliases/{alias}", []),
    ("PUT", "/runs/{run}/aliases/{alias}", []),
    ("DELETE", "/runs/{run}/aliases/{alias}", []),
    ("PUT", "/runs/{run}/checkpoints/{index}/tags/{key}", []),
    ("DELETE", "/runs/{run}/checkpoints/{index}/tags/{key}", []),
    ("GET", "/search", ["filter", "order_by", "k"]),
    (
        "GET",
        "/retention",
        ["metric", "run", "mode", "keep_best", "keep_best_per_run", "keep_latest"],
    ),
    ("GET", "/runs/{run}/status", []),
    ("GET", "/runs/{run}/attempts", []),
    ("POST", "/runs/{run}/finish", []),
    ("GET", "/ui/", ["page", "per_page", "metric", "mode"]),
    ("GET", "/ui/runs/{run}", []),
    ("GET", "/ui/compare", ["runs", "metric", "mode"]),
    ("GET", "/ui/api/runs", ["page", "per_page", "metric", "mode"]),
    ("GET", "/ui/api/runs/{run}", []),
    ("GET", "/ui/api/compare", ["runs", "metric", "mode"]),
    ("GET", "/ui/static/{name}", []),
    ("GET", "/metrics", []),
    ("GET", "/runs/{run}/stop-policy", []),
    ("PUT", "/runs/{run}/stop-policy", []),
    ("DELETE", "/runs/{run}/stop-policy", []),
    ("GET", "/runs/{run}/stop-decision", []),
    ("POST", "/runs/{run}/resume-despite-stop", []),
]


def populate(registry: Registry, root: Path) -> None:
    storage = CheckpointStorage(str(root / "storage"))
    run_id = registry.ledger.ensure_run(RUN, storage_root=storage.root_uri)
    for index, accuracy in enumerate([0.5, 0.75]):
        source = root / f"src-{index}"
        source.mkdir()
        (source / "model.txt").write_text(str(accuracy))
        stored = storage.upload(source, registry.namespace, RUN, index)
        registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=stored.uri,
            size_bytes=stored.size_bytes,
            manifest_sha256=stored.manifest_sha256,
            reported_metrics={"acc": accuracy, "step": index},
        )
    registry.set_alias(RUN, "best", 1)
    registry.tag(RUN, 0, "split", "val")


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def api(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    if request.param == "sqlite":
        url = f"sqlite:///{root / 'registry.db'}"
    else:
        url = request.getfixturevalue("postgres_server_url")
    # A namespace of its own: the PostgreSQL database lives for the whole session.
    config = Settings(database_url=url, namespace=f"fuzz-{uuid.uuid4().hex[:6]}", home=root)
    registry = Registry(settings=config, upgrade=True)
    populate(registry, root)
    with TestClient(
        create_app(config, registry), base_url="http://localhost", raise_server_exceptions=False
    ) as client:
        yield client
    registry.close()


@st.composite
def requests(draw):
    method, template, query_names = draw(st.sampled_from(ROUTES))
    path = template
    for name in ("run", "job", "alias", "index", "key", "name"):
        path = path.replace("{" + name + "}", quote(draw(values), safe=""))
    query = {name: draw(values) for name in query_names if draw(st.booleans())}
    body_texts = st.one_of(texts, odd_texts)
    body = draw(
        st.one_of(
            st.none(),
            st.fixed_dictionaries({"value": st.one_of(st.text(max_size=30), odd_texts)}),
            st.fixed_dictionaries({"report_index": st.one_of(numbers, floats, texts)}),
            st.fixed_dictionaries({"track_metric": body_texts, "mode": values}),
            st.fixed_dictionaries({"status": values}),
            st.fixed_dictionaries(
                {"metric": st.one_of(st.just("acc"), body_texts)},
                optional={
                    "mode": values,
                    "patience": numbers,
                    "warmup": numbers,
                    "median_of_runs": st.booleans(),
                    "threshold": floats,
                    "divergence": floats,
                    "min_delta": floats,
                },
            ),
        )
    )
    return method, path, query, body


@settings(
    max_examples=250,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(request=requests())
def test_no_path_or_query_parameter_gives_a_500(api, request):
    method, path, query, body = request
    # The body as a client sends it: JSON, with a lone surrogate as a \ud800 escape.
    answer = api.request(
        method,
        path,
        params=query,
        content=None if body is None else json.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    assert answer.status_code < 500, (method, path, query, body, answer.text[:500])


# ------------------------------------------------------------------ the CLI
@pytest.fixture(scope="module")
def cli_database(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("fuzz-cli")
    registry = Registry(f"sqlite:///{root / 'registry.db'}")
    populate(registry, root)
    registry.close()
    return registry.url


def commands(number: str) -> list[list[str]]:
    return [
        ["stop-policy", RUN, "--metric", "acc", "--patience", number],
        ["gc", RUN, "--metric", "acc", "--keep-best", number, "--save", "--yes"],
        ["tag", RUN, number, "split", "test"],
        ["tag", RUN, number, "split", "--delete"],
        ["alias", RUN, "best", number],
        ["job", number],
        ["cancel", number],
        ["retry", number],
        ["jobs", RUN, "--limit", number],
        ["best", RUN, "--metric", "acc", "-k", number],
        ["search", "metrics.acc > 0", "-k", number],
        ["gc", RUN, "--metric", "acc", "--keep-latest", number, "--dry-run"],
    ]


@settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(number=st.one_of(numbers.map(str), texts), which=st.integers(0, len(commands("0")) - 1))
def test_no_integer_argument_gives_a_traceback(cli_database, number, which):
    assert_no_traceback(["--database-url", cli_database, *commands(number)[which]])


def text_commands(text: str) -> list[list[str]]:
    """Commands added or extended since round 2, with a text argument in each place."""
    return [
        ["tag", RUN, "0", "split", text],
        ["tag", RUN, "0", text, "v"],
        ["best", RUN, "--metric", text],
        ["checkpoints", text],
        ["search", f"metrics.acc > 0 and tags.split = '{text}'"],
        ["search", text],
        ["alias", RUN, text, "0"],
        ["alias", RUN, "prod", "--track", "--metric", text],
        ["jobs", "--pool", text],
        ["stop-policy", RUN, "--metric", text, "--patience", "2"],
        ["stop-policy", text],
        ["run", text],
    ]


@settings(
    max_examples=80,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=st.one_of(texts, odd_texts), which=st.integers(0, len(text_commands("x")) - 1))
def test_no_text_argument_gives_a_traceback(cli_database, text, which):
    """Surrogates and non-UTF-8 bytes (as sys.argv hands them over) included: those are
    one `error:` line and exit status 2."""
    args = ["--database-url", cli_database, *text_commands(text)[which]]
    result = assert_no_traceback(args)
    if any(not _encodes(arg) for arg in args):
        assert result.exit_code == 2, (args, result.output)
        assert result.output.count("error:") == 1, (args, result.output)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def assert_no_traceback(args: list[str]):
    result = CliRunner().invoke(ckval, args)
    assert result.exit_code in (0, 1, 2), (args, result.output, result.exception)
    if result.exit_code == 0:
        assert result.exception is None, (args, result.exception)
    else:
        assert isinstance(result.exception, SystemExit), (args, result.exception)
    assert "Traceback" not in result.output, (args, result.output)
    return result
