"""Data specs of the command line: image folders, CSV / NumPy files, datasets saved to disk, dataset factories.

Every loader returns a :class:`LoadedData`: map-style datasets of ``(input, target)`` samples plus what the
model factory needs to know (classes, input channels). File formats are read whole into memory: this is
for the data sets that fit on the device being trained on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from ..errors import ConfigError

__all__ = ["LoadedData", "load_data", "IMAGE_SUFFIXES"]

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
_HF_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")


@dataclass(frozen=True)
class LoadedData:
    """A loaded data set.

    Attributes:
        train: the samples to train on.
        val: samples to evaluate on (None: none came with the data).
        num_classes: classes of a classification target (for regression: the number of outputs).
        in_channels: channels of image inputs (None for other inputs).
        task: ``"classification"`` or ``"regression"``.
        classes: class names, where the data names them (image folders: the subfolder names).
    """

    train: Dataset
    val: Dataset | None
    num_classes: int | None
    in_channels: int | None
    task: str
    classes: tuple[str, ...] = ()


def _targets(y: np.ndarray, task: str) -> tuple[torch.Tensor, str, int]:
    whole = np.issubdtype(y.dtype, np.integer) or bool(np.all(np.isfinite(y)) and np.all(np.mod(y, 1) == 0))
    if task == "auto":
        task = "classification" if whole and y.ndim == 1 else "regression"
    if task == "classification":
        if not whole or y.ndim != 1 or (y.size and y.min() < 0):
            raise ConfigError("classification targets must be one column of whole numbers >= 0 (set "
                              "task: regression for real-valued targets)")
        t = torch.as_tensor(y.astype(np.int64))
        return t, task, int(t.max()) + 1 if t.numel() else 0
    t = torch.as_tensor(y.astype(np.float32))
    t = t.unsqueeze(1) if t.dim() == 1 else t
    return t, task, int(t.shape[1])


def _table(arr: np.ndarray, target_column: int, task: str, source: str) -> LoadedData:
    if arr.ndim != 2 or arr.shape[1] < 2:
        raise ConfigError(f"{source}: expected a 2-D table with feature columns and a target column, got shape "
                          f"{arr.shape}")
    col = target_column % arr.shape[1]
    y = arr[:, col]
    x = np.delete(arr, col, axis=1).astype(np.float32)
    t, task, k = _targets(y, task)
    return LoadedData(TensorDataset(torch.as_tensor(x), t), None, k, None, task)


def _csv(path: Path, target_column: int, task: str) -> LoadedData:
    with open(path) as f:
        first = f.readline()
    try:
        [float(v) for v in first.strip().split(",")]
        skip = 0
    except ValueError:
        skip = 1  # a header row
    try:
        arr = np.loadtxt(path, delimiter=",", skiprows=skip, ndmin=2)
    except ValueError as e:
        raise ConfigError(f"{path}: not a numeric CSV table ({e})") from None
    return _table(arr, target_column, task, str(path))


def _npz(path: Path, task: str) -> LoadedData:
    with np.load(path) as z:
        names = list(z.keys())
        pairs = [("x", "y"), ("inputs", "targets"), ("features", "labels"), ("images", "labels")]
        pair = next((p for p in pairs if p[0] in names and p[1] in names), None)
        if pair is None:
            raise ConfigError(f"{path}: expected arrays named x and y (or inputs/targets, features/labels, "
                              f"images/labels); found {', '.join(names)}")
        x, y = z[pair[0]], z[pair[1]]
    if len(x) != len(y):
        raise ConfigError(f"{path}: {len(x)} inputs but {len(y)} targets")
    t, task, k = _targets(y, task)
    xt = torch.as_tensor(x.astype(np.float32))
    return LoadedData(TensorDataset(xt, t), None, k, int(xt.shape[1]) if xt.dim() == 4 else None, task)


def _read_image(path: Path, size: int, channels: int) -> np.ndarray:
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


def _image_folder(root: Path, size: int, channels: int) -> LoadedData:
    if channels not in (1, 3):
        raise ConfigError(f"channels must be 1 or 3 for image folders, got {channels}")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise ConfigError(f"{root} has no class subfolders: an image folder holds one subfolder of images per "
                          "class")
    xs, ys = [], []
    for label, name in enumerate(classes):
        files = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES + (".npy",))
        for p in files:
            xs.append(_read_image(p, size, channels))
            ys.append(label)
    if not xs:
        raise ConfigError(f"no images found under {root} (looked for {', '.join(IMAGE_SUFFIXES)}, .npy)")
    x = torch.as_tensor(np.stack(xs))
    mean, std = x.mean(dim=(0, 2, 3), keepdim=True), x.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    x = (x - mean) / std  # per-channel standardisation over the folder
    log.info("image folder %s: %d images of %d classes", root, len(xs), len(classes))
    return LoadedData(TensorDataset(x, torch.tensor(ys)), None, len(classes), channels, "classification",
                      tuple(classes))


def _hf_disk(root: Path, task: str) -> LoadedData:
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError:
        raise ConfigError(f"{root} is a Hugging Face dataset: reading it needs pip install datasets") from None
    ds = load_from_disk(str(root))
    val = None
    if isinstance(ds, DatasetDict):
        train = ds["train"] if "train" in ds else ds[next(iter(ds))]
        val = next((ds[k] for k in ("validation", "val", "test") if k in ds), None)
    else:
        train = ds
    cols = train.column_names
    label = next((c for c in ("label", "labels", "target", "y") if c in cols), None)
    inp = next((c for c in ("pixel_values", "input_ids", "features", "x", "image") if c in cols), None)
    if label is None or inp is None:
        raise ConfigError(f"{root}: need an input column (pixel_values, input_ids, features, x) and a label column "
                          f"(label, labels, target, y); found {', '.join(cols)}")

    def to_tensors(d: Any) -> tuple[torch.Tensor, np.ndarray]:
        d = d.with_format("numpy")
        return torch.as_tensor(np.asarray(d[inp]).astype(np.float32)), np.asarray(d[label])

    x, y = to_tensors(train)
    t, task, k = _targets(y, task)
    val_ds = None
    if val is not None:
        vx, vy = to_tensors(val)
        val_ds = TensorDataset(vx, _targets(vy, task)[0])
    return LoadedData(TensorDataset(x, t), val_ds, k, int(x.shape[1]) if x.dim() == 4 else None, task)


def _factory(spec: str, kwargs: Mapping[str, Any], task: str) -> LoadedData:
    from .models import resolve_import

    fn = resolve_import(spec, "data")
    out = fn(**kwargs) if callable(fn) and not isinstance(fn, Dataset) else fn
    train, val = (out["train"], out.get("val")) if isinstance(out, Mapping) else \
        (out if isinstance(out, tuple) and len(out) == 2 else (out, None))
    if not hasattr(train, "__getitem__") or not hasattr(train, "__len__"):
        raise ConfigError(f"data factory {spec!r} must return a map-style dataset (or a (train, val) pair)")
    classes = getattr(train, "classes", None)
    first_x, first_y = train[0]
    if isinstance(first_y, torch.Tensor) and first_y.is_floating_point() or isinstance(first_y, float):
        k = int(torch.as_tensor(first_y).numel())
        task = "regression"
    else:
        k = len(classes) if classes is not None else max(int(train[i][1]) for i in range(len(train))) + 1
        task = "classification"
    chans = int(first_x.shape[0]) if isinstance(first_x, torch.Tensor) and first_x.dim() == 3 else None
    return LoadedData(train, val, k, chans, task, tuple(map(str, classes or ())))


def _mnist(size: int, seed: int) -> LoadedData:
    from ..data import load_mnist

    digits = load_mnist(seed=seed)

    def tensors(images: torch.Tensor) -> torch.Tensor:
        x = ((images.float() - digits.mean) / digits.std).unsqueeze(1)
        if size != x.shape[-1]:
            x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        return x

    return LoadedData(TensorDataset(tensors(digits.train_images), digits.train_labels),
                      TensorDataset(tensors(digits.test_images), digits.test_labels), len(digits.classes), 1,
                      "classification", tuple(map(str, digits.classes)))


def load_data(spec: str, *, kwargs: Mapping[str, Any] | None = None, image_size: int = 32, channels: int = 3,
              target_column: int = -1, task: str = "auto", seed: int = 0) -> LoadedData:
    """Load the data a spec names (see the module doc).

    Raises:
        ConfigError: the path does not exist, the format is unknown or malformed, or an optional package
            the format needs is missing.
    """
    if spec == "mnist":
        return _mnist(image_size, seed)
    path = Path(spec)
    if path.is_dir():
        if any((path / m).exists() for m in _HF_MARKERS):
            return _hf_disk(path, task)
        return _image_folder(path, image_size, channels)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".csv":
            return _csv(path, target_column, task)
        if suffix == ".npy":
            return _table(np.load(path), target_column, task, str(path))
        if suffix == ".npz":
            return _npz(path, task)
        raise ConfigError(f"data file {path}: unknown format {suffix!r} (use .csv, .npy, .npz, an image folder, a "
                          "dataset saved with save_to_disk, or a factory 'pkg.module:make')")
    if ":" in spec and not path.exists() and not spec.startswith(("/", ".")):
        return _factory(spec, kwargs or {}, task)
    raise ConfigError(f"data {spec!r} does not exist (give a folder, a .csv/.npy/.npz file, 'mnist' or an import "
                      "path 'pkg.module:make')")
