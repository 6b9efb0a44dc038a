"""Bit-exact snapshot and restore of everything a probe step can touch: parameters, gradients,
``requires_grad`` flags, buffers (BatchNorm statistics), optimizer state and hyper-parameters, and RNG.

ElasticTrainer's importance probe and the timing measurements run real forward, backward and optimizer
steps on the user's model and optimizer; :class:`TrainingSnapshot` puts all of it back so that training
continues exactly as if they had never run.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["TrainingSnapshot"]


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


class TrainingSnapshot:
    """A copy of the training state of a model and (optionally) its optimizer.

    Use as ``snap = TrainingSnapshot(model, optimizer)`` ... ``snap.restore()``, or as a context manager
    that restores on exit. Parameters and buffers are restored in place (same tensor objects, so the
    optimizer's references stay valid); gradients, optimizer state and RNG are restored to equal values.

    Not covered: optimizer step hooks registered by the user run during a probe step (they see it), and
    state held outside the model, the optimizer and torch's RNGs (e.g. an LR scheduler, which a probe
    step does not advance anyway).

    Args:
        model: the model whose parameters, gradients, flags and buffers are saved.
        optimizer: the optimizer whose state and param-group hyper-parameters are saved, or None.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self._model = model
        self._optimizer = optimizer
        self._params = [(p, p.detach().clone(), None if p.grad is None else p.grad.detach().clone(),
                         p.requires_grad) for p in _unique_params(model, optimizer)]
        self._buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self._rng_cpu = torch.get_rng_state()
        self._rng_cuda = (torch.cuda.get_rng_state_all()
                          if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
        self._opt_state: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        self._opt_groups: list[dict[str, Any]] = []
        self._opt_attrs: dict[str, Any] = {}
        if optimizer is not None:
            for p, st in optimizer.state.items():
                self._opt_state[id(p)] = (p, {k: _clone(v) for k, v in st.items()})
            self._opt_groups = [{k: _clone(v) for k, v in g.items() if k != "params"}
                                for g in optimizer.param_groups]
            self._opt_attrs = {k: v for k, v in vars(optimizer).items() if k in ("_opt_called",)}

    def restore(self) -> None:
        """Put every saved value back (idempotent: may be called more than once)."""
        with torch.no_grad():
            for p, value, grad, flag in self._params:
                p.copy_(value)
                p.grad = None if grad is None else grad.clone()
                p.requires_grad_(flag)
            for b, value in self._buffers:
                b.copy_(value)
        torch.set_rng_state(self._rng_cpu)
        if self._rng_cuda is not None:
            torch.cuda.set_rng_state_all(self._rng_cuda)
        opt = self._optimizer
        if opt is None:
            return
        for p in list(opt.state.keys()):
            if id(p) not in self._opt_state:
                del opt.state[p]
        for p, st in self._opt_state.values():
            opt.state[p] = {k: _clone(v) for k, v in st.items()}
        for group, saved in zip(opt.param_groups, self._opt_groups):
            for k in [k for k in group if k != "params" and k not in saved]:
                del group[k]
            group.update({k: _clone(v) for k, v in saved.items()})
        for k in ("_opt_called",):
            if k in self._opt_attrs:
                setattr(opt, k, self._opt_attrs[k])
            elif hasattr(opt, k) and k in vars(opt):
                delattr(opt, k)

    def __enter__(self) -> "TrainingSnapshot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def _unique_params(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Parameters of the model and of the optimizer (which may hold extra ones), each once."""
    seen: set[int] = set()
    out = []
    extra = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    for p in [*model.parameters(), *extra]:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
