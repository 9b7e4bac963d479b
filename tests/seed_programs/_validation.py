"""The validate_fn the seed programs pass: what their guides leave to the user."""

from __future__ import annotations

import os

import torch

from tests.seed_programs._torchvision_standin import (
    CenterCrop,
    Compose,
    FashionMNIST,
    Normalize,
    Resize,
    ToTensor,
    resnet18,
)


def guide_model() -> torch.nn.Module:
    """The guides' model: resnet18 with a one-channel conv1."""
    model = resnet18(num_classes=10)
    model.conv1 = torch.nn.Conv2d(
        1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False
    )
    return model


def fashion_accuracy(checkpoint, config: dict) -> dict:
    """Accuracy and mean loss of the checkpoint's model.pt on the held-out images."""
    model = guide_model()
    with checkpoint.as_directory() as directory:
        model.load_state_dict(torch.load(os.path.join(directory, "model.pt")))
    model.eval()
    transform = Compose([ToTensor(), Normalize((0.28604,), (0.32025,))])
    images, labels = zip(*FashionMNIST(root="", train=False, transform=transform), strict=True)
    with torch.no_grad():
        logits = model(torch.stack(images))
    labels = torch.tensor(labels)
    return {
        "accuracy": (logits.argmax(dim=1) == labels).float().mean().item(),
        "val_loss": torch.nn.functional.cross_entropy(logits, labels).item(),
    }


def readme_images() -> list[tuple[str, tuple[int, int, int]]]:
    """The image folder of the dask-pytorch-ddp program: (key, colour), dark or light."""
    return [
        (f"dark/{i}.png", (20 + i, 10, 10)) if i % 2 else (f"light/{i}.png", (230, 240 - i, 235))
        for i in range(20)
    ]


def readme_transform():
    """The transform given to the README program's S3ImageFolder."""
    return Compose([Resize(20), CenterCrop(16), ToTensor()])


def dask_readme_accuracy(checkpoint, config: dict) -> dict:
    """Accuracy of the README's DDP state dict on its images, made again in memory."""
    import io
    import pickle

    from PIL import Image

    model = resnet18()
    with checkpoint.as_directory() as directory:
        [name] = [n for n in os.listdir(directory) if n.endswith(".pkl")]
        with open(os.path.join(directory, name), "rb") as f:
            state = pickle.load(f)
    model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    model.eval()
    classes = {"dark": 0, "light": 1}
    correct = 0
    for key, colour in readme_images():
        buffer = io.BytesIO()
        Image.new("RGB", (16, 16), colour).save(buffer, format="PNG")
        image = readme_transform()(Image.open(buffer).convert("RGB"))
        with torch.no_grad():
            correct += int(model(image.unsqueeze(0)).argmax().item() == classes[key.split("/")[0]])
    return {"accuracy": correct / len(readme_images()), "file": name}
