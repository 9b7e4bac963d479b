"""The front doors' public argument names: code outside this repository passes them by
name, so a rename is a break (shared/DESIGN.md, issue "Front doors")."""

from __future__ import annotations

import inspect

import pytest

import trainer_integration
from trainer_integration import CheckpointUploadMode

# The report options every callback takes, keyword-only, with report()'s defaults.
REPORT_OPTIONS = {
    "validate_fn": None,
    "validate_config": None,
    "validation_resources": None,
    "checkpoint_upload_mode": CheckpointUploadMode.SYNC,
    "max_attempts": 3,
    "timeout_s": None,
    "run": None,
}


def _callback(module: str):
    pytest.importorskip({"keras": "tensorflow"}.get(module, module))
    imported = __import__(f"trainer_integration.{module}", fromlist=["ReportCheckpointCallback"])
    return imported.ReportCheckpointCallback


@pytest.mark.parametrize("module", ["keras", "lightning", "transformers"])
def test_every_callback_takes_the_report_options_by_name(module):
    parameters = inspect.signature(_callback(module)).parameters
    for name, default in REPORT_OPTIONS.items():
        assert name in parameters, f"{module}.ReportCheckpointCallback lost {name}="
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert parameters[name].default == default, name


def test_the_keras_callback_keeps_rays_positional_arguments():
    names = list(inspect.signature(_callback("keras")).parameters)
    assert names[:3] == ["checkpoint_on", "report_metrics_on", "metrics"]


@pytest.mark.parametrize("module", ["lightning", "transformers"])
def test_the_torch_callbacks_poll_for_validated_metrics(module):
    parameters = inspect.signature(_callback(module)).parameters
    assert parameters["poll_interval_s"].default == 2.0


def test_report_and_client_report_take_the_same_options():
    report = inspect.signature(trainer_integration.report).parameters
    client = inspect.signature(trainer_integration.Client.report).parameters
    options = [name for name in report if name not in ("metrics", "checkpoint")]
    assert options == [name for name in client if name not in ("self", "metrics", "checkpoint")]
    assert {"validate_fn", "validate_config", "validation_resources"} <= set(options)
