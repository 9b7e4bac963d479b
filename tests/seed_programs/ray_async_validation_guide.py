"""Ray Train's "Validating checkpoints asynchronously" program, with ckval.

The guide's snippets leave the model, the data and the training step as ``...``: they are
filled in here with the PyTorch guide's (tests/seed_programs/ray_train_pytorch_guide.py).
Changed from the guide, and why:
- ``ray.train.report(..., validation=ValidationTaskConfig(fn_kwargs={...}))`` is
  ``report(..., validate_fn=validation_fn, validate_config={...})`` (ckval's arguments;
  ``validation_fn(checkpoint, train_run_name, epoch)`` gets the entries as keyword
  arguments, as Ray calls it), and ``TorchTrainer(validation_config=...)`` is left out;
- the guide shows three alternative ``validation_fn``s under one name: here the first is
  ``validation_fn_simple``; the third, a Ray Data map_batches job, is run in its guide
  form by tests/test_validators.py (``validate_with_map_batches``) and is left out;
- no GPU here: ``use_gpu``, ``accelerator_type`` and ``.cuda()`` are left out;
- the eval-only runs get ``storage_path`` (the guide's default is ``~/ray_results``);
- ``result.return_values`` is ``result.return_value``, its name in Ray 2.60, and
  ``len(validation_dataset)`` is ``validation_dataset.count()`` (a Dataset has no len);
- ``for epoch in epochs`` is ``for epoch in range(epochs)``.
"""

import os
import tempfile

import numpy as np
import ray.data
import ray.train
import ray.train.torch
import torch
import torchmetrics
from torch.nn import CrossEntropyLoss

from tests.seed_programs._torchvision_standin import Compose, FashionMNIST, Normalize, ToTensor
from tests.seed_programs._validation import guide_model
from trainer_integration import ray_results_path, report


def fashion_rows(train: bool) -> list[dict]:
    transform = Compose([ToTensor(), Normalize((0.28604,), (0.32025,))])
    data = FashionMNIST(root="", train=train, transform=transform)
    return [{"image": image.numpy(), "label": label} for image, label in data]


def add_images(batch: dict) -> dict:
    rows = fashion_rows(train=False)
    return {
        "image": np.stack([rows[i]["image"] for i in batch["id"]]),
        "label": np.array([rows[i]["label"] for i in batch["id"]]),
    }


# Define Ray Data validation dataset outside validation function because it is not json serializable
validation_dataset = ray.data.range(64, override_num_blocks=2).map_batches(add_images)


def validation_fn_simple(checkpoint: ray.train.Checkpoint) -> dict:
    # Load the checkpoint
    model = guide_model()
    with checkpoint.as_directory() as checkpoint_dir:
        model_state_dict = torch.load(os.path.join(checkpoint_dir, "model.pt"))
        model.load_state_dict(model_state_dict)
    model.eval()

    # Perform validation on the data
    total_accuracy = 0
    with torch.no_grad():
        for batch in validation_dataset.iter_torch_batches(batch_size=128):
            images, labels = batch["image"], batch["label"]
            outputs = model(images)
            total_accuracy += (outputs.argmax(1) == labels).sum().item()
    return {"score": total_accuracy / validation_dataset.count()}


def eval_only_train_fn(config_dict: dict) -> dict:
    # Load the checkpoint
    model = guide_model()
    with config_dict["checkpoint"].as_directory() as checkpoint_dir:
        model_state_dict = torch.load(os.path.join(checkpoint_dir, "model.pt"))
        model.load_state_dict(model_state_dict)
    model.eval()

    # Set up metrics and data loaders
    criterion = CrossEntropyLoss()
    mean_valid_loss = torchmetrics.MeanMetric()
    test_data_shard = ray.train.get_dataset_shard("validation")
    test_dataloader = test_data_shard.iter_torch_batches(batch_size=128)

    # Compute metric and return it directly from the train function
    with torch.no_grad():
        for batch in test_dataloader:
            images, labels = batch["image"], batch["label"]
            outputs = model(images)
            loss = criterion(outputs, labels)
            mean_valid_loss(loss)
    return {"score": mean_valid_loss.compute().item()}


def validation_fn(checkpoint: ray.train.Checkpoint, train_run_name: str, epoch: int) -> dict:
    trainer = ray.train.torch.TorchTrainer(
        eval_only_train_fn,
        train_loop_config={"checkpoint": checkpoint},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        # Name validation run to easily associate it with training run
        run_config=ray.train.RunConfig(
            name=f"{train_run_name}_validation_epoch_{epoch}",
            storage_path=ray_results_path(),
        ),
        datasets={"validation": validation_dataset},
    )
    result = trainer.fit()
    # return_value holds the return value of the train function from worker 0
    return result.return_value


def train_func(config: dict) -> None:
    epochs = config["epochs"]
    model = ray.train.torch.prepare_model(guide_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    rank = ray.train.get_context().get_world_rank()
    for epoch in range(epochs):
        for batch in ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=128):
            loss = CrossEntropyLoss()(model(batch["image"]), batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            training_metrics = {"loss": loss.item(), "epoch": epoch}
            local_checkpoint_dir = tempfile.mkdtemp()
            torch.save(
                model.module.state_dict(),
                os.path.join(local_checkpoint_dir, "model.pt"),
            )
            report(
                training_metrics,
                checkpoint=ray.train.Checkpoint.from_directory(local_checkpoint_dir),
                checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                validate_fn=validation_fn,
                validate_config={
                    "train_run_name": ray.train.get_context().get_experiment_name(),
                    "epoch": epoch,
                },
            )
        else:
            report({}, None)


def run_trainer(epochs: int, run_config: ray.train.RunConfig) -> ray.train.Result:
    train_dataset = ray.data.from_items(fashion_rows(train=True))
    trainer = ray.train.torch.TorchTrainer(
        train_func,
        train_loop_config={"epochs": epochs},
        # Pass training dataset in datasets arg to split it across training workers
        datasets={"train": train_dataset},
        scaling_config=ray.train.ScalingConfig(
            num_workers=2,
        ),
        run_config=run_config,
    )
    return trainer.fit()
