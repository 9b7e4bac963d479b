"""Watched folders: every bad input refused with a clear error before anything is stored,
and `ckval watch`, `ckval watches`, `ckval unwatch` (through the service's own listing,
in this process: FolderWatcher)."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from tests.test_watch import SCORE_FN, step_folder
from validation_service.cli import main
from validation_service.config import Settings
from validation_service.errors import InvalidInput
from validation_service.registry.registry import Registry
from validation_service.service.watcher import FolderWatcher


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(
        home=tmp_path / "home",
        database_url=f"sqlite:///{tmp_path / 'registry.db'}",
        storage=str(tmp_path / "store"),
        watch_interval_s=0.001,
    )


@pytest.fixture
def reg(settings):
    opened = Registry(settings=settings)
    yield opened
    opened.close()


def nothing_stored(reg: Registry, run: str) -> bool:
    return reg.watches() == [] and reg.find_run_id(run) is None


@pytest.mark.parametrize(
    "where, expected",
    [
        ("missing", "there is no such folder"),
        ("a-file", "is a file"),
        ("nosuch://bucket/steps", "cannot be watched"),
        ("store", "is (or holds) ckval's storage root"),
        (".", "is (or holds) ckval's storage root"),
        ("store/other-team/their-run/steps", "in the folder of run 'their-run' of namespace"),
        ("store/other-team", "in the folder of namespace 'other-team'"),
    ],
)
def test_a_folder_that_cannot_be_watched_is_refused_naming_why(
    reg, tmp_path, unique_run, where, expected
):
    (tmp_path / "a-file").write_text("weights")
    (tmp_path / "store" / "other-team" / "their-run" / "steps").mkdir(parents=True)
    uri = where if "://" in where else str(tmp_path / where)
    with pytest.raises(InvalidInput) as refused:
        reg.watch(uri, unique_run, SCORE_FN)
    assert expected in str(refused.value) and "Nothing was registered" in str(refused.value)
    assert nothing_stored(reg, unique_run)


def test_two_watches_of_one_folder_into_one_run_are_refused(reg, tmp_path, unique_run):
    steps = tmp_path / "steps"
    steps.mkdir()
    first = reg.watch(str(steps), unique_run, SCORE_FN)
    with pytest.raises(InvalidInput, match=rf"watched into run .* already \(watch {first}\)"):
        reg.watch(str(steps) + "/", unique_run, SCORE_FN, validator="other")
    second = reg.watch(str(steps), f"{unique_run}-b", SCORE_FN)  # another run may
    assert [w.id for w in reg.watches()] == [first, second]


def test_a_pattern_matching_folders_without_a_step_is_refused(reg, tmp_path, unique_run):
    steps = tmp_path / "steps"
    step_folder(steps, "step-10", 0.1)
    (steps / "step-final").mkdir()
    with pytest.raises(InvalidInput, match=r"pattern 'step-\*' matches .*'step-final'"):
        reg.watch(str(steps), unique_run, SCORE_FN, pattern="step-*")
    assert nothing_stored(reg, unique_run)
    reg.watch(str(steps), unique_run, SCORE_FN, pattern="step-[0-9]*")


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"ready": "sometimes"}, "ready must be 'auto', 'marker:NAME'"),
        ({"ready": "stable:-3"}, "a settling time a positive number"),
        ({"ready": "marker:../outside"}, "a marker is a file name inside"),
        ({"pattern": "a/b"}, "pattern must be a glob"),
        ({"copy": "yes"}, "copy must be True or False"),
        ({"validator": "no spaces"}, "validator name"),
        ({"validate_config": [1]}, "validate_config must be a dict"),
        ({"validation_resources": {"num_gpus": -1}}, "num_gpus"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_stored(
    reg, tmp_path, unique_run, options, expected
):
    (tmp_path / "steps").mkdir()
    with pytest.raises(InvalidInput, match=expected.replace("(", r"\(").replace("*", r"\*")):
        reg.watch(str(tmp_path / "steps"), unique_run, SCORE_FN, **options)
    assert nothing_stored(reg, unique_run)


def test_a_validate_fn_that_does_not_import_and_an_unknown_watch(reg, tmp_path, unique_run):
    (tmp_path / "steps").mkdir()
    with pytest.raises(InvalidInput, match="nosuchmodule"):
        reg.watch(str(tmp_path / "steps"), unique_run, "nosuchmodule:fn")
    assert nothing_stored(reg, unique_run)
    with pytest.raises(InvalidInput, match="no live watch 7 in namespace 'default'"):
        reg.unwatch(7)


def test_a_step_folder_later_without_a_step_is_reported_not_registered(
    reg, settings, tmp_path, unique_run
):
    steps = tmp_path / "steps"
    steps.mkdir()
    reg.watch(str(steps), unique_run, SCORE_FN, pattern="ckpt*")
    step_folder(steps, "ckpt-best", 0.9)
    step_folder(steps, "ckpt-3", 0.3)
    FolderWatcher(reg.watch_listings, settings, "replica/1").tick()
    [record] = reg.watches()
    assert [c.step for c in reg.checkpoints(unique_run)] == [3]
    assert "'ckpt-best'" in record.last_error and "no integer" in record.last_error


def ckval(settings: Settings, *args: str):
    # No service reachable (nothing listens there): `watch` says so at once. Where this
    # process has joined the session's Ray already, the session's service (of another
    # registry) is not found either: this registry's has a name of its own.
    env = {
        "CKVAL_STORAGE": settings.storage,
        "CKVAL_HOME": str(settings.home),
        "CKVAL_RAY_ADDRESS": "127.0.0.1:1",
        "CKVAL_SERVICE_NAME": f"ckval-service-{settings.home.parent.name}",
    }
    return CliRunner().invoke(main, ["--database-url", settings.database_url, *args], env=env)


def test_watch_watches_and_unwatch_from_a_shell(reg, settings, tmp_path, unique_run):
    steps = tmp_path / "steps"
    step_folder(steps, "step-1", 0.1)
    step_folder(steps, "step-2", 0.2, marker=None)
    started = ckval(settings, "watch", str(steps), "--run", unique_run, "--validate-fn", SCORE_FN)
    assert started.exit_code == 0, started.output
    assert f"watch 1: the service lists {steps}" in started.output
    assert "no ckval service is running" in started.output
    FolderWatcher(reg.watch_listings, settings, "replica/1").tick()

    listed = ckval(settings, "watches")
    assert listed.exit_code == 0, listed.output
    assert "step-2 since" in listed.output and unique_run in listed.output
    as_json = json.loads(ckval(settings, "watches", unique_run, "--json").output)
    assert as_json[0]["registered"] == 1 and as_json[0]["waiting"][0]["name"] == "step-2"
    assert ckval(settings, "watches", "other-run").output.strip() == "no watches of run 'other-run'"

    twice = ckval(settings, "watch", str(steps), "--run", unique_run, "--validate-fn", SCORE_FN)
    assert twice.exit_code == 2 and "already (watch 1)" in twice.output
    neither = ckval(settings, "watch", str(steps), "--run", unique_run)
    assert neither.exit_code == 2 and "--validate-fn" in neither.output

    ended = ckval(settings, "unwatch", "1")
    assert ended.exit_code == 0 and "watch 1 ended" in ended.output
    assert ckval(settings, "unwatch", "1").exit_code == 2
    assert reg.watches() == []


def test_a_watch_from_a_shell_validates_on_the_resources_it_names(
    reg, settings, tmp_path, unique_run
):
    steps = tmp_path / "steps"
    step_folder(steps, "step-1", 0.1)
    resources = {"num_cpus": 0.5, "resources": {"eval_slot": 1}}
    started = ckval(
        settings,
        "watch",
        str(steps),
        "--run",
        unique_run,
        "--validate-fn",
        SCORE_FN,
        "--resources",
        json.dumps(resources),
    )
    assert started.exit_code == 0, started.output
    FolderWatcher(reg.watch_listings, settings, "replica/1").tick()
    [job] = reg.validations(unique_run)
    assert job.resources["num_cpus"] == 0.5 and job.resources["resources"] == {"eval_slot": 1}


@pytest.mark.parametrize(
    "given, expected",
    [
        ("{not json", "--resources is no JSON"),
        ("[1]", "--resources must be a JSON object"),
        ('{"num_gpus": -1}', "num_gpus"),
    ],
)
def test_a_watch_from_a_shell_with_bad_resources_is_refused(
    reg, settings, tmp_path, unique_run, given, expected
):
    (tmp_path / "steps").mkdir()
    refused = ckval(
        settings,
        "watch",
        str(tmp_path / "steps"),
        "--run",
        unique_run,
        "--validate-fn",
        SCORE_FN,
        "--resources",
        given,
    )
    assert refused.exit_code == 2 and expected in refused.output, refused.output
    assert nothing_stored(reg, unique_run)


def test_a_watch_from_a_shell_with_an_outside_program_validates_each_step_folder(
    reg, settings, tmp_path, unique_run
):
    from tests.inprocess_attempts import run_until_settled

    steps = tmp_path / "steps"
    step_folder(steps, "step-7", 0.7)
    program = (
        f"{sys.executable} -c \"import json, os, sys; json.dump({{'metrics': {{'files': "
        "len(os.listdir(sys.argv[1])), 'step_seen': int(sys.argv[3])}}, open(sys.argv[2], 'w'))\" "
        "{checkpoint_dir} {result_path} {step}"
    )
    started = ckval(settings, "watch", str(steps), "--run", unique_run, "--command", program)
    assert started.exit_code == 0, started.output
    FolderWatcher(reg.watch_listings, settings, "replica/1").tick()
    [job] = reg.validations(unique_run)
    done = run_until_settled(reg, settings, job.id)
    assert done.status == "SUCCEEDED", (done.error_message, done.error_traceback)
    [record] = reg.checkpoints(unique_run)
    # {step} is the report index (CommandValidator's contract); the folder's step is the
    # checkpoint's step and its metric "step".
    assert record.metrics["step_seen"] == record.report_index and record.metrics["files"] >= 1
    assert record.step == 7 and record.metrics["step"] == 7
