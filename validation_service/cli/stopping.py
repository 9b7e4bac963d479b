"""`ckval stop-policy` (set, show or remove a run's early-stopping policy) and `ckval run`
(one run: its attempt, its policy and its stop decision, and the override
``--resume-despite-stop``). The CLI registers ``COMMANDS`` with ``main.add_command``.

Imports stay light (no Ray, no SQLAlchemy until a command runs): the CLI starts fast.
"""

from __future__ import annotations

from typing import Any

import click

from validation_service.cli._format import echo
from validation_service.cli.common import echo_json, json_option, registry_of
from validation_service.cli.registry import errors_reported

# StopPolicy's rules as options (a type of None: a flag); one left out keeps its default.
_RULE_OPTIONS = (
    ("--mode", click.Choice(["max", "min"]), "max (higher is better, the default) or min."),
    ("--patience", int, "Stop after N validated checkpoints without improvement."),
    ("--min-delta", float, "With --patience: the least improvement that counts [0]."),
    ("--threshold", float, "Stop once the metric reaches this value."),
    ("--divergence", float, "Stop on NaN/inf, or a value F times worse than the best."),
    ("--median-of-runs", None, "Stop when worse than the median of earlier runs."),
    ("--warmup", int, "With --median-of-runs: validated reports not judged first."),
)


def _rule_options(command):
    """``command`` with an option per rule of ``_RULE_OPTIONS``."""
    for name, kind, text in reversed(_RULE_OPTIONS):
        flag = {"is_flag": True} if kind is None else {"type": kind}
        command = click.option(name, default=None, help=text, **flag)(command)
    return command


@click.command("stop-policy")
@click.argument("run")
@click.option("--metric", default=None, help="The validated metric the policy watches.")
@_rule_options
@click.option("--clear", is_flag=True, help="Remove RUN's policy.")
@json_option
@click.pass_context
@errors_reported
def stop_policy_command(
    ctx: click.Context, run: str, metric: str | None, clear: bool, as_json: bool, **rules: Any
) -> None:
    """Set RUN's early-stopping policy (RUN may not have reported yet: the policy waits for
    it), remove it (--clear), or show it (RUN alone). The service judges it after each
    validated result; `ckval run RUN` shows the decision."""
    from validation_service.api.views import stop_policy_json
    from validation_service.stopping import StopPolicy

    given = {name: value for name, value in rules.items() if value is not None}
    registry = registry_of(ctx)
    if clear:
        if metric is not None or given:
            raise click.UsageError("--clear takes no --metric or rule options")
        registry.set_stop_policy(run, None)
        echo(f"removed the stop policy of {run}", err=as_json)
        policy = None
    elif metric is None:
        if given:
            raise click.UsageError(
                "setting a stop policy needs --metric, e.g. --metric accuracy --patience 3"
            )
        policy = registry.stop_policy(run)
    else:
        policy = registry.set_stop_policy(run, StopPolicy(metric, **given))
        echo(f"stored the stop policy of {run}", err=as_json)
    if as_json:
        echo_json(stop_policy_json(policy))
    elif not clear:
        echo(f"{run}: " + (policy.describe() if policy else "no stop policy"))


@click.command("run")
@click.argument("run")
@click.option(
    "--resume-despite-stop",
    "resume",
    is_flag=True,
    help="Override RUN's stop decision (recorded); the policy judges later results again.",
)
@json_option
@click.pass_context
@errors_reported
def run_command(ctx: click.Context, run: str, resume: bool, as_json: bool) -> None:
    """Show RUN's latest attempt, its stop policy and its stop decision."""
    from validation_service.api.views import iso, stop_decision_json, stop_policy_json

    registry = registry_of(ctx)
    if resume:
        registry.resume_despite_stop(run)
        echo(f"{run} goes on despite its stop decision (recorded)", err=as_json)
    attempts = registry.run_attempts(run)
    latest = attempts[-1]
    policy, decision = registry.stop_policy(run), registry.stop_decision(run)
    if as_json:
        echo_json(
            {
                "run": run,
                "attempt": latest.attempt,
                "attempts": len(attempts),
                "status": latest.status,
                "created_at": iso(latest.created_at),
                "ended_at": iso(latest.ended_at),
                "stop_policy": stop_policy_json(policy),
                "stop_decision": stop_decision_json(decision),
            }
        )
        return
    echo(f"run:          {run} (attempt {latest.attempt} of {len(attempts)}, {latest.status})")
    echo(f"stop policy:  {policy.describe() if policy else 'none'}")
    for line in _decision_lines(decision):
        echo(line)


def _decision_lines(decision) -> list[str]:
    if decision is None:
        return ["stopped:      no"]
    when = decision.decided_at.isoformat(timespec="seconds")
    lines = [
        f"stopped:      {'yes' if decision.stopped else 'no, overridden'} "
        f"({decision.rule} at report {decision.report_index}, {when})",
        f"reason:       {decision.reason}",
    ]
    if decision.overridden_at is not None:
        lines.append(
            f"overridden:   {decision.overridden_at.isoformat(timespec='seconds')}; "
            f"judged again from report {decision.resumed_after_index + 1}"
        )
    if decision.skipped:
        passed = ", ".join(f"{index} ({why})" for index, why in decision.skipped)
        lines.append(f"passed over:  {passed}")
    return lines


COMMANDS: list[click.Command] = [stop_policy_command, run_command]
