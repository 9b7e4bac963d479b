"""Ray Train's Keras quickstart with ckval: every epoch's model.keras is validated later.

python examples/keras_tensorflow_trainer.py [--epochs 4] [--run keras-example]
"""

# Imported before TensorFlow: it makes tf.keras the Keras 2 of tf-keras here and on the Ray
# workers, which TensorflowTrainer's MultiWorkerMirroredStrategy needs.
from trainer_integration.keras import ReportCheckpointCallback, load_model  # isort: skip

import argparse
import logging

import numpy as np
import ray
import ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.tensorflow import TensorflowTrainer

from trainer_integration import ray_results_path
from validation_service import Registry


def validate_fn(checkpoint: ray.train.Checkpoint, config: dict) -> dict:
    """Held-out mean squared error of the reported model (runs later, in a Ray task)."""
    model = load_model(checkpoint, compile=False)
    x = np.linspace(0.0, 1.0, config["points"], dtype=np.float32).reshape(-1, 1)
    predicted = model.predict(x, verbose=0)
    return {"val_mse": float(np.mean((predicted - 2 * x) ** 2))}


def train_func(config: dict) -> None:
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.layers.InputLayer(input_shape=(1,)),
                tf.keras.layers.Dense(10),
                tf.keras.layers.Dense(1),
            ]
        )
        model.compile(
            optimizer=tf.keras.optimizers.SGD(learning_rate=config["lr"]),
            loss=tf.keras.losses.mean_squared_error,
            metrics=[tf.keras.metrics.mean_squared_error],
        )
    shard = ray.train.get_dataset_shard("train")
    callback = ReportCheckpointCallback(
        metrics={"loss": "loss"},
        validate_fn=validate_fn,
        validate_config={"points": 101},
        validation_resources={"num_cpus": 1},
    )
    for _ in range(config["epochs"]):
        dataset = shard.to_tf(feature_columns="x", label_columns="y", batch_size=16)
        model.fit(dataset, callbacks=[callback], verbose=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--run", default="keras-example")
    args = parser.parse_args()
    # Quiet: Ray's warnings only on the driver; workers' output stays in Ray's log files.
    ray.init(log_to_driver=False, logging_level=logging.WARNING, include_dashboard=False)
    dataset = ray.data.from_items([{"x": x / 200, "y": 2 * x / 200} for x in range(200)])
    train_logging = getattr(ray.train, "LoggingConfig", None)
    trainer = TensorflowTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs, "lr": 0.05},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=args.run,
            storage_path=ray_results_path(),  # under CKVAL_HOME, next to ckval's files
            # ray.train.LoggingConfig: Ray 2.56+ (earlier releases log at their default)
            **({"logging_config": train_logging(log_level="WARNING")} if train_logging else {}),
        ),
        datasets={"train": dataset},
    )
    result = trainer.fit()
    print(f"training done: loss {result.metrics['loss']:.6f}")
    registry = Registry()
    registry.wait(args.run, timeout_s=300, progress=True)
    [(best, metrics)] = registry.best_checkpoints(args.run, "val_mse", mode="min", k=1)
    print(f"best checkpoint: loss {metrics['loss']:.6f} val_mse {metrics['val_mse']:.6f}")
    model = load_model(best)  # the stored model.keras, with the Keras that saved it
    print(f"2 * 0.5 = {float(model.predict(np.array([[0.5]]), verbose=0)[0, 0]):.3f}")


if __name__ == "__main__":
    main()
