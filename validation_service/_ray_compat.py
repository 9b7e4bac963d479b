"""Every name ckval takes from Ray's undocumented modules, in one place, with what ckval
does on a Ray release that lacks it.

ckval supports Ray 2.51 to 2.60; everything else it calls is Ray's public API (report()
hands Ray Train each report through ``ray.train.report`` itself, on the training
thread). The names in ``INTERNALS`` were read in the wheels of 2.51.0, 2.52.1, 2.53.0,
2.54.0, 2.55.1, 2.56.1, 2.57.0 and 2.60.0 (DataConfig's in 2.51.2, 2.52.1, 2.53.0,
2.54.1, 2.55.1, 2.56.1, 2.57.1 and 2.60.0). ``tests/test_ray_compat.py`` checks each one
against the installed Ray, so that an incompatible release fails one clear test rather
than a training run.

The resource by which Ray marks its head node (``HEAD_NODE_RESOURCE``, which the
service's first replica asks for) is here too, and so are the public names that differ
between releases (``PUBLIC_DIFFERENCES``), each with the spelling ckval uses where it is
missing; ckval picks by what the installed Ray has, never by its version number.

``CKVAL_RAY_INTERNALS=0`` in the environment (the driver's reaches Ray workers) turns
the workers' internals off, so that the public fallbacks run: for a Ray release where an
internal behaves differently than its name promises.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import os
import re
import time
from collections.abc import Callable
from typing import Any

INTERNALS_VAR = "CKVAL_RAY_INTERNALS"

_CONTEXT = "ray.train.v2._internal.execution.context"
_CALLBACK = "ray.train.v2._internal.execution.callback"


@dataclasses.dataclass(frozen=True)
class Internal:
    """One undocumented Ray name ckval uses: where it is, which releases have it, and
    what ckval does where it is missing."""

    module: str
    name: str  # an attribute path inside the module
    releases: str
    missing: str
    # Attribute paths that older releases have instead of ``name``: one of them suffices.
    instead: tuple[str, ...] = ()
    # The first release that has it: older ones do without it (``missing``), unchecked.
    since: tuple[int, int] = (2, 51)


INTERNALS = (
    Internal(
        _CONTEXT,
        "get_train_context",
        "2.51-2.60",
        "the public ray.train.get_context() finds the worker's context (importing Ray Tune)",
    ),
    Internal(
        _CONTEXT,
        "TrainContext.get_checkpoint",
        "2.51-2.60",
        "a restarted worker's ray.train.get_checkpoint gives the model files only when "
        "called as ray.train.get_checkpoint() (the public function is wrapped instead)",
    ),
    Internal(
        _CONTEXT,
        "TrainContext.train_run_context",
        "2.51-2.60 (its run_config.checkpoint_config)",
        "CheckpointConfig(num_to_keep=...) is not applied to ckval's copies: set a "
        "retention policy (Registry.set_retention) instead",
    ),
    Internal(
        _CALLBACK,
        "ControllerCallback.after_controller_finish",
        "2.51-2.60 (with after_controller_start, after_controller_state_update)",
        "RunStatusCallback cannot be made; the error names the missing name",
    ),
    Internal(
        _CALLBACK,
        "ControllerCallback.before_controller_abort",
        "2.55-2.60",
        "an abort is seen through after_controller_state_update (ABORTED)",
        since=(2, 55),
    ),
    Internal(
        "ray.train.v2._internal.execution.controller.state",
        "AbortedState",
        "2.51-2.60",
        "an aborted run stays RUNNING (`ckval run R --status failed` ends it)",
    ),
    Internal(
        "ray.train",
        "DataConfig._resolve_execution_options",
        "2.57-2.60; 2.53-2.56 have DataConfig._get_execution_options, 2.51-2.52 "
        "DataConfig._execution_options (set next to DataConfig.set_train_total_resources)",
        "ExactSplitDataConfig cannot set its datasets' execution options: its runs fail",
        instead=("DataConfig._get_execution_options", "DataConfig.set_train_total_resources"),
    ),
    Internal(
        _CALLBACK,
        "ReportCallback.after_report",
        "2.58-2.60 read: after_report(training_report, metrics), with training_report.checkpoint",
        "trainer_integration.tune.TuneReportCallback cannot be made; the error names it",
    ),
    Internal(
        "ray.tune.impl.tuner_internal",
        "_TUNER_PKL",
        "2.58-2.60 read: the Tuner's pickled state (its TuneConfig as _tune_config) in "
        "the experiment's folder",
        "TuneReportCallback does not know the metrics Tune checks: it forwards results "
        "without them, as Ray's callback does",
    ),
    Internal(
        "ray._private.services",
        "canonicalize_bootstrap_address",
        "2.51-2.60",
        "commands that look for a running cluster need CKVAL_RAY_ADDRESS or RAY_ADDRESS",
    ),
    Internal(
        "ray._private.state",
        "GlobalState.get_cluster_config",
        "2.51-2.60",
        "node types come from CKVAL_NODE_TYPES or the launcher's config only",
    ),
    Internal(
        "ray.autoscaler.v2.utils",
        "is_autoscaler_v2",
        "2.51-2.60",
        "an autoscaler v2 without known node types is not recognised: where no node "
        "offers what a job asks, it waits (at most CKVAL_RESOURCE_WAIT_S)",
    ),
    Internal(
        "ray.experimental.internal_kv",
        "_internal_kv_get",
        "2.51-2.60 (with ray._private.ray_constants.DEBUG_AUTOSCALING_STATUS, the v1 "
        "monitor's status, whose node types are node_<node id> on a cluster without "
        "an autoscaler)",
        "a cluster without an autoscaler is not recognised: where no node offers what a "
        "job asks, it waits (at most CKVAL_RESOURCE_WAIT_S) instead of failing at once",
    ),
    Internal("ray._private.ray_constants", "DEBUG_AUTOSCALING_STATUS", "2.51-2.60", "the same"),
)


def internals_enabled() -> bool:
    """False when CKVAL_RAY_INTERNALS=0 (or false/off/no) asks for the public fallbacks."""
    return os.environ.get(INTERNALS_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def worker_train_context() -> Any | None:
    """This Ray Train worker's train context (``get_world_rank()``,
    ``get_experiment_name()``), or None outside one (and in Ray Train's local mode).

    Found without ``ray.train.get_context()``, whose worker check imports Ray Tune (a
    tenth of a second or more) on first use: for what runs as ckval is imported. With the
    internals turned off, the public call.
    """
    try:
        if internals_enabled():
            from ray.train.v2._internal.execution.context import get_train_context

            return get_train_context()
        import ray.train

        return ray.train.get_context()
    except Exception:  # noqa: BLE001 - not in a Ray Train worker, or another Ray version
        return None


def follow_resume_checkpoint(follow: Callable[[Any], Any]) -> None:
    """Makes this Ray Train worker's ``ray.train.get_checkpoint()`` return
    ``follow(checkpoint)`` of the checkpoint Ray Train holds (a later call replaces the
    follow): on the worker's train context, whatever name the training code imported
    ``get_checkpoint`` by, or, with the internals turned off or different, on the public
    ``ray.train.get_checkpoint``."""
    context = worker_train_context() if internals_enabled() else None
    if context is not None and callable(getattr(context, "get_checkpoint", None)):
        context.get_checkpoint = _following(context.get_checkpoint, follow)
        return
    import ray.train

    ray.train.get_checkpoint = _following(ray.train.get_checkpoint, follow)


def _following(held: Callable[[], Any], follow: Callable[[Any], Any]) -> Callable[[], Any]:
    original = getattr(held, "original", held)

    def get_checkpoint():
        return follow(original())

    get_checkpoint.original = original
    get_checkpoint.__doc__ = original.__doc__
    return get_checkpoint


CONTROLLER_CALLBACK_HOOKS = (
    "after_controller_start",
    "after_controller_finish",
    "after_controller_state_update",
)


def run_checkpoint_config() -> Any | None:
    """This Ray Train worker's ``RunConfig(checkpoint_config=...)``, or None where it
    cannot be read (the internals turned off, another Ray)."""
    context = worker_train_context() if internals_enabled() else None
    try:
        return context.train_run_context.run_config.checkpoint_config
    except AttributeError:
        return None


def controller_callback_base() -> type:
    """Ray Train's ControllerCallback, whose hooks the controller calls on the driver's
    node. Raises ImportError naming what is missing where this Ray lacks it."""
    try:
        from ray.train.v2._internal.execution.callback import ControllerCallback
    except ImportError as exc:
        raise ImportError(
            "trainer_integration.RunStatusCallback needs Ray Train's ControllerCallback "
            f"({_CALLBACK}), which this Ray lacks ({exc}). "
            "Use Ray 2.51 to 2.60, or end runs with `ckval run R --status finished`."
        ) from None
    missing = [hook for hook in CONTROLLER_CALLBACK_HOOKS if not hasattr(ControllerCallback, hook)]
    if missing:
        raise ImportError(
            f"Ray Train's ControllerCallback lacks {', '.join(missing)} in this Ray: "
            "trainer_integration.RunStatusCallback needs Ray 2.51 to 2.60."
        )
    return ControllerCallback


TUNE_CALLBACK_HOOKS = ("after_controller_start", "after_controller_finish", "after_report")


def tune_callback_bases() -> tuple[type, ...]:
    """Ray Train's ControllerCallback and ReportCallback: a callback given to
    ``RunConfig(callbacks=...)`` that is both sees each report on the controller
    (``after_report(training_report, metrics)``) and the end of the run, before ``fit()``
    returns (``after_controller_finish``). A ``UserCallback`` sees the reports only.
    Raises ImportError naming what is missing where this Ray lacks them."""
    try:
        from ray.train.v2._internal.execution.callback import ControllerCallback, ReportCallback
    except ImportError as exc:
        raise ImportError(
            "trainer_integration.tune.TuneReportCallback needs Ray Train's ControllerCallback "
            f"and ReportCallback ({_CALLBACK}), which this Ray lacks ({exc}). Use Ray 2.58 to "
            "2.60, or Ray's own ray.tune.integration.ray_train.TuneReportCallback."
        ) from None
    bases = (ControllerCallback, ReportCallback)
    missing = [hook for hook in TUNE_CALLBACK_HOOKS if not any(hasattr(b, hook) for b in bases)]
    if missing:
        raise ImportError(
            f"Ray Train's callbacks lack {', '.join(missing)} in this Ray: "
            "trainer_integration.tune.TuneReportCallback needs Ray 2.58 to 2.60."
        )
    return bases


def tune_checked_metrics(storage: Any) -> tuple[str, ...] | None:
    """The metrics Tune's strict metric check asks of every result of this experiment
    (TuneConfig's ``metric``, its scheduler's and its search algorithm's), read from the
    Tuner's state that Tune stores in the experiment's folder (``storage``: the trial's
    ``ray.tune.get_context().get_storage()``). None where it cannot be read."""
    try:
        import ray.cloudpickle
        from ray.tune.impl.tuner_internal import _TUNER_PKL

        path = f"{storage.experiment_fs_path}/{_TUNER_PKL}"
        with storage.storage_filesystem.open_input_file(path) as f:
            state = ray.cloudpickle.loads(f.readall())
        config = state["_tune_config"]
    except Exception:  # noqa: BLE001 - another Ray version, a Tuner restored elsewhere
        return None
    checked: list[str] = []
    for owner in (config, config.scheduler, config.search_alg):
        metric = getattr(owner, "metric", None) if owner is not None else None
        names = [metric] if isinstance(metric, str) else list(metric or ())
        checked += [name for name in names if isinstance(name, str) and name not in checked]
    # "_metric" is Tune's placeholder (DEFAULT_METRIC) for "not set": Tune skips it too.
    return tuple(name for name in checked if name != "_metric")


def wait_tune_queue_drained(callback: Any, timeout_s: float, settle_s: float = 0.5) -> bool:
    """Waits until the trial has taken every result that Ray's TuneReportCallback
    (``callback``) put on its queue to Tune (``_training_actor_item_queue``, a
    ``ray.util.queue.Queue`` of one item), then ``settle_s`` more for the trial's main
    thread to hand the last one on. A result still queued when the trial's function
    returns meets Tune's own last result there, and the trial hangs (Ray Tune's
    ``_TrainSession.get_next`` puts it on a full result queue). Returns whether the queue
    drained within ``timeout_s``; True where this Ray keeps no such queue."""
    queue = getattr(callback, "_training_actor_item_queue", None)
    if queue is None or not hasattr(queue, "empty"):
        return True
    deadline = time.monotonic() + timeout_s
    pause = 0.01
    while True:
        try:
            empty = queue.empty()
        except Exception:  # noqa: BLE001 - the trial (and its queue's actor) is gone
            return True
        if empty:
            time.sleep(settle_s)
            return True
        if time.monotonic() + pause > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def is_aborted_state(state: Any) -> bool:
    """Whether a Ray Train controller state (after_controller_state_update) is ABORTED."""
    try:
        from ray.train.v2._internal.execution.controller.state import AbortedState
    except ImportError:  # another Ray version: not recognised
        return False
    return isinstance(state, AbortedState)


def bootstrap_address() -> str | None:
    """The address ``ray.init(address="auto")`` would connect to, found without
    connecting; None where there is none (or this Ray cannot say)."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:
        return None
    try:
        return canonicalize_bootstrap_address("auto")
    except ConnectionError:
        return None


def autoscaler_node_types() -> list[tuple[str, dict[str, float], int]] | None:
    """The node types of the cluster config an autoscaler reported to the GCS, as
    (name, resources, max count; -1: no cap); None where none was reported (Ray's own v1
    and v2 autoscalers report none in 2.51-2.60; platforms that run one may)."""
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # noqa: BLE001 - another Ray version, or no GCS to ask
        return None
    if config is None or not config.node_group_configs:
        return None
    return [
        (group.name, dict(group.resources), int(group.max_count))
        for group in config.node_group_configs
    ]


# The node type names the v1 monitor gives the nodes of a cluster it only mirrors (no
# autoscaling config): "node_" and the node's id (format_readonly_node_type).
_MIRRORED_NODE_TYPE = re.compile(r"^node_[0-9a-f]{56}$")


def autoscaler_kind() -> str | None:
    """Which autoscaler the connected cluster runs: "v2", "v1", or "none" where Ray's
    monitor only mirrors the cluster's nodes (a cluster of fixed nodes: ``ray.init()``,
    ``ray start`` without an autoscaling config); None where this cannot be told yet."""
    try:
        from ray.autoscaler.v2.utils import is_autoscaler_v2

        if is_autoscaler_v2(fetch_from_server=True):
            return "v2"
    except Exception:  # noqa: BLE001 - then v1's status tells
        pass
    try:
        from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
        report = json.loads(raw).get("autoscaler_report") if raw else None
    except Exception:  # noqa: BLE001 - no status to read
        return None
    if not report:
        return None  # the monitor has not looked at the nodes yet
    names = {
        *(report.get("active_nodes") or {}),
        *(report.get("pending_launches") or {}),
        *(report.get("node_type_mapping") or {}).values(),
    }
    if not names:
        return None
    return "none" if all(_MIRRORED_NODE_TYPE.match(name) for name in names) else "v1"


# Ray gives its head node one unit of this resource for Ray's own use (2.51-2.60 alike);
# an actor that asks for a sliver of it can run on the head node only.
HEAD_NODE_RESOURCE = "node:__internal_head__"


def head_node_resources() -> dict[str, float]:
    """Actor ``resources`` that pin the actor to the head node of the cluster."""
    return {HEAD_NODE_RESOURCE: 0.001}


def missing_internals() -> list[Internal]:
    """The names of INTERNALS that the installed Ray lacks (for the contract test and
    ``ckval doctor``-style checks): a class attribute counts when it is a dataclass
    field (annotated) or defined on the class."""
    import importlib

    import ray

    release = tuple(int(part) for part in ray.__version__.split(".")[:2])
    missing = []
    for internal in INTERNALS:
        if release < internal.since:
            continue
        try:
            module = importlib.import_module(internal.module)
        except ImportError:
            missing.append(internal)
            continue
        if not any(_has_path(module, path) for path in (internal.name, *internal.instead)):
            missing.append(internal)
    return missing


def _has_path(target: Any, path: str) -> bool:
    """Whether the attribute path (``Class.attribute``) exists below ``target``."""
    for part in path.split("."):
        annotations = {}
        if isinstance(target, type):
            for klass in target.__mro__:
                annotations.update(getattr(klass, "__annotations__", {}))
        if hasattr(target, part):
            target = getattr(target, part)
        elif part in annotations:
            return True  # a field of each instance: present, nothing more to walk
        else:
            return False
    return True


def data_execution_options(config: Any, dataset_name: str) -> Any:
    """The Ray Data execution options that this Ray's ``DataConfig.configure`` gives the
    dataset ``dataset_name`` (a copy, which the caller may change): for a DataConfig
    subclass that splits datasets its own way."""
    if hasattr(config, "_resolve_execution_options"):  # 2.57-2.60
        return config._resolve_execution_options(dataset_name)
    if hasattr(config, "_get_execution_options"):  # 2.53-2.56: one per dataset
        options = config._get_execution_options(dataset_name)
    else:  # 2.51-2.52: one for all datasets
        options = copy.deepcopy(config._execution_options)
    # As those releases' configure: Ray Data keeps off the CPUs and GPUs training holds,
    # unless the user set limits or (2.56) the scaling policy reserves them already.
    reserved = getattr(config, "_scaling_policy_reserves_train_resources", lambda: False)
    if options.is_resource_limits_default() and not reserved():
        from ray.data import ExecutionResources

        options.exclude_resources = options.exclude_resources.add(
            ExecutionResources(cpu=config._num_train_cpus, gpu=config._num_train_gpus)
        )
    return options


@dataclasses.dataclass(frozen=True)
class PublicDifference:
    """A public Ray name that only some supported releases have."""

    name: str
    releases: str
    elsewhere: str  # what ckval does on the other releases


PUBLIC_DIFFERENCES = (
    PublicDifference(
        "ray.train.report(validation=...) with TorchTrainer(validation_config="
        "ray.train.ValidationConfig(...)), and ray.train.ValidationTaskConfig",
        "2.54-2.60",
        "2.51-2.53 take ray.train.report(validate_fn=fn, validate_config=dict), with "
        "fn(checkpoint, config): native_validation() spells Ray's own validation either way",
    ),
    PublicDifference(
        "ray.train.Result.return_value (what the train function returned on rank 0)",
        "2.56-2.60",
        "TorchTrainerValidator's eval loop writes its rank 0 return value next to the "
        "run's files itself, and the validator reads it from there",
    ),
    PublicDifference(
        "ray.train.LoggingConfig and RunConfig(logging_config=...)",
        "2.56-2.60",
        "logging_config_kwargs() gives nothing: Ray Train logs at its default level",
    ),
)


def report_takes_validation() -> bool:
    """Whether ``ray.train.report`` takes ``validation=`` (2.54+) rather than
    ``validate_fn=``/``validate_config=`` (2.51-2.53)."""
    import ray.train

    return "validation" in inspect.signature(ray.train.report).parameters


@dataclasses.dataclass(frozen=True)
class NativeValidation:
    """Ray Train's own checkpoint validation, in this Ray's spelling."""

    trainer_kwargs: dict[str, Any]  # for the trainer (TorchTrainer(..., **trainer_kwargs))
    report_kwargs: dict[str, Any]  # for each ray.train.report(..., **report_kwargs)


@dataclasses.dataclass(frozen=True)
class _KeywordsFromConfig:
    """Ray 2.51-2.53 call a validate_fn as fn(checkpoint, config); 2.54+ call
    fn(checkpoint, **fn_kwargs). This calls the second kind the first way."""

    fn: Callable[..., dict]

    def __call__(self, checkpoint: Any, config: dict | None) -> dict:
        return self.fn(checkpoint, **(config or {}))


def native_validation(
    fn: Callable[..., dict], fn_kwargs: dict[str, Any], ray_remote_kwargs: dict | None = None
) -> NativeValidation:
    """Ray Train validating each reported checkpoint with ``fn(checkpoint, **fn_kwargs)``
    in a Ray task. ``ray_remote_kwargs`` (2.54+) set the task's resources; 2.51-2.53 run it
    with Ray's default, one CPU."""
    if report_takes_validation():
        from ray.train import ValidationConfig, ValidationTaskConfig

        config = ValidationConfig(
            fn=fn,
            task_config=ValidationTaskConfig(fn_kwargs=fn_kwargs),
            ray_remote_kwargs=ray_remote_kwargs or {"num_cpus": 1},
        )
        return NativeValidation({"validation_config": config}, {"validation": True})
    report_kwargs = {"validate_fn": _KeywordsFromConfig(fn), "validate_config": dict(fn_kwargs)}
    return NativeValidation({}, report_kwargs)


def logging_config_kwargs(log_level: str) -> dict[str, Any]:
    """``RunConfig`` keyword arguments that set Ray Train's log level (2.56+); nothing on
    2.51-2.55, which have no ``ray.train.LoggingConfig``."""
    import ray.train

    logging_config = getattr(ray.train, "LoggingConfig", None)
    if logging_config is None:
        return {}
    return {"logging_config": logging_config(log_level=log_level)}


def result_has_return_value() -> bool:
    """Whether ``ray.train.Result`` carries the train function's return value (2.56+)."""
    import ray.train

    return "return_value" in getattr(ray.train.Result, "__dataclass_fields__", {})
