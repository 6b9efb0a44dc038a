"""A federated task from the specs ``edgetrain train`` takes: your model factory and your data, split across
the clients (``edgetrain fl simulate --model my_models:build --data my_images``).

Every process (the server, each simulated node) loads the data from its spec and draws the same split and
shards from the same seed, as the bundled task does; nothing but the spec strings travels to the nodes, so a
factory module in the working directory is imported where it runs (the directory is put on ``sys.path``
first). The held-out part (the data's own validation split, else ``val_fraction`` of it) is evaluated
centrally after every round: accuracy and cross-entropy for a classification, mean squared error for a
regression.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
from flwr.app import Context
from torch import nn
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate, random_split

from ..batch import call_model
from ..losses import TokenCrossEntropyLoss
from ..spec.lm import TASK as LM_TASK
from ..spec.lm import load_lm_data
from .client import ClientData
from .partition import partition
from .settings import ClientSettings

__all__ = ["SpecTask", "load_spec_task", "spec_model_fn", "spec_data_fn", "spec_loss_fn", "evaluate_spec"]


@dataclass(frozen=True)
class SpecTask:
    """What to federate, as strings and numbers (hashable: every process loads it once).

    Attributes:
        model: a model spec (``pkg.module:build``, an in-project model, ``hf:NAME``).
        data: a data spec (an image folder, a table, a saved Hugging Face dataset, ``pkg.module:make``).
        model_kwargs: the factory's keyword arguments, as JSON.
        image_size: image folders: side in pixels.
        channels: image folders: 3 or 1.
        target_column: tables: the target column, by index or name.
        max_length: text: tokens per text at most.
        val_fraction: share held out for the server's evaluation where the data brings no validation split.
        seed: seed of the held-out split, the shards, the batch order and the initial model.
        cwd: the directory factory modules are imported from (the one the run was started in).
        task: ``"language-modeling"``: ``data`` is text (a .txt of documents, .jsonl, .csv, a saved dataset) a
            Hugging Face causal LM (``model: hf:DIR``) learns to continue, in blocks of ``max_length`` tokens;
            None: classification or regression, as the data says.
    """

    model: str
    data: str
    model_kwargs: str = "{}"
    image_size: int = 32
    channels: int = 3
    target_column: int | str = -1
    max_length: int = 128
    val_fraction: float = 0.2
    seed: int = 0
    cwd: str = field(default_factory=os.getcwd)
    task: str | None = None


@dataclass(frozen=True)
class LoadedTask:
    """A :class:`SpecTask` loaded: the training samples, their labels (for the shards), the held-out samples
    and the data's description (classes, channels, features, task)."""

    train: Dataset
    labels: np.ndarray
    test: Dataset
    info: Any


def _importable(task: SpecTask) -> None:
    if task.cwd not in sys.path:
        sys.path.insert(0, task.cwd)


def _labels(ds: Dataset) -> np.ndarray:
    """The targets of every sample, read without decoding the inputs where the data set holds them apart."""
    if isinstance(ds, Subset):
        return _labels(ds.dataset)[np.asarray(ds.indices)]
    for attr in ("targets", "labels"):
        t = getattr(ds, attr, None)
        if isinstance(t, torch.Tensor):
            return t.numpy()
    if isinstance(ds, TensorDataset):
        return ds.tensors[1].numpy()
    return np.asarray([np.asarray(ds[i][1]) for i in range(len(ds))])  # type: ignore[arg-type]


@functools.lru_cache(maxsize=4)
def load_spec_task(task: SpecTask) -> LoadedTask:
    """Load the data, and split off the held-out part (the same in every process).

    Raises:
        ConfigError: the data spec is bad (see :func:`edgetrain.spec.load_data`), or too small to split.
    """
    from ..errors import ConfigError
    from ..spec import load_data

    _importable(task)
    text_model = task.model[3:] if task.model.startswith("hf:") else None
    if text_model is not None:
        from ..spec.models import hf_reads_images

        text_model = None if hf_reads_images(text_model) else text_model
    if task.task == LM_TASK:
        info = load_lm_data(task.data, text_model, task.max_length)
    else:
        info = load_data(task.data, image_size=task.image_size, channels=task.channels,
                         target_column=task.target_column, seed=task.seed, text_model=text_model,
                         max_length=task.max_length)
    train, test = info.train, info.val
    if test is None:
        n_test = max(1, int(len(train) * task.val_fraction))
        if n_test >= len(train):
            raise ConfigError(f"{task.data}: {len(train)} samples cannot be split into training and held-out parts")
        train, test = random_split(train, [len(train) - n_test, n_test],
                                   generator=torch.Generator().manual_seed(task.seed))
    # blocks of text have no class to skew the shards by: they are split IID, as a regression's rows are
    labels = np.zeros(len(train), np.int64) if info.task == LM_TASK else _labels(train)
    return LoadedTask(train, labels, test, info)


def spec_model_fn(task: SpecTask) -> Callable[[], nn.Module]:
    """Builds the task's model (the global arrays are loaded into it afterwards)."""

    def model_fn() -> nn.Module:
        from ..spec import build_model

        info = load_spec_task(task).info
        torch.manual_seed(task.seed)
        return build_model(task.model, json.loads(task.model_kwargs), num_classes=info.num_classes,
                           in_channels=info.in_channels, image_size=task.image_size, in_features=info.in_features,
                           task=info.task)
    return model_fn


def spec_loss_fn(task: SpecTask) -> Callable[..., torch.Tensor]:
    """Cross-entropy for a classification, mean squared error for a regression, the next-token cross-entropy
    over the tokens that count for language modelling."""
    kind = load_spec_task(task).info.task
    if kind == LM_TASK:
        return TokenCrossEntropyLoss(shift=True)
    return nn.functional.mse_loss if kind == "regression" else nn.functional.cross_entropy


def _batches(ds: Dataset, idx: np.ndarray, batch_size: int, seed: int, client: int, epoch: int
             ) -> Iterator[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(hash((seed, client, epoch)) & 0x7FFFFFFF)
    order = torch.as_tensor(idx)[torch.randperm(len(idx), generator=g)].tolist()
    for start in range(0, len(order) - batch_size + 1, batch_size):  # full batches: the planned shape
        yield default_collate([ds[i] for i in order[start:start + batch_size]])


def spec_data_fn(task: SpecTask, scheme: str = "iid", alpha: float = 0.5
                 ) -> Callable[[Context, ClientSettings], ClientData]:
    """The ``data_fn`` of :func:`edgetrain.fl.client_app`: node ``partition-id``'s shard of the training part
    (label-skewed with ``scheme="dirichlet"``; a regression is split IID)."""

    def data_fn(context: Context, s: ClientSettings) -> ClientData:
        from ..errors import ConfigError

        loaded = load_spec_task(task)
        pid = int(context.node_config.get("partition-id", 0))
        n = int(context.node_config.get("num-partitions", 1))
        shard = _shards(task, n, scheme, alpha)[pid]
        if len(shard) < s.batch_size:
            raise ConfigError(f"node {pid}'s shard has {len(shard)} samples, fewer than one batch of "
                              f"{s.batch_size}: use a smaller batch size or fewer clients")
        num = (len(shard) // s.batch_size) * s.batch_size
        return ClientData(train=lambda epoch: _batches(loaded.train, shard, s.batch_size, task.seed, pid, epoch),
                          num_train=num)
    return data_fn


@functools.lru_cache(maxsize=8)
def _shards(task: SpecTask, n: int, scheme: str, alpha: float) -> tuple[np.ndarray, ...]:
    """The ``n`` shards of the task's training part (drawn once per process; a regression and language
    modelling are split IID)."""
    loaded = load_spec_task(task)
    if loaded.info.task in ("regression", LM_TASK):
        return tuple(partition(np.zeros(len(loaded.labels), np.int64), n, "iid", alpha=alpha, seed=task.seed))
    return tuple(partition(loaded.labels.astype(np.int64), n, scheme, alpha=alpha, seed=task.seed))


def evaluate_spec(task: SpecTask, model: nn.Module, batch_size: int = 64) -> tuple[float, float]:
    """``(accuracy, loss)`` of ``model`` on the held-out part, without gradients and in eval mode (accuracy is
    NaN for a regression, whose loss is the mean squared error, and for language modelling, whose loss is the
    mean over every counted token: its exponential is the perplexity)."""
    from .._state import modes_kept

    loaded = load_spec_task(task)
    kind = loaded.info.task
    loss_fn = spec_loss_fn(task)
    total, correct, n = 0.0, 0, 0.0
    with modes_kept(model), torch.no_grad():
        model.eval()
        for start in range(0, len(loaded.test), batch_size):
            x, y = default_collate([loaded.test[i] for i in range(start, min(start + batch_size, len(loaded.test)))])
            out = call_model(model, x)
            # a token-mean loss weighs each batch by its counted tokens; the others by their samples
            k = loss_fn.target_weight(y) if isinstance(loss_fn, TokenCrossEntropyLoss) else len(y)
            if k:
                total += float(loss_fn(out, y)) * k
            if kind == "classification":
                correct += int((out.argmax(1) == y).sum())
            n += k
    return (correct / max(n, 1) if kind == "classification" else math.nan), total / max(n, 1)
