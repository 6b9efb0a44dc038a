"""Importance of each trainable tensor for ElasticTrainer: the first-order loss decrease of one probe step."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from .measure import batch_loss
from .state import TrainingSnapshot

__all__ = ["tensor_importance"]


def tensor_importance(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                      loss_fn: Callable[[Any, Any], torch.Tensor], names: Sequence[str]) -> list[float]:
    """First-order loss decrease ``-sum(g * delta_w)`` of each named tensor over one probe step.

    ``g`` is the gradient on ``batch`` and ``delta_w`` the update the optimizer makes from it (all named
    tensors trainable for the probe). A positive value means the update lowers the loss. Everything
    the probe touches (parameters, gradients, flags, buffers, optimizer state, RNG) is restored
    bit-exactly afterwards.

    Args:
        model: the model.
        optimizer: its optimizer (the probe takes one real step with it).
        batch: the probe batch ``(inputs, target)``.
        loss_fn: ``loss_fn(output, target) -> scalar``.
        names: parameter names (as in ``model.named_parameters()``) to score.

    Returns:
        One importance per name (0 for tensors the loss does not reach).
    """
    by_name = dict(model.named_parameters())
    tensors = [by_name[n] for n in names]
    with TrainingSnapshot(model, optimizer):
        for p in model.parameters():
            p.grad = None
        for p in tensors:
            p.requires_grad_(True)
        batch_loss(model, batch, loss_fn).backward()
        grads = [None if p.grad is None else p.grad.detach().clone() for p in tensors]
        before = [p.detach().clone() for p in tensors]
        optimizer.step()
        return [0.0 if g is None else -float((g.double() * (p.detach().double() - b.double())).sum())
                for p, g, b in zip(tensors, grads, before)]
