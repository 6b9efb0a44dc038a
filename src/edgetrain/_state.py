"""Snapshots that let edgetrain run a model (profiling, probing) and leave no trace on it."""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

__all__ = ["preserved_model_state", "put_back", "rng_state", "set_rng_state", "rng_moved", "host_rng_state",
           "set_host_rng_state", "host_rng_moved", "batchnorm_modules", "autocast_state", "describe_autocast",
           "backward_outside_autocast"]

_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, str], ...]:
    """The ``torch.autocast`` regions in force on this thread, as ``(device type, dtype)`` pairs (empty: none)."""
    return tuple((d, str(torch.get_autocast_dtype(d)).replace("torch.", "")) for d in _AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(d))


def describe_autocast(state: tuple[tuple[str, str], ...]) -> str:
    return ", ".join(f"torch.autocast({d!r}, dtype=torch.{t})" for d, t in state) or "no torch.autocast"


@contextlib.contextmanager
def backward_outside_autocast() -> Iterator[None]:
    """Run a backward as PyTorch's mixed-precision recipe does, outside any autocast region: on CPU the engine
    runs backward on the calling thread, where an enclosing autocast would cast the backward's own matmuls
    again (0.5% off a bfloat16 BERT's gradients). Recomputed forwards still run under the autocast state
    their checkpoint recorded."""
    with contextlib.ExitStack() as stack:
        for device, _ in autocast_state():
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


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


def host_rng_state() -> tuple[Any, Any]:
    """NumPy's and Python's global random states. A forward may draw from them (Hugging Face's speech models
    mask time steps with ``np.random``); recomputation cannot replay them, but analysis must not move them."""
    return np.random.get_state(), random.getstate()


def set_host_rng_state(state: tuple[Any, Any]) -> None:
    np.random.set_state(state[0])
    random.setstate(state[1])


def rng_moved(before: dict[str, object], after: dict[str, object]) -> bool:
    """Whether torch's CPU (or a CUDA) generator drew between two :func:`rng_state` snapshots."""
    return any(not torch.equal(a, b) if isinstance(a, torch.Tensor) else
               any(not torch.equal(x, y) for x, y in zip(a, b))  # type: ignore[call-overload]
               for a, b in ((before[k], after[k]) for k in before))


def host_rng_moved(before: tuple[Any, Any], after: tuple[Any, Any]) -> bool:
    """Whether NumPy's or Python's global generator drew between two :func:`host_rng_state` snapshots."""
    (_, keys_a, pos_a, *_), (_, keys_b, pos_b, *_) = before[0], after[0]
    return pos_a != pos_b or not np.array_equal(keys_a, keys_b) or before[1] != after[1]


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


@contextlib.contextmanager
def modes_kept(model: nn.Module) -> Iterator[None]:
    """Put every module's training flag back as it was on leaving (a model may mix training and eval
    submodules: a frozen backbone's BatchNorm left in eval mode; ``model.train(flag)`` would flatten them)."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, t in flags:
            m.training = t


def batchnorm_modules(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    """BatchNorm layers of ``model`` that update running statistics when trained."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


def put_back(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` into ``buffer`` in place, resizing it first where it was resized in place since (an
    observer's per-channel statistics are empty until its first batch). Call under ``torch.no_grad()``."""
    if buffer.shape != value.shape:
        buffer.resize_(value.shape)
    buffer.copy_(value)


@contextlib.contextmanager
def preserved_model_state(model: nn.Module, *, grads: bool = True, host_rngs: bool = True) -> Iterator[None]:
    """Run code on ``model`` and restore its buffers, gradients and the RNG (the global generators and those
    its modules hold) afterwards, bit for bit.

    ``host_rngs=False`` leaves NumPy's and Python's generators as the code left them: what a recomputation
    replays (torch's generators only), for a check that two runs replay alike.

    Parameters are not copied (profiling never steps an optimizer); buffers (BatchNorm running statistics)
    are, since any training-mode forward updates them: each is put back as the object it was (a forward
    may assign its module a new tensor), in its shape (or resize it in place) and values.
    """
    buffers = [(m, name, b, b.detach().clone()) for m in model.modules() for name, b in m._buffers.items()
               if b is not None]
    saved_grads = [(p, p.grad) for p in model.parameters()] if grads else []
    rng = rng_state()
    host = host_rng_state() if host_rngs else None
    generators = [(g, g.get_state()) for g in module_generators(model)]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, b, copy in buffers:
                if m._buffers.get(name) is not b:  # reassigned, not written in place
                    m._buffers[name] = b
                put_back(b, copy)
        for p, g in saved_grads:
            p.grad = g
        set_rng_state(rng)
        if host is not None:
            set_host_rng_state(host)
        for gen, state in generators:
            gen.set_state(state)
