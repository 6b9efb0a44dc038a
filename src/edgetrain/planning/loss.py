"""How a loss is normalised, so that micro-batch losses add up to the loss of the whole batch.

Micro-batching runs ``loss_fn`` on each slice of the batch and backpropagates the slices one by one; the
gradients equal the full batch's only if each slice's loss is weighted by what it contributes to the full
batch's loss. That depends on the loss's reduction, which :func:`loss_normalisation` finds out before any
training by evaluating the loss on a few samples of the example batch, whole and split:

* a **mean over samples** (``reduction="mean"``, the usual case): a slice weighs its share of samples;
* a **sum** (``reduction="sum"``): every slice weighs 1;
* a **weighted mean over targets** (``nn.CrossEntropyLoss`` / ``nn.NLLLoss`` with class weights or an
  ``ignore_index``: the mean is over the weights of the targets that count, e.g. the non-padding tokens):
  a slice weighs its targets' total weight over the batch's, read from the targets of every batch;
* anything else (a normaliser that depends on the batch in a way edgetrain cannot see) is **opaque**:
  the step is then never split, and a budget that needs micro-batching is refused with that reason.

A loss that is not a scalar (``reduction="none"``) is refused with the fix to make.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .._state import preserved_model_state
from ..batch import slice_batch
from ..errors import InputError

__all__ = ["LossNorm", "loss_normalisation"]

log = logging.getLogger(__name__)

MEAN, SUM, WEIGHTED, OPAQUE = "mean", "sum", "weighted", "opaque"


@dataclass(frozen=True)
class LossNorm:
    """How the loss of a batch is made from the losses of its slices.

    Attributes:
        kind: ``"mean"``, ``"sum"``, ``"weighted"`` or ``"opaque"`` (see the module docstring).
        loss_fn: the loss (for ``"weighted"``: its class weights and ignored index are read from it).
    """

    kind: str
    loss_fn: Any = None

    @property
    def splittable(self) -> bool:
        """Whether micro-batches can reproduce the full batch's gradients exactly."""
        return self.kind != OPAQUE

    def weight(self, targets: Any, size: int) -> float:
        """What a slice of ``size`` samples with ``targets`` contributes to the batch's normaliser."""
        if self.kind == WEIGHTED:
            t = targets
            mask = t != self.loss_fn.ignore_index
            w = self.loss_fn.weight
            if w is None:
                return float(mask.sum())
            return float((w[t.clamp_min(0)] * mask).sum())
        return float(size)

    def scale(self, slice_weight: float, total_weight: float) -> float:
        """The factor a slice's loss is multiplied by before its backward."""
        if self.kind == SUM:
            return 1.0
        return slice_weight / total_weight if total_weight else 0.0

    def combine(self, losses: list[tuple[float, float]], total_weight: float) -> float:
        """The batch's loss from ``(slice loss, slice weight)`` pairs."""
        if self.kind == SUM:
            return sum(v for v, _ in losses)
        return sum(v * w for v, w in losses) / total_weight if total_weight else 0.0


def _target_weighted(loss_fn: Any, targets: Any) -> bool:
    return (isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and loss_fn.reduction == "mean"
            and isinstance(targets, torch.Tensor) and not targets.is_floating_point())


def _loss_value(model: nn.Module, env: dict[str, Any], loss_fn: Callable[..., torch.Tensor], targets: Any,
                start: int, stop: int) -> torch.Tensor:
    with preserved_model_state(model):  # each evaluation sees the buffers as they are now
        out = model(**{k: slice_batch(v, start, stop) for k, v in env.items()})
        return loss_fn(out, slice_batch(targets, start, stop))


def loss_normalisation(model: nn.Module, env: dict[str, Any], loss_fn: Callable[..., torch.Tensor], targets: Any,
                       batch: int, rtol: float = 1e-4) -> LossNorm:
    """Find how ``loss_fn`` normalises, on the first (at most) three samples of the example batch.

    The model runs in eval mode (dropout off, BatchNorm on its running statistics: every sample on its
    own) without gradients, and its buffers, gradients, training flags and the RNG are restored after.

    Raises:
        InputError: the loss is not a scalar tensor.
    """
    n = min(batch, 3)
    flags = [(m, m.training) for m in model.modules()]
    with torch.no_grad():
        model.eval()
        try:
            whole = _loss_value(model, env, loss_fn, targets, 0, n)
            _check_scalar(whole)
            if n < 2:
                return LossNorm(MEAN)
            cut = 1
            a = _loss_value(model, env, loss_fn, targets, 0, cut)
            b = _loss_value(model, env, loss_fn, targets, cut, n)
        finally:
            for m, t in flags:
                m.training = t
    if _target_weighted(loss_fn, targets):
        return LossNorm(WEIGHTED, loss_fn)
    whole_v, a_v, b_v = float(whole), float(a), float(b)
    tol = rtol * max(abs(whole_v), abs(a_v), abs(b_v), 1e-12) + 1e-7
    if abs(whole_v - (a_v * cut + b_v * (n - cut)) / n) <= tol:
        return LossNorm(MEAN)
    if abs(whole_v - (a_v + b_v)) <= tol:
        return LossNorm(SUM)
    log.info("loss over %d samples is %.6g, over %d and %d samples %.6g and %.6g: neither their mean nor their "
             "sum", n, whole_v, cut, n - cut, a_v, b_v)
    return LossNorm(OPAQUE)


def _check_scalar(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputError(f"loss_fn must return a scalar tensor, got {shape}. Use reduction='mean' (or 'sum'), "
                         "or reduce it yourself, e.g. loss_fn=lambda out, y: F.cross_entropy(out, y, "
                         "reduction='none').mean()")
