"""Keras / TensorFlow: a callback that reports model.keras with a validate_fn, and load_model.

Importing this module before TensorFlow makes ``tf.keras`` the Keras 2 of ``tf-keras``, which
Ray Train's TensorflowTrainer needs (see ``_prefer_legacy_tf_keras``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

from trainer_integration import CheckpointUploadMode, resolve_checkpoint
from trainer_integration._callbacks import callback_reporter, installed, plain, train_context
from validation_service.errors import InvalidInput

__all__ = ["MODEL_FILENAME", "ReportCheckpointCallback", "load_model"]

MODEL_FILENAME = "model.keras"  # the name Ray's callback and TensorflowCheckpoint use
LEGACY_KERAS_VARIABLE = "TF_USE_LEGACY_KERAS"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"

# The hooks Ray's Keras callback accepts: the Keras callback methods without "on_".
HOOKS = (
    "epoch_begin",
    "epoch_end",
    "train_batch_begin",
    "train_batch_end",
    "test_batch_begin",
    "test_batch_end",
    "predict_batch_begin",
    "predict_batch_end",
    "train_begin",
    "train_end",
    "test_begin",
    "test_end",
    "predict_begin",
    "predict_end",
)

INSTALL_HINT = (
    'pip install "ckval[tensorflow]" and then pip install --no-deps "tf-keras==2.21.*" '
    "(Keras 2, what Ray Train's TensorflowTrainer needs), or pip install keras (Keras 3, "
    "outside Ray Train)"
)

LEGACY_KERAS_HINT = (
    "Put `import trainer_integration.keras` (or os.environ['TF_USE_LEGACY_KERAS'] = '1') at the "
    "top of the driver script, before anything imports TensorFlow and before ray.init(); if "
    "Ray is already running, start it with ray.init(runtime_env={'env_vars': "
    "{'TF_USE_LEGACY_KERAS': '1'}}) so that its workers get the variable before TensorFlow."
)


def _prefer_legacy_tf_keras() -> bool:
    """Sets TF_USE_LEGACY_KERAS=1 if TensorFlow is not imported yet and tf-keras is installed.

    TensorFlow picks what ``tf.keras`` is when it is imported. Ray Train's TensorflowTrainer
    sets the variable on its workers only after they have imported TensorFlow (they do so
    when they receive the training function), which with TensorFlow 2.16+ leaves Keras 3
    there, and Keras 3 fails under MultiWorkerMirroredStrategy. Set in the driver before
    Ray starts, the variable reaches every Ray worker. An explicit value is kept (``0``
    keeps Keras 3 as tf.keras), and the standalone ``import keras`` is Keras 3 either way.
    Returns whether the variable is now set to use tf-keras.
    """
    if LEGACY_KERAS_VARIABLE not in os.environ and "tensorflow" not in sys.modules:
        if importlib.util.find_spec("tf_keras") is not None:
            os.environ[LEGACY_KERAS_VARIABLE] = "1"
    return os.environ.get(LEGACY_KERAS_VARIABLE) in ("1", "true", "True")


_prefer_legacy_tf_keras()


def _keras_hook(hook: str) -> Callable[..., None]:
    """The Keras callback method ``on_<hook>``: the epoch or batch index (where the hook
    has one) and the logs, handed to ``ReportCheckpointCallback._on``."""
    if hook.startswith("epoch_") or "_batch_" in hook:

        def on_hook(self: ReportCheckpointCallback, index: int, logs: dict | None = None) -> None:
            self._on(hook, logs)

    else:

        def on_hook(self: ReportCheckpointCallback, logs: dict | None = None) -> None:
            self._on(hook, logs)

    on_hook.__name__ = f"on_{hook}"
    on_hook.__qualname__ = f"ReportCheckpointCallback.on_{hook}"
    return on_hook


def _with_keras_hooks(cls: type) -> type:
    """Gives ``cls`` the Keras callback method of every hook in HOOKS."""
    for hook in HOOKS:
        setattr(cls, f"on_{hook}", _keras_hook(hook))
    return cls


@_with_keras_hooks
class ReportCheckpointCallback:
    """Keras callback that reports metrics and ``model.keras`` checkpoints through ckval.

    A drop-in for ``ray.train.tensorflow.keras.ReportCheckpointCallback``: the same
    ``checkpoint_on``, ``report_metrics_on`` and ``metrics`` (metrics always travel with a
    checkpoint). Inside Ray Train call ``model.fit(..., callbacks=[...])`` on every rank:
    every rank saves the model, as MultiWorkerMirroredStrategy requires (the other ranks
    into a scratch folder that is deleted), rank 0's ``model.keras`` is reported with
    ``validate_fn`` and the metrics reach Ray Train too. Outside Ray Train pass ``run=``:
    each checkpoint is reported through ``trainer_integration.Client(run)``.
    Works with Keras 2 (tf-keras, ``tf.keras`` under TF_USE_LEGACY_KERAS=1) and Keras 3.
    """

    # Keras 2 (tf-keras) reads these: the callback runs on every worker, wants numpy logs,
    # and has batch hooks only when one is selected.
    _chief_worker_only = False
    _supports_tf_logs = False
    # Keras 3 reads this: its hooks save the model, so they must run in order.
    async_safe = False

    def __init__(
        self,
        checkpoint_on: str | list[str] = "epoch_end",
        report_metrics_on: str | list[str] = "epoch_end",
        metrics: str | list[str] | dict[str, str] | None = None,
        *,
        validate_fn: Callable[..., dict] | str | None = None,
        validate_config: dict | None = None,
        validation_resources: dict | None = None,
        checkpoint_upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC,
        max_attempts: int = 3,
        timeout_s: float | None = None,
        run: str | None = None,
    ) -> None:
        _require_keras("ReportCheckpointCallback")
        self._checkpoint_on = _hook_names(checkpoint_on, "checkpoint_on")
        self._report_metrics_on = _hook_names(report_metrics_on, "report_metrics_on")
        self._metrics = _metric_selection(metrics)
        self._reporter = callback_reporter(locals())
        self.model = None
        self.params: dict = {}
        self.validation_data = None

    # -- the Keras callback protocol (Keras 2 and Keras 3 call these; the on_<hook>
    # methods are made from HOOKS by _with_keras_hooks) --

    def set_params(self, params: dict) -> None:
        self.params = params

    def set_model(self, model: Any) -> None:
        _refuse_keras_3_under_tensorflow_trainer(model)
        self.model = model

    def _implements_train_batch_hooks(self) -> bool:
        return self._selects("train_batch_begin", "train_batch_end")

    def _implements_test_batch_hooks(self) -> bool:
        return self._selects("test_batch_begin", "test_batch_end")

    def _implements_predict_batch_hooks(self) -> bool:
        return self._selects("predict_batch_begin", "predict_batch_end")

    # -- reporting --

    def _selects(self, *hooks: str) -> bool:
        return any(h in self._checkpoint_on or h in self._report_metrics_on for h in hooks)

    def _on(self, hook: str, logs: dict | None) -> None:
        if hook in self._checkpoint_on:
            self._save_and_report(self._reported_metrics(logs, hook))
        elif hook in self._report_metrics_on:
            self._reporter.report_metrics(self._reported_metrics(logs, hook))
        else:
            return
        # At each report point, on every rank: the run's stop policy decided (rank 0's
        # answer, the same everywhere, so no rank leaves MultiWorkerMirroredStrategy early).
        if self._reporter.should_stop():
            self.model.stop_training = True

    def _reported_metrics(self, logs: dict | None, hook: str) -> dict:
        logs = dict(logs or {})
        if self._metrics is None:
            selected = logs
        else:
            missing = sorted(set(self._metrics.values()) - set(logs))
            if missing:
                raise InvalidInput(
                    f"metrics= names {missing}, which Keras did not log at on_{hook} "
                    f"(logged: {sorted(logs)}). Name logged metrics, e.g. 'loss', or "
                    "'val_loss' when fit() has validation data."
                )
            selected = {name: logs[key] for name, key in self._metrics.items()}
        return {name: plain(value) for name, value in selected.items()}

    def _save_and_report(self, metrics: dict) -> None:
        chief = self._reporter.chief
        # Every rank saves: under MultiWorkerMirroredStrategy saving is a collective step.
        # Only rank 0's folder is reported; the others are scratch.
        directory = tempfile.mkdtemp(prefix="ckval-keras-" if chief else "ckval-keras-scratch-")
        try:
            _save_model(self.model, os.path.join(directory, MODEL_FILENAME))
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        if not chief:
            shutil.rmtree(directory, ignore_errors=True)
            self._reporter.report_metrics(metrics)
            return
        self._reporter.report_folder(metrics, directory, owned=True)


def _save_model(model: Any, path: str) -> None:
    """``model.save(path)``, with an error that says what to do when Keras cannot save it."""
    if model is None:
        raise InvalidInput(
            "ReportCheckpointCallback has no model to save: pass it to model.fit(callbacks=[...])."
        )
    # tf-keras writes HDF5 into a ".keras" path from its second save on in a thread other
    # than the main one (its saving flag is thread-local), and Ray Train runs the training
    # function in a thread: ask for the .keras archive by name.
    options = {"save_format": "keras_v3"} if _keras_package(model) == "tf_keras" else {}
    try:
        model.save(path, **options)
    except Exception as exc:
        raise InvalidInput(
            f"Keras could not save the model {getattr(model, 'name', model)!r} as "
            f"{os.path.basename(path)} ({type(exc).__name__}: {exc}). Nothing was reported. "
            "Give custom layers and models a get_config() (and register them with "
            "keras.saving.register_keras_serializable), and keep their config to plain "
            "values; check that model.save('model.keras') works before training."
        ) from exc


def load_model(checkpoint: Any, **load_kwargs: Any) -> Any:
    """Loads the ``model.keras`` of a reported checkpoint with the Keras that saved it.

    ``checkpoint`` is a ``ray.train.Checkpoint`` (the stored one, or the pointer that Ray
    Train's Result holds), a folder, or a ``.keras`` file. A file saved by Keras 2 (tf-keras,
    ``tf.keras`` under TF_USE_LEGACY_KERAS=1) is loaded with ``tf_keras``, one saved by Keras 3
    with ``keras``, whatever ``tf.keras`` is in this process. ``load_kwargs`` go to Keras'
    ``load_model`` (``compile=False``, ``custom_objects=...``). Inside a distribution
    strategy's ``scope()`` the model's variables are created in that strategy.
    """
    if not hasattr(checkpoint, "as_directory"):  # ray.train.Checkpoint is PathLike too
        return _load_file(_model_file(os.fspath(checkpoint)), load_kwargs)
    checkpoint = resolve_checkpoint(checkpoint)
    with checkpoint.as_directory() as directory:
        return _load_file(_model_file(directory), load_kwargs)


def _saved_keras_version(path: str) -> str:
    """The Keras version recorded in a saved model: a .keras archive or an HDF5 file.

    tf-keras may write HDF5 into a file named ``model.keras`` (see ``_save_model``); both
    record the version that saved them.
    """
    try:
        with open(path, "rb") as f:
            is_hdf5 = f.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE
        if is_hdf5:
            import h5py

            with h5py.File(path, "r") as saved:
                version = saved.attrs["keras_version"]
            return version.decode() if isinstance(version, bytes) else str(version)
        with zipfile.ZipFile(path) as archive:
            return str(json.loads(archive.read("metadata.json"))["keras_version"])
    except (zipfile.BadZipFile, KeyError, ValueError, OSError, ImportError) as exc:
        raise InvalidInput(
            f"{path} is neither a Keras .keras archive nor a Keras HDF5 file that records "
            f"the Keras version ({type(exc).__name__}: {exc}); save the model with "
            "model.save('model.keras')."
        ) from exc


def _require_keras(what: str) -> None:
    """Raises ImportError naming what to install when neither Keras 2 nor Keras 3 is."""
    if installed("tf_keras") and installed("tensorflow"):
        return
    if installed("keras"):
        return
    raise ImportError(f"{what} needs Keras, which is not installed here: {INSTALL_HINT}.")


def _load_file(path: str, load_kwargs: dict) -> Any:
    version = _saved_keras_version(path)
    major = version.split(".", 1)[0]
    if major == "2":
        package, flavour = "tf_keras", "Keras 2 (tf-keras)"
        install = 'pip install --no-deps "tf-keras==2.21.*" next to tensorflow-cpu'
    elif major == "3":
        package, flavour = "keras", "Keras 3"
        install = 'pip install "keras>=3"'
    else:
        raise InvalidInput(f"{path} was saved by Keras {version}, which ckval cannot load.")
    try:
        module = importlib.import_module(package)
    except ImportError as exc:
        raise ImportError(
            f"{path} was saved by {flavour} {version}, which is not installed here: {install}."
        ) from exc
    if major == "3" and not str(getattr(module, "__version__", "")).startswith("3."):
        raise ImportError(
            f"{path} was saved by Keras {version}, but `keras` here is "
            f"{module.__version__}: {install}."
        )
    loader = module.models.load_model if major == "2" else module.saving.load_model
    try:
        return loader(path, **load_kwargs)
    except Exception as exc:
        raise InvalidInput(
            f"{flavour} {module.__version__} could not load {path}, saved by Keras {version} "
            f"({type(exc).__name__}: {exc}). Custom layers need custom_objects= (or "
            "registration with register_keras_serializable) in this process."
        ) from exc


def _model_file(location: str) -> str:
    if os.path.isfile(location):
        return location
    candidate = os.path.join(location, MODEL_FILENAME)
    if os.path.isfile(candidate):
        return candidate
    found = sorted(name for name in os.listdir(location) if name.endswith(".keras"))
    if len(found) == 1:
        return os.path.join(location, found[0])
    raise InvalidInput(
        f"No single .keras file in the checkpoint at {location} (files: "
        f"{sorted(os.listdir(location))}). ReportCheckpointCallback saves {MODEL_FILENAME}; "
        "with report() save the model with model.save(os.path.join(folder, 'model.keras'))."
    )


def _hook_names(value: str | list[str], argument: str) -> list[str]:
    names = [value] if isinstance(value, str) else list(value)
    unknown = [name for name in names if name not in HOOKS]
    if unknown or not all(isinstance(name, str) for name in names):
        raise InvalidInput(
            f"{argument}={value!r} names no Keras callback hook. Use one or a list of: "
            f"{', '.join(HOOKS)} (the on_* method names without 'on_')."
        )
    return names


def _metric_selection(metrics: Any) -> dict[str, str] | None:
    """Reported name -> Keras log key, as Ray's callback reads ``metrics``."""
    if metrics is None:
        return None
    if isinstance(metrics, str):
        return {metrics: metrics}
    if isinstance(metrics, Mapping):
        return {str(name): str(key) for name, key in metrics.items()}
    if isinstance(metrics, (list, tuple)) and all(isinstance(m, str) for m in metrics):
        return {m: m for m in metrics}
    raise InvalidInput(
        f"metrics must be None (every Keras log), a log key, a list of them, or a dict of "
        f"reported name -> log key, got {metrics!r}."
    )


def _refuse_keras_3_under_tensorflow_trainer(model: Any) -> None:
    # Ray's TensorFlow backend sets TF_CONFIG on each worker of a multi-worker run.
    if "TF_CONFIG" not in os.environ or train_context() is None:
        return
    if train_context().get_world_size() < 2 or _keras_package(model) != "keras":
        return
    raise RuntimeError(
        f"The model is a Keras 3 model ({type(model).__module__}), but TensorflowTrainer's "
        "MultiWorkerMirroredStrategy needs Keras 2: tf.keras became Keras 3 because this "
        f"worker imported TensorFlow before {LEGACY_KERAS_VARIABLE}=1 was set. " + LEGACY_KERAS_HINT
    )


def _keras_package(model: Any) -> str | None:
    """ "keras" (Keras 3) or "tf_keras" (Keras 2): the package the model's classes come from."""
    for cls in type(model).__mro__:
        package = cls.__module__.split(".", 1)[0]
        if package in ("keras", "tf_keras"):
            return package
    return None
