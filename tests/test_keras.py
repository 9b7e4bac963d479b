"""Real TensorFlow on CPU: the Keras callback and load_model, in TensorflowTrainer and outside."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import ray.cloudpickle

# Before anything imports TensorFlow: this import makes tf.keras Keras 2 here and in the Ray
# workers that the session starts later, as it does in a user's driver.
import trainer_integration.keras as ckval_keras
from tests.test_examples import run as run_example
from trainer_integration import report, resolve_checkpoint
from validation_service.errors import InvalidInput, RunNotFound
from validation_service.registry.registry import Registry

if importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("tf_keras") is None:
    pytest.skip(
        'TensorFlow is not installed: pip install "ckval[tensorflow]" and '
        'pip install --no-deps "tf-keras==2.21.*"',
        allow_module_level=True,
    )

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]

# Ray workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

HELD_OUT_X = (np.arange(50, dtype=np.float32) + 0.5) / 50  # between the training points


def line(x):
    return 2 * x  # the guide's linear data: y = 2x


def build_model(tf):
    # The guide's model, compiled as there, with a learning rate that moves in 4 epochs.
    model = tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=(1,)),
            tf.keras.layers.Dense(10),
            tf.keras.layers.Dense(1),
        ]
    )
    model.compile(
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.05),
        loss=tf.keras.losses.mean_squared_error,
        metrics=[tf.keras.metrics.mean_squared_error],
    )
    return model


def held_out_mse(model) -> float:
    predicted = np.asarray(model.predict(HELD_OUT_X.reshape(-1, 1), verbose=0)).reshape(-1)
    return float(np.mean((predicted - line(HELD_OUT_X)) ** 2))


def validate_on_held_out(checkpoint, config):
    """A validate_fn on a plain Ray task; fails on purpose for one report index."""
    from validation_service.executors import current_validation

    if current_validation().report_index == config.get("fail_index"):
        raise RuntimeError("held-out data unavailable for this checkpoint")
    return {"val_mse": held_out_mse(ckval_keras.load_model(checkpoint))}


def independent_mse(checkpoint_dir: str) -> float:
    """Held-out MSE from the saved weights alone: the model is linear, so y = x W1 W2 + b."""
    import tf_keras

    model = tf_keras.models.load_model(os.path.join(checkpoint_dir, "model.keras"), compile=False)
    w1, b1, w2, b2 = model.get_weights()
    predicted = (HELD_OUT_X.reshape(-1, 1) @ w1 + b1) @ w2 + b2
    return float(np.mean((predicted.reshape(-1) - line(HELD_OUT_X)) ** 2))


def train_with_callback(config):
    """The guide's quickstart: Ray Data shard, to_tf, one fit() per epoch, the callback."""
    import ray.train
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_model(tf)
    shard = ray.train.get_dataset_shard("train")
    callback = ckval_keras.ReportCheckpointCallback(
        validate_fn=validate_on_held_out,
        validate_config={"fail_index": config["fail_index"]},
        validation_resources={"num_cpus": 1},
        max_attempts=1,
    )
    for _ in range(config["epochs"]):
        dataset = shard.to_tf(feature_columns="x", label_columns="y", batch_size=16)
        model.fit(dataset, callbacks=[callback], verbose=0)


def rank_dataset(tf, rank: int, world: int):
    """This rank's share of the line's 200 points, in batches of 16, sharded by hand."""
    x = np.arange(200, dtype=np.float32)[rank::world] / 200
    dataset = tf.data.Dataset.from_tensor_slices((x.reshape(-1, 1), line(x).reshape(-1, 1)))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.batch(16).with_options(options)


def train_by_hand_resuming(config):
    """The guide's manual pattern: model.save on every rank, report() with a validate_fn."""
    import ray.train
    import tensorflow as tf

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        # Ray Train 2.60 refuses resume_from_checkpoint: the checkpoint comes in the config.
        model = ckval_keras.load_model(config["resume_from"])
    start_mse = held_out_mse(model)
    dataset = rank_dataset(tf, rank, world)
    for epoch in range(config["epochs"]):
        history = model.fit(dataset, verbose=0)
        metrics = {"epoch": epoch, "loss": history.history["loss"][-1], "start_mse": start_mse}
        with tempfile.TemporaryDirectory() as directory:
            model.save(os.path.join(directory, "model.keras"))  # every rank saves
            if rank == 0:
                report(
                    metrics,
                    ray.train.Checkpoint.from_directory(directory),
                    validate_fn=validate_on_held_out,
                    validation_resources={"num_cpus": 1},
                )
            else:
                report(metrics, None)


def fit(train_func, run_name, session_home, *, datasets=None, **config):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    trainer = TensorflowTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=run_name, storage_path=str(session_home / "ray_results")),
        datasets=datasets,
    )
    return trainer.fit()


def test_tensorflow_trainer_callback_validates_every_checkpoint_then_resume_by_hand(
    service, session_home, unique_run
):
    from ray.data import from_items

    epochs, fail_index = 4, 2
    items = [{"x": x / 200, "y": line(x / 200)} for x in range(200)]
    result = fit(
        train_with_callback,
        unique_run,
        session_home,
        datasets={"train": from_items(items)},
        epochs=epochs,
        fail_index=fail_index,
    )
    assert result.error is None  # the failing validation did not stop training
    registry = Registry()
    registry.wait(unique_run, timeout_s=180)

    records = registry.checkpoints(unique_run)
    assert [r.report_index for r in records] == list(range(epochs))
    status = {r.report_index: r.validation_status for r in records}
    assert status == {i: "FAILED" if i == fail_index else "VALIDATED" for i in range(epochs)}
    [failed] = [j for j in registry.validations(unique_run) if j.status == "FAILED"]
    assert "held-out data unavailable" in failed.error_message
    expected = {}
    for record in records:
        # metrics=None reports every Keras log, as Ray's callback does.
        assert set(record.reported_metrics) == {"loss", "mean_squared_error"}
        # A .keras archive every time, though Ray Train saves from a thread.
        assert zipfile.is_zipfile(os.path.join(record.uri, "model.keras"))
        if record.report_index != fail_index:
            expected[record.report_index] = independent_mse(record.uri)
            assert record.metrics["val_mse"] == pytest.approx(expected[record.report_index], 1e-5)
    assert records[-1].reported_metrics["loss"] < records[0].reported_metrics["loss"]
    [(best, best_metrics)] = registry.best_checkpoints(unique_run, "val_mse", mode="min", k=1)
    assert best.path == records[min(expected, key=expected.get)].uri
    # The metrics reached Ray Train too; its checkpoint points at the stored one.
    assert result.metrics["loss"] == pytest.approx(records[-1].reported_metrics["loss"])
    assert resolve_checkpoint(result.checkpoint).path == records[-1].uri

    # Resume after a crash from the registry, reporting by hand; the new run validates.
    resumed = f"{unique_run}-resumed"
    latest = registry.latest_checkpoint(unique_run)
    result = fit(train_by_hand_resuming, resumed, session_home, resume_from=latest, epochs=2)
    assert result.error is None
    registry.wait(resumed, timeout_s=180)
    new_records = registry.checkpoints(resumed)
    assert [r.validation_status for r in new_records] == ["VALIDATED", "VALIDATED"]
    # Training started from the stored weights of the last checkpoint, not from scratch.
    assert new_records[0].metrics["start_mse"] == pytest.approx(expected[epochs - 1], 1e-5)
    for record in new_records:
        assert record.metrics["val_mse"] == pytest.approx(independent_mse(record.uri), 1e-5)
    assert new_records[-1].metrics["val_mse"] < expected[epochs - 1]


KERAS_EPOCHS = 4
KERAS_FAIL_AFTER_EPOCH = 1


def train_keras_guide_resuming(config):
    """Ray's Keras resume as its guides write it: in the strategy's scope, the model from
    ``ray.train.get_checkpoint()``'s ``model.keras``, else a new one; ``model.save`` into a
    temporary folder and ``report`` each epoch. Rank 1 fails once, 2 s after its report of
    epoch 1 (``FailureConfig(max_failures=1)`` restarts the group)."""
    import json

    import ray.train
    import tensorflow as tf
    from ray import train
    from ray.train import Checkpoint

    tf.keras.utils.set_random_seed(0)
    context = train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    marks, start = config["marks"], 0
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        checkpoint = train.get_checkpoint()
        if checkpoint:
            with checkpoint.as_directory() as checkpoint_dir:
                model = tf.keras.models.load_model(os.path.join(checkpoint_dir, "model.keras"))
                with open(os.path.join(checkpoint_dir, "epoch.json")) as f:
                    start = json.load(f)["epoch"] + 1
            with open(os.path.join(marks, f"resumed-{rank}.json"), "w") as f:
                json.dump({"start": start}, f)
        else:
            model = build_model(tf)
    dataset = rank_dataset(tf, rank, world)
    for epoch in range(start, KERAS_EPOCHS):
        history = model.fit(dataset, verbose=0)
        metrics = {"epoch": epoch, "loss": history.history["loss"][-1]}
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            model.save(os.path.join(temp_checkpoint_dir, "model.keras"))
            with open(os.path.join(temp_checkpoint_dir, "epoch.json"), "w") as f:
                json.dump({"epoch": epoch}, f)
            checkpoint = Checkpoint.from_directory(temp_checkpoint_dir) if rank == 0 else None
            if config["how"] == "ray":
                ray.train.report(metrics, checkpoint=checkpoint)
            else:
                report(metrics, checkpoint, validate_fn=validate_on_held_out)
        failed = os.path.join(marks, "failed")
        if rank == 1 and epoch == KERAS_FAIL_AFTER_EPOCH and not os.path.exists(failed):
            time.sleep(2)
            open(failed, "w").close()
            raise RuntimeError("a worker fails once")
    if rank == 0:
        np.save(
            os.path.join(marks, "final.npy"),
            np.concatenate([w.ravel() for w in model.get_weights()]),
        )


def fit_keras_guide_resuming(how: str, run_name: str, session_home, marks: str):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    result = TensorflowTrainer(
        train_keras_guide_resuming,
        train_loop_config={"how": how, "marks": marks},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=run_name,
            storage_path=str(session_home / "ray_results"),
            failure_config=FailureConfig(max_failures=1),
        ),
    ).fit()
    assert result.error is None
    starts = {}
    for rank in (0, 1):
        with open(os.path.join(marks, f"resumed-{rank}.json")) as f:
            starts[rank] = json.load(f)["start"]
    return result, starts, np.load(os.path.join(marks, "final.npy"))


def test_the_keras_guides_resume_after_a_worker_failure_is_the_same_as_with_rays_report(
    service, session_home, unique_run, tmp_path
):
    """The guide's program under FailureConfig, with Ray's report and with ckval's: the
    restarted workers load model.keras from get_checkpoint() at the same epoch, and the
    run ends with the same weights; ckval validated every epoch's model."""
    ray_marks, ckval_marks = tmp_path / "ray", tmp_path / "ckval"
    ray_marks.mkdir(), ckval_marks.mkdir()
    _, ray_starts, ray_final = fit_keras_guide_resuming(
        "ray", f"{unique_run}-ray", session_home, str(ray_marks)
    )
    result, starts, final = fit_keras_guide_resuming(
        "ckval", unique_run, session_home, str(ckval_marks)
    )
    assert ray_starts == {0: KERAS_FAIL_AFTER_EPOCH + 1, 1: KERAS_FAIL_AFTER_EPOCH + 1}
    assert starts == ray_starts
    np.testing.assert_allclose(final, ray_final, rtol=1e-5, atol=1e-6)

    registry = Registry()
    registry.wait(unique_run, timeout_s=180)
    records = registry.checkpoints(unique_run)
    assert [r.reported_metrics["epoch"] for r in records] == list(range(KERAS_EPOCHS))
    assert all(r.validation_status == "VALIDATED" for r in records), records
    assert records[-1].metrics["val_mse"] == pytest.approx(independent_mse(records[-1].uri), 1e-5)
    assert resolve_checkpoint(result.checkpoint).path == records[-1].uri


class SquaredErrorPredictor:
    """A Keras predictor for MapBatchesValidator: squared error of each held-out row."""

    def __init__(self, checkpoint):
        self.model = ckval_keras.load_model(checkpoint, compile=False)

    def __call__(self, batch):
        predicted = np.asarray(self.model.predict(batch["x"].reshape(-1, 1), verbose=0))
        return {"squared_error": (predicted.reshape(-1) - batch["y"]) ** 2}


def test_keras_3_script_outside_ray_train_with_map_batches_validator(service, unique_run):
    import keras  # Keras 3, whatever tf.keras is in this process
    from ray.data import from_items

    from validation_service.executors.map_batches import MapBatchesValidator

    assert keras.__version__.startswith("3.")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
    validator = MapBatchesValidator(
        SquaredErrorPredictor,
        from_items([{"x": float(x), "y": float(line(x))} for x in HELD_OUT_X]),
        batch_size=25,
    )
    callback = ckval_keras.ReportCheckpointCallback(
        metrics={"train_loss": "loss"},
        validate_fn=validator,
        validation_resources=validator.recommended_resources,
        run=unique_run,
    )
    x = np.arange(200, dtype=np.float32) / 200
    model.fit(x, line(x), epochs=2, batch_size=20, callbacks=[callback], verbose=0)
    registry = Registry()
    registry.wait(unique_run, timeout_s=180)

    records = registry.checkpoints(unique_run)
    assert [r.validation_status for r in records] == ["VALIDATED"] * 2
    for record in records:
        assert set(record.reported_metrics) == {"train_loss"}
        stored = keras.saving.load_model(os.path.join(record.uri, "model.keras"))
        kernel, bias = stored.layers[0].get_weights()
        predicted = HELD_OUT_X * kernel[0, 0] + bias[0]
        expected = float(np.mean((predicted - line(HELD_OUT_X)) ** 2))
        assert record.metrics["squared_error"] == pytest.approx(expected, rel=1e-4, abs=1e-7)
    # The last checkpoint is the model as fit() left it.
    last = ckval_keras.load_model(registry.latest_checkpoint(unique_run))
    assert isinstance(last, keras.Model)
    np.testing.assert_allclose(last.get_weights()[0], model.get_weights()[0])


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_makes_tf_keras_keras_2_and_keeps_standalone_keras_3():
    environment = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, trainer_integration.keras, tensorflow as tf, keras\n"
            "print(os.environ['TF_USE_LEGACY_KERAS'], tf.keras.Model.__module__,"
            " keras.__version__)",
        ],
        cwd=ROOT,
        env={**environment, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    variable, tf_keras_model, keras_version = done.stdout.split()
    assert variable == "1" and tf_keras_model.startswith("tf_keras.")
    assert keras_version.startswith("3.")


def test_load_model_picks_the_keras_that_saved_the_file(tmp_path):
    import keras
    import tf_keras

    x = np.array([[0.25]], dtype=np.float32)
    legacy = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(1,))])
    legacy.save(tmp_path / "legacy.keras")
    modern = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    modern.save(tmp_path / "modern.keras")
    assert isinstance(ckval_keras.load_model(tmp_path / "legacy.keras"), tf_keras.Model)
    assert isinstance(ckval_keras.load_model(str(tmp_path / "modern.keras")), keras.Model)
    with pytest.raises(InvalidInput, match="No single .keras file"):
        ckval_keras.load_model(str(tmp_path))

    # A process where tf.keras is Keras 3 (the variable set to 0) loads the Keras 2 file, and
    # says what to install when tf-keras is missing.
    done = run_python(
        f"""
        import sys
        import numpy as np
        sys.modules["tf_keras"] = None  # as if tf-keras were not installed
        from trainer_integration.keras import load_model
        import tensorflow as tf
        assert tf.keras.Model.__module__.startswith("keras."), tf.keras.Model.__module__
        try:
            load_model({str(tmp_path / "legacy.keras")!r})
        except ImportError as exc:
            print("ERROR:", exc)
        del sys.modules["tf_keras"]
        model = load_model({str(tmp_path / "legacy.keras")!r})
        print("PREDICTED:", float(model.predict(np.array([[0.25]]), verbose=0)[0, 0]))
        """,
        TF_USE_LEGACY_KERAS="0",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ERROR:" in done.stdout and "saved by Keras 2 (tf-keras)" in done.stdout
    assert 'pip install --no-deps "tf-keras==2.21.*"' in done.stdout
    predicted = float(done.stdout.split("PREDICTED:")[1])
    assert predicted == pytest.approx(float(legacy.predict(x, verbose=0)[0, 0]), rel=1e-6)


def test_callback_without_keras_installed_says_what_to_install(unique_run):
    done = run_python(
        f"""
        import sys
        for name in ("tensorflow", "keras", "tf_keras"):
            sys.modules[name] = None  # their import fails, as when they are not installed
        from trainer_integration.keras import ReportCheckpointCallback
        try:
            ReportCheckpointCallback(run={unique_run!r})
        except ImportError as exc:
            print("ERROR:", exc)
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ReportCheckpointCallback needs Keras" in done.stdout
    assert 'pip install "ckval[tensorflow]"' in done.stdout
    with pytest.raises(RunNotFound):
        Registry().checkpoints(unique_run)  # nothing was stored


def test_unknown_hook_and_unsaveable_model_fail_before_anything_is_stored(unique_run, tmp_path):
    import keras

    for bad in ({"checkpoint_on": "epoch_ended"}, {"report_metrics_on": ["batch_end"]}):
        with pytest.raises(InvalidInput, match="names no Keras callback hook.*epoch_end"):
            ckval_keras.ReportCheckpointCallback(run=unique_run, **bad)

    class HoldsAFile(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.resource = (tmp_path / "log.txt").open("w")  # a config value JSON cannot hold

        def get_config(self):
            return {**super().get_config(), "resource": self.resource}

        def call(self, inputs):
            return inputs

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1), HoldsAFile()])
    model.compile(optimizer="sgd", loss="mse")
    callback = ckval_keras.ReportCheckpointCallback(
        validate_fn=validate_on_held_out, run=unique_run
    )
    x = np.arange(20, dtype=np.float32) / 20
    with pytest.raises(InvalidInput, match="Keras could not save the model.*get_config"):
        model.fit(x, line(x), epochs=1, callbacks=[callback], verbose=0)
    with pytest.raises(RunNotFound):
        Registry().checkpoints(unique_run)  # nothing was stored


def test_example_runs_as_is(tmp_path):
    # Unset: the example must set Keras 2 up itself, as a user's fresh script would.
    stdout = run_example(
        [sys.executable, "examples/keras_tensorflow_trainer.py", "--epochs", "2", "--run", "ex"],
        tmp_path,
        unset=("TF_USE_LEGACY_KERAS",),
    )
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    records = registry.checkpoints("ex")
    assert [r.validation_status for r in records] == ["VALIDATED", "VALIDATED"]
    best = registry.best_checkpoint_records("ex", "val_mse", "min", k=1)[0]
    assert f"val_mse {best.metrics['val_mse']:.6f}" in stdout
