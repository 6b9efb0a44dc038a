"""Epochs of training data in a reproducible order: per-epoch shuffle seeds, and skipping to a position."""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, RandomSampler

from ..batch import batch_size_of, split_batch
from ..errors import InputError

__all__ = ["shuffle_seed", "epoch_batches", "num_batches", "as_pair"]


def shuffle_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s shuffle: depends only on the Trainer seed and the epoch number."""
    return (int(seed) * 1_000_003 + int(epoch)) % (2**63)


def _epoch_source(data: Any, epoch: int, seed: int) -> Iterable[Any]:
    if isinstance(data, DataLoader):
        # RandomSampler draws its permutation from its generator, and each DataLoader iterator draws the
        # workers' base seed from the loader's: both are set from the epoch alone, so the order (and the
        # workers' augmentation RNG) of epoch e is the same in a run resumed in a new process.
        s = shuffle_seed(seed, epoch)
        if isinstance(data.sampler, RandomSampler):
            data.sampler.generator = torch.Generator().manual_seed(s)
        data.generator = torch.Generator().manual_seed(s ^ 0x5EED)
        sampler = getattr(data, "sampler", None)
        if hasattr(sampler, "set_epoch"):  # DistributedSampler and the like
            sampler.set_epoch(epoch)
        return data
    if hasattr(data, "set_epoch"):
        data.set_epoch(epoch)
        return data
    if callable(data) and not hasattr(data, "__iter__"):
        return data(epoch)  # a factory: epoch -> iterable of batches
    return data


def epoch_batches(data: Any, epoch: int, seed: int, skip: int = 0) -> Iterator[Any]:
    """The batches of epoch ``epoch``, the first ``skip`` of them consumed and dropped.

    Args:
        data: a DataLoader, any re-iterable of batches, an object with ``set_epoch``, or a callable
            ``epoch -> iterable``.
        epoch: the epoch number (0-based).
        seed: the Trainer's shuffle seed.
        skip: batches already trained on in this epoch (resume).
    """
    it = iter(_epoch_source(data, epoch, seed))
    if skip:
        consumed = sum(1 for _ in itertools.islice(it, skip))
        if consumed < skip:
            raise InputError(f"the checkpoint is {skip} batches into epoch {epoch}, but the training data has "
                             f"only {consumed}: resume with the data the run was started with")
    return it


def num_batches(data: Any) -> int | None:
    """Batches per epoch, where the data knows (``len``), else None."""
    try:
        return len(data)
    except TypeError:
        return None


def short_batch_size(data: Any, full: int) -> int | None:
    """The size of the short last batch of an epoch of ``data`` (a DataLoader keeping its last batch, or a
    list of batches), where it can be known without drawing a batch; None otherwise or when there is none."""
    if isinstance(data, DataLoader):
        if data.batch_size != full or data.drop_last:
            return None
        try:
            rest = len(data.dataset) % full  # type: ignore[arg-type]
        except TypeError:
            return None
        return rest or None
    if isinstance(data, (list, tuple)) and data:
        try:
            n = batch_size_of(*as_pair(data[-1]))
        except Exception:  # noqa: BLE001 - a batch the step will refuse with its own message
            return None
        return n if n < full else None
    return None


def as_pair(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch (see :func:`edgetrain.batch.split_batch`)."""
    return split_batch(batch)
