"""Data specs of the command line: image folders, CSV / NumPy files, datasets saved to disk, dataset factories.

Every loader returns a :class:`LoadedData`: map-style datasets of ``(input, target)`` samples plus what the
model factory needs to know (classes, input channels). File formats are read whole into memory: this is
for the data sets that fit on the device being trained on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from ..errors import ConfigError
from .images import DEFAULT_CACHE_BYTES, IMAGE_SUFFIXES

__all__ = ["LoadedData", "load_data", "IMAGE_SUFFIXES"]

log = logging.getLogger(__name__)

#: whole-number targets with more classes than this are not taken for class indices without task: classification
MAX_AUTO_CLASSES = 1000
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
        classes: class names, where the data names them (image folders: the subfolder names; a table's
            target column of names).
        in_features: feature columns of a table (None for other inputs).
        preprocessing: what was done to the raw inputs, as JSON-able values (``kind``: image, table, text or
            other; per kind the size, scale, mean and std, column names, tokenizer and length), so that a
            trained model can be given new inputs the same way (``edgetrain train`` writes it beside the
            weights) and a validation set is prepared with the training set's numbers.
    """

    train: Dataset
    val: Dataset | None
    num_classes: int | None
    in_channels: int | None
    task: str
    classes: tuple[str, ...] = ()
    in_features: int | None = None
    preprocessing: Mapping[str, Any] = field(default_factory=dict)


def _targets(y: np.ndarray, task: str, classes: Sequence[str] = (), what: str = "the targets"
             ) -> tuple[torch.Tensor, str, int, tuple[str, ...]]:
    """Targets as a tensor, the task, the number of classes (or outputs) and the class names.

    A column of names is a classification target: class ``i`` is the ``i``-th name in sorted order, or in
    ``classes`` where they are given (a validation set takes its training set's; a name not among them is
    an error).
    """
    if y.dtype.kind in "OUS":
        if task == "regression":
            raise ConfigError(f"{what} hold names ({', '.join(map(repr, np.unique(y)[:3]))}, ...): a regression "
                              "target must be numbers")
        names = tuple(classes) or tuple(sorted(set(y.tolist())))
        index = {n: i for i, n in enumerate(names)}
        unknown = sorted(set(y.tolist()) - set(index))
        if unknown:
            raise ConfigError(f"{what} hold classes the training data does not have: "
                              f"{', '.join(map(repr, unknown[:5]))}")
        return torch.tensor([index[v] for v in y.tolist()], dtype=torch.int64), "classification", len(names), names
    whole = np.issubdtype(y.dtype, np.integer) or bool(np.all(np.isfinite(y)) and np.all(np.mod(y, 1) == 0))
    if task == "auto":
        task = "classification" if whole and y.ndim == 1 and (not y.size or y.min() >= 0) else "regression"
        if task == "classification" and y.size and int(y.max()) + 1 > MAX_AUTO_CLASSES:
            raise ConfigError(f"{what} are whole numbers up to {int(y.max())}: as class indices that is "
                              f"{int(y.max()) + 1} classes. Set task: regression if they are quantities, or task: "
                              "classification if they are class indices")
    if task == "classification":
        if not whole or y.ndim != 1 or (y.size and y.min() < 0):
            raise ConfigError(f"classification targets must be one column of whole numbers >= 0 or of class names "
                              f"(set task: regression for real-valued targets); {what} are not")
        t = torch.as_tensor(y.astype(np.int64))
        k = max(int(t.max()) + 1 if t.numel() else 0, len(classes))
        return t, task, k, tuple(classes)
    t = torch.as_tensor(y.astype(np.float32))
    t = t.unsqueeze(1) if t.dim() == 1 else t
    return t, task, int(t.shape[1]), ()


def _standardize(x: torch.Tensor, like: Mapping[str, Any] | None) -> tuple[torch.Tensor, list[float], list[float]]:
    """A table's feature columns standardised with their own mean and std, or with ``like``'s."""
    if like and "mean" in like:
        mean, std = torch.tensor(like["mean"], dtype=x.dtype), torch.tensor(like["std"], dtype=x.dtype)
    else:
        mean = x.mean(dim=0)
        std = x.std(dim=0).nan_to_num(1.0)
        std = torch.where(std < 1e-6, torch.ones_like(std), std)  # a constant column is only centred
    return (x - mean) / std, mean.tolist(), std.tolist()


def _table(arr: np.ndarray, target_column: int, task: str, source: str) -> LoadedData:
    if arr.ndim != 2 or arr.shape[1] < 2:
        raise ConfigError(f"{source}: expected a 2-D table with feature columns and a target column, got shape "
                          f"{arr.shape}")
    col = target_column % arr.shape[1]
    y = arr[:, col]
    x = np.delete(arr, col, axis=1).astype(np.float32)
    t, task, k, _ = _targets(y, task)
    return LoadedData(TensorDataset(torch.as_tensor(x), t), None, k, None, task, in_features=x.shape[1],
                      preprocessing={"kind": "table", "target_column": col})


def _csv(path: Path, target_column: int | str, task: str, text_model: str | None, max_length: int,
         standardize: bool, like: LoadedData | None) -> LoadedData:
    from .tables import read_table

    table = read_table(path, target_column, allow_text=text_model is not None)
    prior = like.preprocessing if like is not None else None
    t, task, k, classes = _targets(table.target, task, like.classes if like is not None else (),
                                   f"the target column {table.target_name!r}")
    common = {"target": table.target_name}
    if table.text is not None:
        from .text import TokenDataset, load_tokenizer, tokenize

        assert text_model is not None
        ids, mask = tokenize(load_tokenizer(text_model), table.text, max_length,
                             length=prior.get("length") if prior else None)
        pre = {"kind": "text", "text_column": table.text_name, "tokenizer": text_model,
               "max_length": max_length, "length": int(ids.shape[1]), **common}
        log.info("%s: %d texts as %d tokens each", path, len(ids), ids.shape[1])
        return LoadedData(TokenDataset(ids, mask, t), None, k, None, task, classes, None, pre)
    if text_model is not None:
        raise ConfigError(f"{path}: model hf:... reads text, and this table has no column of text (its columns "
                          f"are {', '.join(table.feature_names)}, {table.target_name})")
    x = torch.as_tensor(table.features)
    pre = {"kind": "table", "features": list(table.feature_names), **common}
    if standardize:
        x, mean, std = _standardize(x, prior)
        pre.update(mean=mean, std=std)
    return LoadedData(TensorDataset(x, t), None, k, None, task, classes, x.shape[1], pre)


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
    t, task, k, classes = _targets(y, task)
    xt = torch.as_tensor(x.astype(np.float32))
    return LoadedData(TensorDataset(xt, t), None, k, int(xt.shape[1]) if xt.dim() == 4 else None, task, classes,
                      int(xt.shape[1]) if xt.dim() == 2 else None, {"kind": "other"})


def _image_folder(root: Path, size: int, channels: int, like: LoadedData | None,
                  stats: Mapping[str, Any] | None, cache_bytes: int) -> LoadedData:
    from .images import image_folder

    # a validation folder takes the training folder's classes (a folder lacking one must not shift the labels
    # of those after it) and statistics; a pretrained model's image statistics come as ``stats``
    ds, classes, pre = image_folder(root, size, channels, like.classes if like is not None else None,
                                    like.preprocessing if like is not None else stats, cache_bytes)
    return LoadedData(ds, None, len(classes), channels, "classification", classes, None, pre)


def is_saved_dataset(root: Path) -> bool:
    """Whether folder ``root`` is a Hugging Face dataset written by ``save_to_disk``."""
    return any((root / m).exists() for m in _HF_MARKERS)


def saved_splits(root: Path) -> tuple[Any, Any]:
    """``(train, validation or None)`` of a dataset saved with ``save_to_disk`` (one split: train only).

    Raises:
        ConfigError: the ``datasets`` package is missing.
    """
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError:
        raise ConfigError(f"{root} is a Hugging Face dataset: reading it needs pip install datasets") from None
    ds = load_from_disk(str(root))
    if not isinstance(ds, DatasetDict):
        return ds, None
    return (ds["train"] if "train" in ds else ds[next(iter(ds))],
            next((ds[k] for k in ("validation", "val", "test") if k in ds), None))


def _hf_disk(root: Path, task: str, text_model: str | None, max_length: int, like: LoadedData | None
             ) -> LoadedData:
    train, val = saved_splits(root)
    cols = train.column_names
    label = next((c for c in ("label", "labels", "target", "y") if c in cols), None)
    inp = next((c for c in ("pixel_values", "input_ids", "features", "x", "text", "sentence") if c in cols), None)
    if label is None or inp is None:
        raise ConfigError(f"{root}: need an input column (pixel_values, input_ids, features, x, or text / sentence "
                          f"for a Hugging Face text model) and a label column (label, labels, target, y); found "
                          f"{', '.join(cols)}")
    names = getattr(train.features.get(label), "names", None)  # a ClassLabel column names its classes
    classes = tuple(names) if names else (like.classes if like is not None else ())
    if inp in ("text", "sentence"):
        return _hf_disk_text(root, train, val, inp, label, task, classes, text_model, max_length, like)

    def to_tensors(d: Any) -> tuple[torch.Tensor, torch.Tensor | None, np.ndarray]:
        d = d.with_format("numpy")
        raw = np.asarray(d[inp])
        if inp == "input_ids":  # token ids index an embedding: they stay integers, with their mask
            mask = np.asarray(d["attention_mask"]) if "attention_mask" in cols else np.ones_like(raw)
            return torch.as_tensor(raw.astype(np.int64)), torch.as_tensor(mask.astype(np.int64)), \
                np.asarray(d[label])
        return torch.as_tensor(raw.astype(np.float32)), None, np.asarray(d[label])

    def dataset(x: torch.Tensor, mask: torch.Tensor | None, t: torch.Tensor) -> Dataset:
        if mask is None:
            return TensorDataset(x, t)
        from .text import TokenDataset

        return TokenDataset(x, mask, t)

    x, mask, y = to_tensors(train)
    t, task, k, _ = _targets(y, task, classes)
    val_ds = None
    if val is not None:
        vx, vmask, vy = to_tensors(val)
        val_ds = dataset(vx, vmask, _targets(vy, task, classes)[0])
    kind = "text" if mask is not None else ("image" if x.dim() == 4 else "other")
    return LoadedData(dataset(x, mask, t), val_ds, k, int(x.shape[1]) if x.dim() == 4 else None, task, classes,
                      int(x.shape[1]) if x.dim() == 2 and mask is None else None,
                      {"kind": kind, "columns": [inp, label]})


def _hf_disk_text(root: Path, train: Any, val: Any, inp: str, label: str, task: str, classes: tuple[str, ...],
                  text_model: str | None, max_length: int, like: LoadedData | None) -> LoadedData:
    """A saved dataset of raw text: tokenized as a CSV's text column is (:mod:`edgetrain.spec.text`)."""
    if text_model is None:
        raise ConfigError(f"{root}: the column {inp!r} holds text: train it with a Hugging Face text model "
                          "(model: hf:NAME), whose tokenizer turns it into token ids")
    from .text import TokenDataset, load_tokenizer, tokenize

    tok = load_tokenizer(text_model)
    prior = like.preprocessing.get("length") if like is not None else None
    ids, mask = tokenize(tok, [str(t) for t in train[inp]], max_length, length=prior)
    t, task, k, classes = _targets(np.asarray(train[label]), task, classes, f"the column {label!r}")
    val_ds = None
    if val is not None:
        vids, vmask = tokenize(tok, [str(t) for t in val[inp]], max_length, length=int(ids.shape[1]))
        val_ds = TokenDataset(vids, vmask, _targets(np.asarray(val[label]), task, classes, f"the column {label!r}")[0])
    pre = {"kind": "text", "text_column": inp, "tokenizer": text_model, "max_length": max_length,
           "length": int(ids.shape[1]), "target": label}
    return LoadedData(TokenDataset(ids, mask, t), val_ds, k, None, task, classes, None, pre)


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
    feats = int(first_x.shape[0]) if isinstance(first_x, torch.Tensor) and first_x.dim() == 1 else None
    return LoadedData(train, val, k, chans, task, tuple(map(str, classes or ())), feats,
                      {"kind": "other", "factory": spec})


def _mnist(size: int, seed: int) -> LoadedData:
    from ..data import load_mnist

    digits = load_mnist(seed=seed)

    def tensors(images: torch.Tensor) -> torch.Tensor:
        x = ((images.float() - digits.mean) / digits.std).unsqueeze(1)
        if size != x.shape[-1]:
            x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        return x

    pre = {"kind": "image", "size": size, "channels": 1, "scale": 1.0, "mean": [digits.mean], "std": [digits.std]}
    return LoadedData(TensorDataset(tensors(digits.train_images), digits.train_labels),
                      TensorDataset(tensors(digits.test_images), digits.test_labels), len(digits.classes), 1,
                      "classification", tuple(map(str, digits.classes)), None, pre)


def load_data(spec: str, *, kwargs: Mapping[str, Any] | None = None, image_size: int = 32, channels: int = 3,
              target_column: int | str = -1, task: str = "auto", seed: int = 0, text_model: str | None = None,
              max_length: int = 128, standardize: bool = True, like: LoadedData | None = None,
              image_stats: Mapping[str, Any] | None = None, image_cache_bytes: int = DEFAULT_CACHE_BYTES
              ) -> LoadedData:
    """Load the data a spec names (see the module doc).

    Args:
        spec: the data spec.
        kwargs: keyword arguments of a dataset factory.
        image_size: image folders and mnist: images are resized to this many pixels a side.
        channels: image folders: 3 (RGB) or 1 (grey).
        target_column: CSV / .npy: the target's column, by index or (CSV with a header) by name.
        task: ``classification``, ``regression`` or ``auto``.
        seed: seed of mnist's split.
        text_model: the Hugging Face model a CSV's text column is tokenized for (None: the table must be
            numbers).
        max_length: text: at most this many tokens per text.
        standardize: CSV tables: standardise each feature column (image folders always are, per channel).
        like: the training set's data, when loading a validation set: its classes, statistics and sequence
            length are used, so the two sets are prepared alike.
        image_stats: image folders: the per-channel ``mean`` and ``std`` (of pixels scaled to [0, 1]) to
            standardise with instead of the folder's own (a pretrained model's image processor's).
        image_cache_bytes: image folders: keep the decoded images in memory up to this size; a larger folder
            is read from disk as samples are drawn.

    Raises:
        ConfigError: the path does not exist, the format is unknown or malformed, or an optional package
            the format needs is missing.
    """
    if spec == "mnist":
        return _mnist(image_size, seed)
    path = Path(spec)
    if path.is_dir():
        if is_saved_dataset(path):
            return _hf_disk(path, task, text_model, max_length, like)
        return _image_folder(path, image_size, channels, like, image_stats, image_cache_bytes)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".csv", ".tsv", ".jsonl", ".json"):
            return _csv(path, target_column, task, text_model, max_length, standardize, like)
        if suffix == ".npy":
            return _table(np.load(path), int(target_column), task, str(path))
        if suffix == ".npz":
            return _npz(path, task)
        raise ConfigError(f"data file {path}: unknown format {suffix!r} (use .csv, .tsv, .jsonl, .json, .npy, .npz, "
                          "an image folder, a dataset saved with save_to_disk, or a factory 'pkg.module:make')")
    if ":" in spec and not path.exists() and not spec.startswith(("/", ".")):
        return _factory(spec, kwargs or {}, task)
    raise ConfigError(f"data {spec!r} does not exist (give a folder, a .csv/.npy/.npz file, 'mnist' or an import "
                      "path 'pkg.module:make')")
