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


def module_generators(*modules: nn.Module) -> list[torch.Generator]:
    """The ``torch.Generator`` objects held as attributes by ``modules`` or their submodules (a layer that
    draws its own masks or noise from a private generator), each once."""
    found: dict[int, torch.Generator] = {}
    for root in modules:
        for m in root.modules():
            for v in vars(m).values():
                if isinstance(v, torch.Generator):
                    found.setdefault(id(v), v)
    return list(found.values())


def batchnorm_modules(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    """BatchNorm layers of ``model`` that update running statistics when trained."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


@contextlib.contextmanager
def preserved_model_state(model: nn.Module, *, grads: bool = True) -> Iterator[None]:
    """Run code on ``model`` and restore its buffers, gradients and the RNG (the global generators and those
    its modules hold) afterwards, bit for bit.

    Parameters are not copied (profiling never steps an optimizer); buffers (BatchNorm running statistics)
    are, since any training-mode forward updates them.
    """
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    saved_grads = [(p, p.grad) for p in model.parameters()] if grads else []
    rng = rng_state()
    generators = [(g, g.get_state()) for g in module_generators(model)]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, copy in buffers:
                b.copy_(copy)
        for p, g in saved_grads:
            p.grad = g
        set_rng_state(rng)
        for gen, state in generators:
            gen.set_state(state)
