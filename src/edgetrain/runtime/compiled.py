"""Compiled execution (opt-in, ``PlanConfig(compile=True)``): the model's forward and backward run as
``torch.compile`` (TorchInductor) code where the plan keeps every activation.

A plan that recomputes nothing has nothing for edgetrain's stages to do: the model's own forward runs, and
TorchInductor's fused kernels run it faster than eager PyTorch (MobileNetV2 at 64x64 on one CPU core: 0.23
against 0.29 s a step). What the compiled step holds is not what the plan predicted for eager kernels (its
partitioner chooses what to save, and the compiler's own modules and generated code stay resident), so it is
never taken on trust: the planner (:mod:`edgetrain.planning.compiled`) runs real compiled steps in forks and
takes the compiled step only where their measured peak fits the budget.

Compiled, a step computes what the eager step computes up to floating-point rounding (fused kernels sum in
another order); dropout draws through PyTorch's own random functions (``fallback_random``), so masks are the
eager step's. The compiler runs in this process (``compile_threads=1``) so that its memory is the process's
and measured. Only the shapes the trial ran are compiled (``dynamic=False``): a micro-batch of another size
(an epoch's short last batch) runs the step's eager executor, and nothing is compiled unmeasured.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..capture.modules import replay_kwargs

__all__ = ["CompiledExecutor", "compiled_forward", "shape_key", "INDUCTOR_OPTIONS"]

#: TorchInductor settings for every compiled step: the compiler in this process (its memory measured with the
#: step's), dropout through PyTorch's own random functions (the eager step's masks)
INDUCTOR_OPTIONS = {"compile_threads": 1, "fallback_random": True}


def compiled_forward(model: Any) -> Any:
    """``torch.compile(model)`` as compiled steps run it (imports TorchInductor: tens of MiB resident)."""
    import torch

    return torch.compile(model, dynamic=False)


def shape_key(env: dict[str, Any]) -> tuple[Any, ...]:
    """What compiled code is specialised on in a micro-batch's inputs: each tensor's name, shape and dtype."""
    return tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in env.items() if hasattr(v, "shape")))


class CompiledExecutor:
    """Runs the model's compiled forward on micro-batches shaped as the measured compiled steps' were
    (``shapes``: :func:`shape_key` of each), ``eager`` (the step's own executor for the plan) on any other."""

    pager = None

    def __init__(self, model: Any, compiled: Any, shapes: set[tuple[Any, ...]], eager: Any,
                 ratio: float | None = None) -> None:
        self.model = model
        self.compiled = compiled
        self.shapes = set(shapes)
        self.eager = eager
        self.ratio = ratio

    def context(self) -> contextlib.ExitStack:
        """The compiler's settings, around a whole step: the backward compiles at its first run, outside the
        forward. ``ratio``: ``torch._functorch.config.activation_memory_budget`` (None: PyTorch's default)."""
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        stack = contextlib.ExitStack()
        stack.enter_context(inductor_config.patch(INDUCTOR_OPTIONS))
        if self.ratio is not None:
            stack.enter_context(functorch_config.patch(activation_memory_budget=self.ratio))
        return stack

    def forward(self, env: dict[str, Any]) -> Any:
        """Run the model on ``env`` (its inputs by name, one micro-batch); returns its output."""
        if shape_key(env) not in self.shapes:
            return self.eager.forward(env)
        return self.compiled(**{**env, **replay_kwargs(self.model, env)})
