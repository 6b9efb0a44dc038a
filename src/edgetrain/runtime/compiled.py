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
eager step's, and every random draw is computed once, in the forward (:func:`random_draws_saved`: a partitioner
told to save less recomputes what is cheap, random draws included, and a recomputed draw is a new mask). The
compiler runs in this process (``compile_threads=1``) so that its memory is the process's and measured. Only
the shapes the trial ran are compiled (``dynamic=False``): a micro-batch of another size (an epoch's short last
batch) runs the step's eager executor, and nothing is compiled unmeasured.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from ..capture.modules import replay_kwargs

__all__ = ["CompiledExecutor", "compiled_forward", "shape_key", "INDUCTOR_OPTIONS", "random_draws_saved",
           "inductor_options"]

#: TorchInductor settings for every compiled step: the compiler in this process (its memory measured with the
#: step's), dropout through PyTorch's own random functions (the eager step's masks); with
#: :func:`random_draws_saved` as the joint graph's last pass (:func:`inductor_options`)
INDUCTOR_OPTIONS = {"compile_threads": 1, "fallback_random": True}


@functools.lru_cache(maxsize=1)
def random_draws_saved() -> Any:
    """A TorchInductor joint-graph pass that forbids recomputing a random draw in the backward.

    PyTorch's partitioner keeps random ops out of the backward at its default setting, but below it
    (``activation_memory_budget`` < 1) it may recompute any op it banned, dropout's ``rand_like`` or a
    ``bernoulli_`` included, and the backward then draws other masks than the forward used (a BERT with dropout 0.2
    at 0.5: gradients 78% apart from the eager step's; 2e-7 with this pass). The pass marks every op PyTorch tags
    ``nondeterministic_seeded`` as one to save, the mark the partitioner itself gives ops it must not recompute;
    the partitioner may still save what the draw feeds (a mask) instead. Its ``uuid`` is this file's hash, so the
    compiler's caches tell compiles with it from compiles without it and from another version of it.
    """
    import torch
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
    from torch.utils.checkpoint import CheckpointPolicy

    class RandomDrawsSaved(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            for node in graph.nodes:
                target = node.target
                if (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
                        and torch.Tag.nondeterministic_seeded in target.tags):
                    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE

        def uuid(self) -> bytes:
            return get_hash_for_files((__file__,))

    return RandomDrawsSaved()


def inductor_options() -> dict[str, Any]:
    """:data:`INDUCTOR_OPTIONS` and :func:`random_draws_saved` after any joint-graph pass already set, for
    ``torch._inductor.config.patch``."""
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import get_custom_graph_passes

    ours = random_draws_saved()
    passes = tuple(p for p in get_custom_graph_passes(inductor_config.joint_custom_post_pass) if p is not ours)
    return {**INDUCTOR_OPTIONS, "joint_custom_post_pass": list(passes + (ours,)) if passes else ours}


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
        stack.enter_context(inductor_config.patch(inductor_options()))
        if self.ratio is not None:
            stack.enter_context(functorch_config.patch(activation_memory_budget=self.ratio))
        return stack

    def forward(self, env: dict[str, Any]) -> Any:
        """Run the model on ``env`` (its inputs by name, one micro-batch); returns its output."""
        if shape_key(env) not in self.shapes:
            return self.eager.forward(env)
        return self.compiled(**{**env, **replay_kwargs(self.model, env)})
