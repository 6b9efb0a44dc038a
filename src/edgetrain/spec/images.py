"""Image folders: one subfolder of images per class, resized, scaled to [0, 1] and standardised per channel.

The decoded images of a folder are kept in memory when they fit ``cache_bytes`` (float32); a larger folder
is read from disk as samples are drawn (a DataLoader's ``num_workers`` read in parallel), so the data set
never takes more memory than the device has for it. Either way the per-channel mean and std come from one
pass over every image (or are given: a validation folder takes its training folder's, a pretrained model
its image processor's).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from ..errors import ConfigError

__all__ = ["IMAGE_SUFFIXES", "ImageFiles", "read_image", "image_folder"]

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")

#: decoded images (float32) kept in memory up to this many bytes by default
DEFAULT_CACHE_BYTES = 256 << 20


def read_image(path: Path, size: int, channels: int) -> np.ndarray:
    """One image as float32 ``[channels, size, size]``: a picture scaled to [0, 1], a ``.npy`` array as is.

    Raises:
        ConfigError: an unreadable file, a ``.npy`` of another channel count, Pillow missing.
    """
    if path.suffix.lower() == ".npy":
        img = np.load(path).astype(np.float32)
        img = img[None] if img.ndim == 2 else img
        if img.shape[0] != channels:
            raise ConfigError(f"{path}: array image has {img.shape[0]} channels, channels is {channels}")
        t = torch.nn.functional.interpolate(torch.as_tensor(img)[None], size=(size, size), mode="bilinear",
                                            align_corners=False)[0]
        return t.numpy()
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError("reading image files needs Pillow: pip install 'edgetrain[images]' (or store each "
                          "image as a .npy array [C, H, W])") from None
    try:
        with Image.open(path) as im:
            im = im.convert("RGB" if channels == 3 else "L").resize((size, size), Image.BILINEAR)
            arr = np.asarray(im, dtype=np.float32) / 255.0
    except OSError as e:
        raise ConfigError(f"cannot read image {path}: {e}") from None
    return arr.transpose(2, 0, 1) if arr.ndim == 3 else arr[None]


class ImageFiles(Dataset):
    """Samples ``(image, label)`` read from disk on each access and standardised per channel."""

    def __init__(self, files: Sequence[Path], labels: Sequence[int], size: int, channels: int,
                 mean: Sequence[float], std: Sequence[float]) -> None:
        self.files, self.labels = list(files), torch.as_tensor(list(labels), dtype=torch.int64)
        self.size, self.channels = size, channels
        self.mean = torch.tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).reshape(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.from_numpy(read_image(self.files[i], self.size, self.channels))
        return (x - self.mean) / self.std, self.labels[i]


def _files(root: Path, classes: Sequence[str]) -> tuple[list[Path], list[int]]:
    files, labels = [], []
    for label, name in enumerate(classes):
        if not (root / name).is_dir():
            continue  # a validation folder may lack a class
        found = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES + (".npy",))
        files.extend(found)
        labels.extend([label] * len(found))
    return files, labels


def image_folder(root: Path, size: int, channels: int, classes: Sequence[str] | None = None,
                 stats: Mapping[str, Any] | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 ) -> tuple[Dataset, tuple[str, ...], dict[str, Any]]:
    """The samples of an image folder, its classes and its preprocessing (size, scale, mean, std).

    Args:
        root: the folder (``root/<class>/**/<image>``).
        size: images are resized to ``size x size``.
        channels: 3 (RGB) or 1 (grey).
        classes: the class names in label order (a validation folder: its training folder's; a subfolder
            not among them is an error); None: the subfolders, sorted.
        stats: per-channel ``mean`` and ``std`` to standardise with; None (or without them): the folder's.
        cache_bytes: keep the decoded images in memory up to this size; a larger folder is read from disk.

    Raises:
        ConfigError: no class subfolders, no images, a class the training data lacks, an unreadable image.
    """
    if channels not in (1, 3):
        raise ConfigError(f"channels must be 1 or 3 for image folders, got {channels}")
    found = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not found:
        raise ConfigError(f"{root} has no class subfolders: an image folder holds one subfolder of images per "
                          "class")
    if classes:
        unknown = sorted(set(found) - set(classes))
        if unknown:
            raise ConfigError(f"{root} has classes the training data does not have: {', '.join(unknown[:5])}")
    names = tuple(classes) if classes else tuple(found)
    files, labels = _files(root, names)
    if not files:
        raise ConfigError(f"no images found under {root} (looked for {', '.join(IMAGE_SUFFIXES)}, .npy)")
    cache = len(files) * channels * size * size * 4 <= cache_bytes
    kept: list[np.ndarray] = []
    total = np.zeros(channels)
    squares = np.zeros(channels)
    for p in files:  # one pass: the statistics, and the images themselves where they fit
        img = read_image(p, size, channels)
        total += img.sum(axis=(1, 2), dtype=np.float64)
        squares += np.square(img, dtype=np.float64).sum(axis=(1, 2))
        if cache:
            kept.append(img)
    if stats and "mean" in stats:
        mean, std = [float(v) for v in stats["mean"]], [float(v) for v in stats["std"]]
    else:
        n = len(files) * size * size
        m = total / n
        var = np.maximum(squares - n * m * m, 0.0) / max(n - 1, 1)
        sd = np.sqrt(var)
        mean, std = m.tolist(), np.where(sd < 1e-6, 1.0, sd).tolist()  # a constant channel is only centred
    pre = {"kind": "image", "size": size, "channels": channels, "scale": 1 / 255, "mean": mean, "std": std}
    log.info("image folder %s: %d images of %d classes (%s)", root, len(files), len(names),
             "in memory" if cache else "read from disk per sample")
    if not cache:
        return ImageFiles(files, labels, size, channels, mean, std), names, pre
    x = torch.as_tensor(np.stack(kept))
    x = (x - torch.tensor(mean, dtype=x.dtype).reshape(1, -1, 1, 1)) / torch.tensor(std, dtype=x.dtype).reshape(
        1, -1, 1, 1)
    return TensorDataset(x, torch.tensor(labels)), names, pre
