"""What the seed programs import from torchvision, offline and small (torchvision has no
CPU build here and FashionMNIST would be downloaded): the same names and call shapes,
also as the ``models`` and ``transforms`` modules.

``FashionMNIST`` makes 28x28 grey images whose class is the brightest of 10 horizontal
bands, so a model learns it in a few steps; nothing is written to ``root``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

CLASSES = 10
SIZE = 28


class FashionMNIST(torch.utils.data.Dataset):
    def __init__(self, root: str, train: bool = True, download: bool = False, transform=None):
        rows = 256 if train else 64
        rng = np.random.default_rng(0 if train else 1)
        self.targets = rng.integers(0, CLASSES, rows)
        self.images = [_image(label, rng) for label in self.targets]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        image = Image.fromarray(self.images[index], mode="L")
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])


def _image(label: int, rng) -> np.ndarray:
    pixels = rng.integers(0, 60, (SIZE, SIZE))
    top = int(label * SIZE / CLASSES)
    pixels[top : top + 3, :] = 255
    return pixels.astype(np.uint8)


class ToTensor:
    def __call__(self, image) -> torch.Tensor:
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)
        return pixels.unsqueeze(0) if pixels.ndim == 2 else pixels.permute(2, 0, 1)


class Resize:
    """The shorter side to ``size``, the aspect ratio kept."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, image):
        width, height = image.size
        scale = self.size / min(width, height)
        return image.resize((round(width * scale), round(height * scale)), Image.BILINEAR)


class CenterCrop:
    def __init__(self, size: int):
        self.size = size

    def __call__(self, image):
        width, height = image.size
        left, top = (width - self.size) // 2, (height - self.size) // 2
        return image.crop((left, top, left + self.size, top + self.size))


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = mean[0], std[0]

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor - self.mean) / self.std


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, value):
        for transform in self.transforms:
            value = transform(value)
        return value


class _SmallResNet(torch.nn.Module):
    """resnet18's interface where the guides touch it: ``conv1`` (replaced by the guides
    for one input channel), then pooling and ``fc``; a few thousand parameters."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.pool = torch.nn.AdaptiveAvgPool2d((14, 1))
        self.fc = torch.nn.Linear(64 * 14, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv1(images))), 1))


def resnet18(num_classes: int = 1000, pretrained: bool = False) -> torch.nn.Module:
    return _SmallResNet(num_classes)


models = SimpleNamespace(resnet18=resnet18)
transforms = SimpleNamespace(
    Compose=Compose, Resize=Resize, CenterCrop=CenterCrop, ToTensor=ToTensor, Normalize=Normalize
)
