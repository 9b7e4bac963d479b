"""Image folders on S3 or any fsspec filesystem, read as torch Datasets (no torchvision).

``S3ImageFolder(bucket, prefix)`` replaces dask-pytorch-ddp's dataset of the same name;
``FsspecImageFolder(url)`` takes any fsspec URL. Both read ``<root>/<class>/<image>`` as
torchvision's ``ImageFolder`` does: sorted class names, images at any depth below their
class folder, RGB PIL images (or what ``transform`` makes of them).
"""

from __future__ import annotations

import io
import os
import posixpath
from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset

from validation_service.errors import InvalidInput

__all__ = ["IMAGE_EXTENSIONS", "FsspecImageFolder", "S3ImageFolder"]

# torchvision's IMG_EXTENSIONS: the files ImageFolder takes for images.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class FsspecImageFolder(Dataset):
    """An image folder at any fsspec URL: ``<url>/<class>/<image>`` -> (image, class index).

    ``classes`` (sorted folder names) and ``class_to_idx`` are as torchvision's
    ``ImageFolder``; ``samples`` lists (URL, class index). Images are listed once, here;
    each ``dataset[i]`` reads one file, decodes it with Pillow as RGB, and applies
    ``transform`` (to the image) and ``target_transform`` (to the class index). The
    dataset pickles without its filesystem (DataLoader workers and Dask tasks open their
    own), so it is safe with ``multiprocessing_context="fork"`` too.
    """

    def __init__(
        self,
        url: str,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise InvalidInput(
                f"url must be a non-empty str such as 's3://bucket/images', got {url!r}"
            )
        if storage_options is not None and not isinstance(storage_options, dict):
            raise InvalidInput(
                f"storage_options must be a dict of fsspec options, got {storage_options!r}"
            )
        self.url = url.rstrip("/")
        self.transform = transform
        self.target_transform = target_transform
        self.storage_options = dict(storage_options or {})
        self.extensions = tuple(e.lower() for e in extensions)
        self._fs: Any = None
        self._fs_pid: int | None = None
        self.classes, self.class_to_idx, self._paths = self._list_images()
        fs = self._filesystem()
        self.samples = [(fs.unstrip_protocol(path), target) for path, target in self._paths]
        self.targets = [target for _, target in self._paths]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        path, target = self._paths[index]
        image = self._read_image(path, index)
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.url!r}: {len(self.samples)} images, "
            f"{len(self.classes)} classes)"
        )

    def __getstate__(self) -> dict[str, Any]:
        # A filesystem holds sockets and an event loop: each process opens its own.
        return {**self.__dict__, "_fs": None, "_fs_pid": None}

    # ------------------------------------------------------------------ reading
    def _filesystem(self):
        if self._fs is None or self._fs_pid != os.getpid():
            import fsspec

            self._fs, _ = fsspec.core.url_to_fs(self.url, **self.storage_options)
            self._fs_pid = os.getpid()
        return self._fs

    def _list_images(self) -> tuple[list[str], dict[str, int], list[tuple[str, int]]]:
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        root = root.rstrip("/")
        try:
            found = fs.find(root)
        except FileNotFoundError as exc:
            raise InvalidInput(
                f"{self.url} cannot be listed: {exc}. Check the bucket (or folder) name, "
                "and that these credentials (storage_options, or the AWS_* variables for "
                "S3) can list it."
            ) from None
        except PermissionError as exc:
            raise InvalidInput(
                f"{self.url} cannot be listed with these credentials ({exc}): give them "
                "list and read access, or pass storage_options=."
            ) from None
        by_class: dict[str, list[str]] = {}
        for path in sorted(found):
            parts = posixpath.relpath(path, root).split("/")
            if len(parts) < 2:
                continue  # a file directly under the root belongs to no class
            files = by_class.setdefault(parts[0], [])
            if path.lower().endswith(self.extensions):
                files.append(path)
        if not by_class:
            raise InvalidInput(
                f"No class folders under {self.url}: an image folder is laid out as "
                f"{self.url}/<class>/<image> (e.g. {self.url}/cat/1.png). Check the prefix."
            )
        empty = sorted(name for name, files in by_class.items() if not files)
        if empty:
            raise InvalidInput(
                f"No images in the class folder(s) {empty} under {self.url}: images end with "
                f"one of {', '.join(self.extensions)}. Remove those folders or pass "
                "extensions=."
            )
        classes = sorted(by_class)
        class_to_idx = {name: index for index, name in enumerate(classes)}
        paths = [(path, class_to_idx[name]) for name in classes for path in by_class[name]]
        return classes, class_to_idx, paths

    def _read_image(self, path: str, index: int):
        from PIL import Image, UnidentifiedImageError

        url = self.samples[index][0]
        try:
            data = self._filesystem().cat_file(path)
        except FileNotFoundError:
            raise InvalidInput(
                f"Image {url} (sample {index}) is gone: it was listed when the dataset was "
                "made. Make the dataset again after changing the folder."
            ) from None
        try:
            with Image.open(io.BytesIO(data)) as image:
                return image.convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise InvalidInput(
                f"Image {url} (sample {index}, class {self.classes[self.samples[index][1]]!r}) "
                f"cannot be read by Pillow ({exc}). Replace or remove the file."
            ) from None


class S3ImageFolder(FsspecImageFolder):
    """dask-pytorch-ddp's ``S3ImageFolder(bucket, prefix, transform)``, read through s3fs.

    Credentials and endpoint come from the usual AWS settings (``AWS_ACCESS_KEY_ID``,
    ``AWS_ENDPOINT_URL``, ``~/.aws``), or ``storage_options`` (s3fs's: ``key``,
    ``secret``, ``endpoint_url``, ...); ``anon=True`` reads a public bucket unsigned.
    ``S3ImageFolder.from_url(url)`` takes any fsspec URL.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        anon: bool = False,
        *,
        storage_options: dict[str, Any] | None = None,
        extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
    ) -> None:
        if not isinstance(bucket, str) or not bucket or "/" in bucket:
            raise InvalidInput(f"bucket must be an S3 bucket name, got {bucket!r}")
        if not isinstance(prefix, str):
            raise InvalidInput(f"prefix must be a str (a folder in the bucket), got {prefix!r}")
        self.s3_bucket, self.s3_prefix = bucket, prefix
        options = {**(storage_options or {}), **({"anon": True} if anon else {})}
        super().__init__(
            f"s3://{bucket}/{prefix.strip('/')}",
            transform,
            target_transform,
            storage_options=options,
            extensions=extensions,
        )

    # FsspecImageFolder itself, for any fsspec URL (``s3://``, ``gs://``, ``file://``, a path).
    from_url = staticmethod(FsspecImageFolder)
