"""Ray Train's "Get Started with Distributed Training using PyTorch" program, with ckval.

Changed from the guide, and why:
- the torchvision imports (resnet18, FashionMNIST, ToTensor, Normalize, Compose) come from
  a stand-in with the same names: no CPU build of torchvision here, and no download;
- ``from trainer_integration import report`` and ``from ... import fashion_accuracy``
  are added, and ``ray.train.report(...)`` is ``report(..., validate_fn=fashion_accuracy)``
  (the one ckval argument: the guide validates nothing);
- ``use_gpu=False``: this machine has no GPU;
- step [6] loads ``resolve_checkpoint(result.checkpoint)``: Ray Train's Result holds
  ckval's pointer to the stored checkpoint.
Every rank reports a checkpoint, as in the guide: ckval keeps rank 0's.
"""

import os
import tempfile

import ray.train.torch
import torch
from torch.nn import CrossEntropyLoss
from torch.optim import Adam
from torch.utils.data import DataLoader

# was: from torchvision.models / .datasets / .transforms import ...
from tests.seed_programs._torchvision_standin import (
    Compose,
    FashionMNIST,
    Normalize,
    ToTensor,
    resnet18,
)
from tests.seed_programs._validation import fashion_accuracy
from trainer_integration import report, resolve_checkpoint


def train_func():
    # Model, Loss, Optimizer
    model = resnet18(num_classes=10)
    model.conv1 = torch.nn.Conv2d(
        1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False
    )
    # [1] Prepare model.
    model = ray.train.torch.prepare_model(model)
    # model.to("cuda")  # This is done by `prepare_model`
    criterion = CrossEntropyLoss()
    optimizer = Adam(model.parameters(), lr=0.001)

    # Data
    transform = Compose([ToTensor(), Normalize((0.28604,), (0.32025,))])
    data_dir = os.path.join(tempfile.gettempdir(), "data")
    train_data = FashionMNIST(root=data_dir, train=True, download=True, transform=transform)
    train_loader = DataLoader(train_data, batch_size=128, shuffle=True)
    # [2] Prepare dataloader.
    train_loader = ray.train.torch.prepare_data_loader(train_loader)

    # Training
    for epoch in range(10):
        if ray.train.get_context().get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)

        for images, labels in train_loader:
            # This is done by `prepare_data_loader`!
            # images, labels = images.to("cuda"), labels.to("cuda")
            outputs = model(images)
            loss = criterion(outputs, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        # [3] Report metrics and checkpoint.
        metrics = {"loss": loss.item(), "epoch": epoch}
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            torch.save(model.module.state_dict(), os.path.join(temp_checkpoint_dir, "model.pt"))
            report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(temp_checkpoint_dir),
                validate_fn=fashion_accuracy,
            )
        if ray.train.get_context().get_world_rank() == 0:
            print(metrics)


# [4] Configure scaling and resource requirements.
scaling_config = ray.train.ScalingConfig(num_workers=2, use_gpu=False)

# [5] Launch distributed training job.
trainer = ray.train.torch.TorchTrainer(
    train_func,
    scaling_config=scaling_config,
    # [5a] If running in a multi-node cluster, this is where you
    # should configure the run's persistent storage that is accessible
    # across all worker nodes.
    # run_config=ray.train.RunConfig(storage_path="s3://..."),
)
result = trainer.fit()

# [6] Load the trained model.
with resolve_checkpoint(result.checkpoint).as_directory() as checkpoint_dir:
    model_state_dict = torch.load(os.path.join(checkpoint_dir, "model.pt"))
    model = resnet18(num_classes=10)
    model.conv1 = torch.nn.Conv2d(
        1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False
    )
    model.load_state_dict(model_state_dict)
