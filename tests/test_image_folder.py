"""S3ImageFolder and FsspecImageFolder against moto's S3 server, with PNGs made by Pillow."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from tests.moto_s3 import environment, moto_s3_server, png_bytes
from trainer_integration.dask import FsspecImageFolder, S3ImageFolder
from validation_service.errors import InvalidInput

BUCKET = "images"
# <prefix>/<class>/<image>: three classes, images at the class folder and below it.
IMAGES = {
    "train/zebra/a.png": (250, 250, 250),
    "train/cat/2.png": (10, 0, 0),
    "train/cat/1.PNG": (20, 0, 0),
    "train/dog/nested/3.png": (0, 30, 0),
    "train/dog/4.png": (0, 40, 0),
    "train/README.txt": None,  # directly under the root: no class
    "train/dog/notes.txt": None,  # not an image: skipped
    "empty/nothing.png": (0, 0, 0),  # a root with no class folder
    "broken/cat/bad.png": b"not a png",
    "noimages/cat/notes.txt": None,
}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    import fsspec

    with moto_s3_server(BUCKET) as endpoint, pytest.MonkeyPatch.context() as patch:
        for name, value in environment(endpoint).items():
            patch.setenv(name, value)
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        for key, content in IMAGES.items():
            if content is None:
                data = b"text"
            elif isinstance(content, bytes):
                data = content
            else:
                data = png_bytes(content)
            fs.pipe(f"{BUCKET}/{key}", data)
        yield endpoint


def to_tensor(image) -> torch.Tensor:
    """What torchvision's ToTensor does, with numpy: CHW floats in [0, 1]."""
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)


def test_classes_samples_and_items_as_torchvision_image_folder(s3):
    dataset = S3ImageFolder(BUCKET, "train", transform=to_tensor)
    assert dataset.classes == ["cat", "dog", "zebra"]
    assert dataset.class_to_idx == {"cat": 0, "dog": 1, "zebra": 2}
    assert dataset.samples == [
        ("s3://images/train/cat/1.PNG", 0),
        ("s3://images/train/cat/2.png", 0),
        ("s3://images/train/dog/4.png", 1),
        ("s3://images/train/dog/nested/3.png", 1),
        ("s3://images/train/zebra/a.png", 2),
    ]
    assert dataset.targets == [0, 0, 1, 1, 2] and len(dataset) == 5
    image, label = dataset[3]
    assert label == 1 and image.shape == (3, 4, 6)
    assert torch.allclose(image[1], torch.full((4, 6), 30 / 255.0))
    # Without a transform: an RGB PIL image, as torchvision's default loader gives.
    plain = S3ImageFolder(BUCKET, "train/", target_transform=lambda t: t * 10)
    image, label = plain[4]
    assert (image.mode, image.size, image.getpixel((0, 0)), label) == (
        "RGB",
        (6, 4),
        (250,) * 3,
        20,
    )


def test_batches_through_a_dataloader_with_worker_processes(s3):
    dataset = S3ImageFolder(BUCKET, "train", transform=to_tensor)
    copy = pickle.loads(pickle.dumps(dataset))  # travels without its open filesystem
    assert copy.samples == dataset.samples
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=5, num_workers=2, multiprocessing_context="fork"
    )
    [(images, labels)] = list(loader)
    assert images.shape == (5, 3, 4, 6) and labels.tolist() == [0, 0, 1, 1, 2]
    assert images[:, 0].amax(dim=(1, 2)).mul(255).round().tolist() == [20, 10, 0, 0, 250]


def test_the_fsspec_form_takes_any_url(s3, tmp_path):
    from_url = S3ImageFolder.from_url(
        f"s3://{BUCKET}/train",
        storage_options={"endpoint_url": s3, "key": "test", "secret": "test"},
    )
    assert from_url.classes == ["cat", "dog", "zebra"] and len(from_url) == 5
    for name, colour in (("b/x.png", (1, 2, 3)), ("a/y.png", (4, 5, 6))):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(png_bytes(colour))
    local = FsspecImageFolder(str(tmp_path))
    assert local.class_to_idx == {"a": 0, "b": 1}
    assert local[1][0].getpixel((0, 0)) == (1, 2, 3)
    assert FsspecImageFolder(f"file://{tmp_path}").samples[0][0] == f"file://{tmp_path}/a/y.png"


def test_bad_input_says_what_is_wrong(s3):
    with pytest.raises(
        InvalidInput, match="No class folders under s3://images/empty.*<class>/<image>"
    ):
        S3ImageFolder(BUCKET, "empty")
    with pytest.raises(InvalidInput, match="No class folders under s3://images/no-such-prefix"):
        S3ImageFolder(BUCKET, "no-such-prefix")
    with pytest.raises(InvalidInput, match="s3://no-such-bucket/train cannot be listed.*bucket"):
        S3ImageFolder("no-such-bucket", "train")
    with pytest.raises(InvalidInput, match=r"No images in the class folder\(s\) \['cat'\]"):
        S3ImageFolder(BUCKET, "noimages")
    with pytest.raises(InvalidInput, match="bucket must be an S3 bucket name"):
        S3ImageFolder("s3://images", "train")
    broken = S3ImageFolder(BUCKET, "broken")
    with pytest.raises(
        InvalidInput, match=r"bad.png \(sample 0, class 'cat'\) cannot be read by Pillow"
    ):
        broken[0]
