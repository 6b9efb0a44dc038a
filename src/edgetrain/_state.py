"""Snapshots that let edgetrain run a model (profiling, probing) and leave no trace on it."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

__all__ = ["preserved_model_state", "rng_state", "set_rng_state", "batchnorm_modules"]


def rng_state() -> dict[str, object]:
    """The CPU (and, if initialised, CUDA) random number generator states."""
    state: dict[str, object] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, object]) -> None:
    torch.set_rng_state(state["cpu"])  # type: ignore[arg-type]
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])  # type: ignore[arg-type]


def batchnorm_modules(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    """BatchNorm layers of ``model`` that update running statistics when trained."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


@contextlib.contextmanager
def preserved_model_state(model: nn.Module, *, grads: bool = True) -> Iterator[None]:
    """Run code on ``model`` and restore its buffers, gradients and the RNG afterwards, bit for bit.

    Parameters are not copied (profiling never steps an optimizer); buffers (BatchNorm running statistics)
    are, since any training-mode forward updates them.
    """
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    saved_grads = [(p, p.grad) for p in model.parameters()] if grads else []
    rng = rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for b, copy in buffers:
                b.copy_(copy)
        for p, g in saved_grads:
            p.grad = g
        set_rng_state(rng)
