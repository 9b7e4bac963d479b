"""Early stopping in the registry, on SQLite and PostgreSQL, driven as the scheduler drives
it (jobs registered by the ledger, claimed and finished through the job queue, so the
after-merge hook runs): a policy stored before the run's first report, each rule's
decision stored once, failed validations that never decide, checkpoints awaited in
report order, median stopping across runs, the override, the CLI and the HTTP API."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import uuid

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from tests.registry_world import VALIDATION, report
from validation_service import StopPolicy
from validation_service.api import create_app
from validation_service.cli import main
from validation_service.config import Settings
from validation_service.errors import InvalidInput
from validation_service.jobs import ValidationStatus
from validation_service.registry.records import ClaimedJob, JobOutcome
from validation_service.registry.registry import Registry
from validation_service.storage import CheckpointStorage

FAILED = "fail"
TIMED_OUT = "timeout"


@pytest.fixture
def storage(tmp_path) -> CheckpointStorage:
    return CheckpointStorage(str(tmp_path / "storage"))


class Scheduler:
    """Claims due jobs as the scheduler does and finishes those it is told to: a dict of
    metrics succeeds, FAILED fails for good, TIMED_OUT times out. Jobs claimed and not
    finished stay RUNNING under their lease, as validations still in flight."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self.claimed: dict[tuple[str, int], ClaimedJob] = {}

    def finish(self, run: str, outcomes: dict[int, dict | str]) -> None:
        for job in self.registry.job_queue.claim_due_jobs("test", {"CPU": 1000}, lease_s=600):
            self.claimed[(job.run, job.report_index)] = job
        for index, result in outcomes.items():
            job = self.claimed.pop((run, index))
            if isinstance(result, dict):
                outcome = JobOutcome(succeeded=True, metrics=result)
            else:
                outcome = JobOutcome(
                    succeeded=False,
                    error_type="RuntimeError",
                    error_message="the validation broke",
                    retryable=False,
                    timed_out=result == TIMED_OUT,
                )
            assert self.registry.job_queue.finish_job(job.job_id, job.lease_token, outcome)


def _report(registry, storage, tmp_path, run: str, count: int, steps=None) -> None:
    metrics = [{"step": steps[i]} if steps else {} for i in range(count)]
    report(registry, storage, run, metrics, validate=True, workdir=tmp_path)


def _accuracies(*values: float) -> dict[int, dict]:
    return {i: {"accuracy": value} for i, value in enumerate(values)}


def test_a_policy_set_before_the_first_report_stops_the_run_once(registry, storage, tmp_path):
    policy = StopPolicy("accuracy", patience=2, min_delta=0.01)
    assert registry.set_stop_policy("plateau", policy) == policy
    assert registry.stop_policy("plateau") == policy
    assert registry.stop_decision("plateau") is None  # no report yet
    _report(registry, storage, tmp_path, "plateau", 6)
    scheduler = Scheduler(registry)
    scheduler.finish("plateau", _accuracies(0.5, 0.6, 0.7, 0.705))
    assert registry.stop_decision("plateau") is None
    before = dt.datetime.now(dt.timezone.utc)
    scheduler.finish("plateau", {4: {"accuracy": 0.69, "loss": 1.0}})
    decision = registry.stop_decision("plateau")
    assert decision is not None and decision.stopped
    assert (decision.run, decision.attempt, decision.rule) == ("plateau", 1, "patience")
    assert decision.report_index == 4
    assert decision.values == ((2, 0.7), (3, 0.705), (4, 0.69))
    assert decision.reference == 0.7 and decision.policy == policy
    assert decision.decided_at >= before and decision.overridden_at is None
    assert "did not improve by more than 0.01 on 0.7 (report 2)" in decision.reason
    # a later result is merged; the first decision stays
    scheduler.finish("plateau", {5: {"accuracy": 0.95}})
    assert registry.checkpoints("plateau")[5].metrics["accuracy"] == 0.95
    assert registry.stop_decision("plateau") == decision


def test_failed_validations_never_decide_and_are_recorded(registry, storage, tmp_path):
    registry.set_stop_policy("broken", StopPolicy("accuracy", patience=1, divergence=2.0))
    _report(registry, storage, tmp_path, "broken", 4)
    scheduler = Scheduler(registry)
    scheduler.finish("broken", {0: FAILED, 1: TIMED_OUT, 2: FAILED, 3: FAILED})
    statuses = [c.validation_status for c in registry.checkpoints("broken")]
    assert statuses == ["FAILED", "TIMED_OUT", "FAILED", "FAILED"]
    assert registry.stop_decision("broken") is None
    _report(registry, storage, tmp_path, "broken", 3)
    scheduler.finish("broken", {4: {"accuracy": 0.8}, 5: FAILED, 6: {"accuracy": 0.7}})
    decision = registry.stop_decision("broken")
    assert decision is not None and (decision.rule, decision.report_index) == ("patience", 6)
    assert decision.skipped == (
        (0, "FAILED"),
        (1, "TIMED_OUT"),
        (2, "FAILED"),
        (3, "FAILED"),
        (5, "FAILED"),
    )


def test_a_validation_in_flight_holds_back_the_later_ones(registry, storage, tmp_path):
    registry.set_stop_policy("order", StopPolicy("accuracy", patience=1))
    _report(registry, storage, tmp_path, "order", 3)
    scheduler = Scheduler(registry)
    # report 1's validation stays RUNNING while 2's result comes in
    scheduler.finish("order", {0: {"accuracy": 0.9}, 2: {"accuracy": 0.1}})
    assert registry.checkpoints("order")[1].validation_status == ValidationStatus.RUNNING.value
    assert registry.stop_decision("order") is None
    scheduler.finish("order", {1: {"accuracy": 0.95}})
    decision = registry.stop_decision("order")
    assert decision is not None and decision.report_index == 2
    assert decision.values == ((1, 0.95), (2, 0.1))


def test_a_failed_validation_lets_the_waiting_ones_decide(registry, storage, tmp_path):
    registry.set_stop_policy("gap", StopPolicy("accuracy", threshold=0.9))
    _report(registry, storage, tmp_path, "gap", 2)
    scheduler = Scheduler(registry)
    scheduler.finish("gap", {1: {"accuracy": 0.97}})
    assert registry.stop_decision("gap") is None
    scheduler.finish("gap", {0: FAILED})
    decision = registry.stop_decision("gap")
    assert decision is not None and decision.rule == "threshold"
    assert decision.skipped == ((0, "FAILED"),) and decision.values == ((1, 0.97),)


def test_a_cancelled_or_lost_validation_lets_the_waiting_ones_decide(registry, storage, tmp_path):
    registry.set_stop_policy("cut", StopPolicy("accuracy", threshold=0.9))
    registry.set_stop_policy("lost", StopPolicy("accuracy", threshold=0.9))
    _report(registry, storage, tmp_path, "cut", 2)
    scheduler = Scheduler(registry)
    scheduler.finish("cut", {1: {"accuracy": 0.97}})
    registry.cancel_jobs(run="cut")
    decision = registry.stop_decision("cut")
    assert decision is not None and decision.skipped == ((0, "CANCELLED"),)
    # a lease that runs out on the last attempt ends the job FAILED
    request = dataclasses.replace(VALIDATION, max_attempts=1)
    run_id = registry.ledger.ensure_run("lost", storage_root=storage.root_uri)
    for index in range(2):
        registry.ledger.register_checkpoint(
            run_id, index, uri=f"{storage.root_uri}/lost/{index}", size_bytes=1,
            manifest_sha256=None, reported_metrics={}, job=request,
        )  # fmt: skip
    scheduler.finish("lost", {1: {"accuracy": 0.95}})
    assert registry.stop_decision("lost") is None
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    assert registry.job_queue.requeue_expired(later) == []
    assert registry.checkpoints("lost")[0].validation_status == ValidationStatus.FAILED.value
    decision = registry.stop_decision("lost")
    assert decision is not None and decision.report_index == 1
    assert decision.skipped == ((0, "FAILED"),)


def test_threshold_in_min_mode(registry, storage, tmp_path):
    registry.set_stop_policy("target", StopPolicy("loss", mode="min", threshold=0.25))
    _report(registry, storage, tmp_path, "target", 3)
    Scheduler(registry).finish("target", {i: {"loss": v} for i, v in enumerate((1, 0.3, 0.2))})
    decision = registry.stop_decision("target")
    assert decision is not None and (decision.rule, decision.report_index) == ("threshold", 2)
    assert decision.reference == 0.25 and "reached the target (<= 0.25)" in decision.reason


def test_divergence_on_nan_is_stored_with_the_nan(registry, storage, tmp_path):
    registry.set_stop_policy("nan", StopPolicy("loss", mode="min", divergence=3.0))
    _report(registry, storage, tmp_path, "nan", 3)
    scheduler = Scheduler(registry)
    scheduler.finish("nan", {0: {"loss": 2.0}, 1: {"loss": 1.0}, 2: {"loss": math.nan}})
    decision = registry.stop_decision("nan")
    assert decision is not None and decision.rule == "divergence"
    assert decision.report_index == 2 and math.isnan(decision.values[0][1])
    assert decision.reference == 1.0


def test_divergence_by_a_factor(registry, storage, tmp_path):
    registry.set_stop_policy("blowup", StopPolicy("loss", mode="min", divergence=3.0))
    _report(registry, storage, tmp_path, "blowup", 4)
    Scheduler(registry).finish("blowup", {i: {"loss": v} for i, v in enumerate((2, 1, 3, 3.5))})
    decision = registry.stop_decision("blowup")
    assert decision is not None and decision.report_index == 3
    assert decision.values == ((1, 1.0), (3, 3.5))


def test_median_stopping_across_three_runs(registry, storage, tmp_path):
    scheduler = Scheduler(registry)
    steps = [100, 200, 300, 400]
    for run, curve in (("first", (0.3, 0.5, 0.6, 0.7)), ("second", (0.4, 0.6, 0.7, 0.8))):
        _report(registry, storage, tmp_path, run, 4, steps)
        scheduler.finish(run, _accuracies(*curve))
    policy = StopPolicy("accuracy", median_of_runs=True, warmup=1)
    registry.set_stop_policy("third", policy)
    # steps that fall between the earlier runs' steps: each earlier run's last value at or
    # before the step counts (at 250: first 0.5, second 0.6 -> median 0.55)
    _report(registry, storage, tmp_path, "third", 3, [150, 250, 350])
    scheduler.finish("third", _accuracies(0.1, 0.56, 0.6))
    decision = registry.stop_decision("third")
    assert decision is not None and decision.rule == "median_of_runs"
    # 0.1 at 150 is in the warm-up; 0.56 at 250 beats 0.55; 0.6 at 350 is below 0.65
    assert decision.report_index == 2 and decision.reference == pytest.approx(0.65)
    assert "median 0.65 of 2 earlier run(s)" in decision.reason
    # the earlier runs had no policy: no decision of theirs
    assert registry.stop_decision("first") is None and registry.stop_policy("first") is None


def test_a_policy_set_on_a_run_with_results_judges_them_at_once(registry, storage, tmp_path):
    _report(registry, storage, tmp_path, "late", 3)
    Scheduler(registry).finish("late", _accuracies(0.5, 0.96, 0.4))
    assert registry.stop_decision("late") is None
    registry.set_stop_policy("late", StopPolicy("accuracy", threshold=0.95))
    decision = registry.stop_decision("late")
    assert decision is not None and decision.report_index == 1


def test_the_override_is_recorded_and_later_checkpoints_may_decide_again(
    registry, storage, tmp_path
):
    registry.set_stop_policy("stubborn", StopPolicy("accuracy", patience=1))
    _report(registry, storage, tmp_path, "stubborn", 2)
    scheduler = Scheduler(registry)
    scheduler.finish("stubborn", _accuracies(0.5, 0.4))
    stopped = registry.stop_decision("stubborn")
    assert stopped is not None and stopped.stopped and stopped.round == 0
    resumed = registry.resume_despite_stop("stubborn")
    assert not resumed.stopped and resumed.overridden_at >= stopped.decided_at
    assert resumed.resumed_after_index == 1
    assert registry.stop_decision("stubborn") == resumed
    with pytest.raises(InvalidInput, match="'stubborn' is not stopped"):
        registry.resume_despite_stop("stubborn")
    # the rules judge again from the checkpoints reported after the override
    _report(registry, storage, tmp_path, "stubborn", 2)
    scheduler.finish("stubborn", {2: {"accuracy": 0.45}})
    assert not registry.stop_decision("stubborn").stopped
    scheduler.finish("stubborn", {3: {"accuracy": 0.44}})
    again = registry.stop_decision("stubborn")
    assert again.stopped and again.round == 1 and again.values == ((2, 0.45), (3, 0.44))


def test_a_decision_is_stored_once(registry, storage, tmp_path):
    registry.set_stop_policy("once", StopPolicy("accuracy", threshold=0.5))
    _report(registry, storage, tmp_path, "once", 1)
    Scheduler(registry).finish("once", _accuracies(0.6))
    run_id = registry.find_run_id("once")
    first = registry.stop_decision("once")
    assert registry.stopping.evaluate(run_id) is None
    # as two finishers would: the unique (run, round) keeps the first
    with registry.db.write() as conn:
        from validation_service.registry.stopping import _insert_decision
        from validation_service.stopping import Verdict

        verdict = Verdict("threshold", 0, "again", ((0, 0.6),), 0.5)
        assert not _insert_decision(conn, run_id, 0, first.policy, verdict)
    assert registry.stop_decision("once") == first


def test_run_summaries_show_the_decision(registry, storage, tmp_path):
    registry.set_stop_policy("shown", StopPolicy("accuracy", threshold=0.5))
    _report(registry, storage, tmp_path, "shown", 1)
    _report(registry, storage, tmp_path, "plain", 1)
    Scheduler(registry).finish("shown", _accuracies(0.6))
    summaries = {s.run.name: s for s in registry.run_summaries()}
    assert summaries["shown"].stop == registry.stop_decision("shown")
    assert summaries["plain"].stop is None


def test_removing_a_policy_and_bad_input_write_nothing(registry):
    registry.set_stop_policy("gone", StopPolicy("accuracy", patience=3))
    assert registry.set_stop_policy("gone", None) is None
    assert registry.stop_policy("gone") is None
    with pytest.raises(InvalidInput, match="needs a validation_service.StopPolicy"):
        registry.set_stop_policy("bad", {"metric": "accuracy", "patience": 3})
    with pytest.raises(InvalidInput, match="run name"):
        registry.set_stop_policy("../escape", StopPolicy("accuracy", patience=3))
    assert registry.stop_policy("bad") is None
    with pytest.raises(InvalidInput, match="'never' is not stopped"):
        registry.ledger.ensure_run("never", storage_root="/tmp/never")
        registry.resume_despite_stop("never")


# ------------------------------------------------------------------- the CLI
def _ckval(registry: Registry, *args: str):
    result = CliRunner().invoke(main, ["--database-url", registry.url, *args])
    return result.exit_code, result.stdout, result.stderr


def test_the_cli_sets_shows_and_removes_a_policy(registry):
    code, out, _ = _ckval(
        registry, "stop-policy", "cli-run", "--metric", "val_loss", "--mode", "min",
        "--patience", "3", "--min-delta", "0.01", "--divergence", "4",
    )  # fmt: skip
    assert code == 0, out
    assert "stored the stop policy of cli-run" in out
    expected = StopPolicy("val_loss", mode="min", patience=3, min_delta=0.01, divergence=4.0)
    assert registry.stop_policy("cli-run") == expected
    code, out, _ = _ckval(registry, "stop-policy", "cli-run")
    assert code == 0 and out.strip() == f"cli-run: {expected.describe()}"
    code, out, _ = _ckval(registry, "stop-policy", "cli-run", "--json")
    assert code == 0 and json.loads(out)["patience"] == 3
    code, out, _ = _ckval(
        registry, "stop-policy", "median", "--metric", "acc", "--median-of-runs", "--warmup", "2"
    )
    assert code == 0 and registry.stop_policy("median").warmup == 2
    code, out, _ = _ckval(registry, "stop-policy", "cli-run", "--clear")
    assert code == 0 and registry.stop_policy("cli-run") is None
    code, out, _ = _ckval(registry, "stop-policy", "cli-run")
    assert out.strip() == "cli-run: no stop policy"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--metric", "acc"], "sets no rule: pass at least one of"),
        (["--metric", "acc", "--patience", "0"], "patience must be a whole number"),
        (["--metric", "acc", "--divergence", "0.5"], "divergence must be a finite factor > 1"),
        (["--metric", "acc", "--patience", "2", "--warmup", "3"], "applies only to median"),
        (["--metric", "acc", "--min-delta", "-1", "--patience", "2"], "min_delta must be >= 0"),
        (["--patience", "2"], "needs --metric, e.g. --metric accuracy"),
        (["--clear", "--metric", "acc"], "--clear takes no --metric"),
        (["--metric", "acc", "--mode", "best", "--patience", "2"], "'best' is not one of"),
        (["--metric", "acc", "--patience", "two"], "'two' is not a valid integer"),
    ],
)
def test_bad_cli_input_names_what_is_wrong_and_writes_nothing(registry, args, message):
    code, out, err = _ckval(registry, "stop-policy", "cli-bad", *args)
    assert code == 2 and message in out + err
    assert registry.stop_policy("cli-bad") is None


def test_ckval_run_and_runs_show_the_decision_and_the_override(registry, storage, tmp_path):
    registry.set_stop_policy("shown", StopPolicy("accuracy", patience=1))
    _report(registry, storage, tmp_path, "shown", 3)
    Scheduler(registry).finish("shown", {0: {"accuracy": 0.8}, 1: FAILED, 2: {"accuracy": 0.7}})
    code, out, _ = _ckval(registry, "run", "shown")
    assert code == 0, out
    assert "stop policy:  accuracy (max): patience 1" in out
    assert "stopped:      yes (patience at report 2" in out
    assert "passed over:  1 (FAILED)" in out
    code, out, _ = _ckval(registry, "runs")
    assert "patience at report 2" in out
    code, out, _ = _ckval(registry, "runs", "--json")
    (run,) = json.loads(out)
    assert run["stop_decision"]["rule"] == "patience" and run["stop_decision"]["stopped"]
    code, out, _ = _ckval(registry, "run", "shown", "--resume-despite-stop")
    assert code == 0 and "shown goes on despite its stop decision" in out
    assert "stopped:      no, overridden (patience at report 2" in out
    assert "judged again from report 3" in out
    assert registry.stop_decision("shown").overridden_at is not None
    code, out, err = _ckval(registry, "run", "shown", "--resume-despite-stop")
    assert code == 2 and "'shown' is not stopped" in err
    code, out, _ = _ckval(registry, "runs")
    assert "overridden (patience at report 2)" in out
    code, out, _ = _ckval(registry, "run", "shown", "--json")
    shown = json.loads(out)
    assert shown["stop_decision"]["stopped"] is False and shown["stop_policy"]["patience"] == 1
    code, out, err = _ckval(registry, "run", "nope")
    assert code == 2 and "nope" in err


# ------------------------------------------------------------------- the API
@pytest.fixture
def client(registry):
    settings = Settings(service_name=f"ckval-stop-test-{uuid.uuid4().hex[:8]}")
    with TestClient(create_app(settings, registry), base_url="http://127.0.0.1") as client:
        yield client


def test_the_api_sets_and_shows_the_policy_and_the_decision(client, registry, storage, tmp_path):
    body = {"metric": "accuracy", "threshold": 0.9}
    response = client.put("/runs/api-run/stop-policy", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["policy"]["threshold"] == 0.9
    assert registry.stop_policy("api-run") == StopPolicy("accuracy", threshold=0.9)
    response = client.get("/runs/api-run/stop-policy")
    assert response.json()["policy"]["description"] == "accuracy (max): threshold 0.9"
    assert client.get("/runs/api-run/stop-decision").json() == {"run": "api-run", "decision": None}
    _report(registry, storage, tmp_path, "api-run", 2)
    Scheduler(registry).finish("api-run", _accuracies(0.5, 0.91))
    decision = client.get("/runs/api-run/stop-decision").json()["decision"]
    assert decision["rule"] == "threshold" and decision["report_index"] == 1
    assert decision["values"] == [{"report_index": 1, "value": 0.91}]
    assert decision["stopped"] is True and decision["policy"]["threshold"] == 0.9
    response = client.post("/runs/api-run/resume-despite-stop")
    assert response.status_code == 200 and response.json()["decision"]["stopped"] is False
    response = client.post("/runs/api-run/resume-despite-stop")
    assert response.status_code == 422 and "not stopped" in response.json()["detail"]
    assert client.delete("/runs/api-run/stop-policy").json() == {"run": "api-run", "policy": None}
    assert registry.stop_policy("api-run") is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"patience": 3}, "needs metric"),
        ({"metric": "acc", "patient": 3}, "unknown stop policy field(s) patient"),
        ({"metric": "acc"}, "sets no rule"),
        ({"metric": "acc", "mode": "up", "patience": 2}, "mode must be 'max'"),
        ({"metric": "acc", "threshold": "high"}, "threshold must be a finite number"),
        ({"metric": "acc", "patience": 1.5}, "patience must be a whole number"),
        ([1, 2], "a stop policy is a JSON object"),
    ],
)
def test_bad_api_input_is_a_422_naming_it_and_writes_nothing(client, registry, body, message):
    response = client.put("/runs/api-bad/stop-policy", json=body)
    assert response.status_code == 422, response.text
    assert message in response.json()["detail"]
    assert registry.stop_policy("api-bad") is None


def test_the_api_refuses_a_bad_run_name(client, registry):
    response = client.put("/runs/.hidden/stop-policy", json={"metric": "a", "patience": 1})
    assert response.status_code == 422
    assert "run name '.hidden' is not allowed" in response.json()["detail"]
    assert registry.stop_policy("hidden") is None


def test_the_policy_of_a_name_applies_to_each_attempt_with_its_own_decision(
    registry, storage, tmp_path
):
    registry.set_stop_policy("again", StopPolicy("accuracy", threshold=0.9))
    _report(registry, storage, tmp_path, "again", 1)
    scheduler = Scheduler(registry)
    scheduler.finish("again", _accuracies(0.95))
    assert registry.stop_decision("again").attempt == 1
    registry.ledger.finish_run("again", "FINISHED")
    _report(registry, storage, tmp_path, "again", 2)  # attempt 2, its indices from 0
    assert registry.stop_decision("again") is None  # the new attempt has not decided
    scheduler.finish("again", {0: {"accuracy": 0.5}, 1: {"accuracy": 0.92}})
    decision = registry.stop_decision("again")
    assert (decision.attempt, decision.report_index, decision.round) == (2, 1, 0)
