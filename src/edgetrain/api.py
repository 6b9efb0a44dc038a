"""`prepare()` and `TrainStep`: one exact optimizer step over a logical batch, inside a memory budget."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Callable

import torch
from torch import nn

from . import memory
from ._state import batchnorm_modules
from .batch import batch_signature, batch_size_of, slice_batch
from .capture import bind_inputs, capture
from .errors import BudgetError, InputError
from .graph import CostChain, micro_batch_sizes
from .plan import Plan
from .profile import optimizer_state_bytes, profile_chain
from .runtime.batchnorm import FullBatchStats
from .runtime.executor import Executor
from .units import format_bytes, parse_bytes

__all__ = ["prepare", "TrainStep"]

log = logging.getLogger(__name__)


def _grad_bytes_missing(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None)


def _split_example(example: Any) -> tuple[Any, Any]:
    if not isinstance(example, (tuple, list)) or len(example) != 2:
        raise InputError("example must be a pair (inputs, targets), e.g. example=(x, y), with every tensor "
                         "batched on dim 0 like the batches you will train on")
    return example[0], example[1]


class TrainStep:
    """A prepared training step. Call it with a batch to run one optimizer step; read ``plan``.

    Created by :func:`prepare`; holds references (never copies) to the user's model and optimizer.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
                 chain: Any, costs: CostChain, plan: Plan, *, budget_bytes: int | None, margin_bytes: int,
                 signature: tuple[Any, ...], solver: str) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.chain = chain
        self.costs = costs
        self.budget_bytes = budget_bytes
        self.margin_bytes = margin_bytes
        self.solver = solver
        self._signature = signature
        self._bn = FullBatchStats(model)
        self._plan = plan
        self._executor = Executor(chain, plan, self._bn)
        self.steps_done = 0

    @property
    def plan(self) -> Plan:
        """The plan in force."""
        return self._plan

    def __repr__(self) -> str:
        return (f"TrainStep(stages={len(self.chain)}, micro_batch={self._plan.micro_batch_size}/"
                f"{self._plan.batch_size}, budget={self.budget_bytes})")

    def _check(self, inputs: Any, targets: Any) -> int:
        n = batch_size_of(inputs, targets)
        sig = batch_signature((inputs, targets))
        if sig != self._signature:
            raise InputError(f"batch does not match the example given to prepare(): per-sample "
                             f"(shape, dtype, device) {sig} vs {self._signature}. Prepare again with an example "
                             "shaped like this batch.")
        if n > self._plan.batch_size:
            raise InputError(f"batch of {n} samples is larger than the {self._plan.batch_size} the step was "
                             "prepared for (the budget was planned for that batch); prepare with a larger example")
        return n

    def __call__(self, inputs: Any, targets: Any) -> float:
        """One optimizer step over the whole batch; returns its mean loss.

        The batch is split into micro-batches of the plan; each micro-batch loss is weighted by its share
        of samples, so gradients equal those of the full batch.
        """
        n = self._check(inputs, targets)
        sizes = micro_batch_sizes(n, self._plan.micro_batch_size)
        env_full = bind_inputs(self.model, inputs)
        self.optimizer.zero_grad(set_to_none=True)
        accumulate = len(sizes) > 1 and self._bn.has_batchnorm
        self._bn.begin(accumulate)
        total = 0.0
        start = 0
        try:
            for size in sizes:
                env = {k: slice_batch(v, start, start + size) for k, v in env_full.items()}
                out = self._executor.forward(env)
                loss = self.loss_fn(out, slice_batch(targets, start, start + size))
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise InputError("loss_fn must return a scalar tensor (the mean loss over the batch it is "
                                     f"given), got {type(loss).__name__} {getattr(loss, 'shape', '')}")
                scaled = loss if len(sizes) == 1 else loss * (size / n)
                scaled.backward()
                total += float(loss.detach()) * size
                del out, loss, scaled, env
                start += size
        except BaseException:
            self._bn.abort()
            self.optimizer.zero_grad(set_to_none=True)
            raise
        self.optimizer.step()
        self._bn.finish()
        self.steps_done += 1
        return total / n

    def close(self) -> None:
        """Remove the hooks edgetrain put on the model."""
        self._bn.close()


def _candidate_sizes(batch: int) -> list[int]:
    return sorted({math.ceil(batch / k) for k in range(1, batch + 1)}, reverse=True)


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
            example: Any, memory_budget: int | str | None = None, *, micro_batch_size: int | None = None,
            solver: str = "dp", max_stages: int = 48, tune_allocator: bool = True, exact_batchnorm: bool = True,
            safety_margin: float = 0.03, use_cache: bool = True, name: str | None = None) -> TrainStep:
    """Measure ``model`` on this machine and plan an exact training step that fits ``memory_budget``.

    Args:
        model: any ``nn.Module``; trained in place (its parameters, buffers and state_dict keys are its own).
        optimizer: the optimizer over the model's parameters.
        loss_fn: ``loss_fn(output, targets)`` returning the mean loss over the samples it is given.
        example: ``(inputs, targets)``, one logical batch as it will be trained (tensor, tuple or dict of
            tensors batched on dim 0).
        memory_budget: bytes (int) or a size like ``"300MiB"``: the bound on peak resident memory above what
            the process used right after ``import edgetrain`` (see README, "What the budget bounds").
            None: no bound (plain training, no recomputation).
        micro_batch_size: fix the micro-batch size; None lets the planner choose.
        solver: planner name (``edgetrain.planners.PLANNERS``): "dp" (exact, default), "no_saving",
            "recompute_all", "chen_sqrt", "checkpoint_sequential".
        max_stages: upper bound on the number of stages the model is cut into.
        tune_allocator: fix glibc's mmap threshold so freed activations return to the OS (process-wide).
        exact_batchnorm: for models with BatchNorm in training mode, prefer plans without micro-batching
            (identical to plain PyTorch) and micro-batch only if no such plan fits.
        safety_margin: share of the budget held back for allocator noise.
        use_cache: reuse profiles measured earlier on this machine.
        name: model name for reports.

    Returns:
        The :class:`TrainStep`.

    Raises:
        BudgetError: no plan fits; ``min_feasible_bytes`` names the smallest budget that would.
        CaptureError: the model does not run on the example.
        InputError: the example is malformed.
    """
    inputs, targets = _split_example(example)
    batch = batch_size_of(inputs, targets)
    budget = None if memory_budget is None else parse_bytes(memory_budget)
    if not 0 <= safety_margin < 0.5:
        raise ValueError(f"safety_margin must be in [0, 0.5), got {safety_margin}")
    if micro_batch_size is not None and not 1 <= micro_batch_size:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if tune_allocator:
        memory.tune_allocator()
    rss_start = memory.rss_bytes()
    in_use = max(0, rss_start - memory.baseline_rss_bytes())
    fixed = in_use + _grad_bytes_missing(model) + optimizer_state_bytes(optimizer)
    margin = 0 if budget is None else int(budget * safety_margin)
    plan_budget = None if budget is None else budget - margin
    if plan_budget is not None and fixed >= plan_budget:
        need = math.ceil(fixed / (1 - safety_margin))
        raise BudgetError(
            f"the model, its gradients, optimizer state and the batch already need {format_bytes(fixed)}, "
            f"more than the budget {format_bytes(budget)} allows (after a {safety_margin:.0%} margin); "
            f"the smallest budget that could work is above {format_bytes(need)}",
            budget_bytes=budget, min_feasible_bytes=need)
    env = bind_inputs(model, inputs)
    chain = capture(model, slice_batch(inputs, 0, min(batch, 2)), max_stages=max_stages)
    costs = profile_chain(chain, model, env, targets, loss_fn, batch_size=batch, fixed_bytes=fixed,
                          budget_bytes=plan_budget, use_cache=use_cache, name=name or type(model).__name__)
    overhead = max(0, memory.rss_bytes() - rss_start)
    costs = CostChain(costs.stages, batch, costs.input_bytes, fixed + overhead, costs.loss_s,
                      costs.step_fixed_s, costs.name)
    has_bn = any(m.training for _, m in batchnorm_modules(model))
    plan = _plan(costs, plan_budget, budget, margin, solver, micro_batch_size, has_bn and exact_batchnorm)
    if has_bn and plan.num_micro_batches > 1:
        plan = plan.replace(bn_micro_batched=True)
        warnings.warn(f"{plan.num_micro_batches} micro-batches: BatchNorm normalises each micro-batch of "
                      f"{plan.micro_batch_size} with its own statistics, so gradients differ slightly from one "
                      "full-batch step (running statistics stay exact). Raise the budget to avoid it.",
                      stacklevel=2)
    log.info("edgetrain plan:\n%s", plan.summary())
    return TrainStep(model, optimizer, loss_fn, chain, costs, plan, budget_bytes=budget, margin_bytes=margin,
                     signature=batch_signature((inputs, targets)), solver=solver)


def _plan(costs: CostChain, plan_budget: int | None, budget: int | None, margin: int, solver: str,
          micro_batch_size: int | None, prefer_full_batch: bool) -> Plan:
    from .planners import solve

    if plan_budget is None:
        sizes = [micro_batch_size or costs.batch_size]
        return solve(costs, 2**62, solver=solver, micro_batch_sizes=sizes).replace(budget_bytes=None)
    sizes = [micro_batch_size] if micro_batch_size is not None else _candidate_sizes(costs.batch_size)
    attempts = [[costs.batch_size], sizes] if prefer_full_batch and micro_batch_size is None else [sizes]
    err: BudgetError | None = None
    for cand in attempts:
        try:
            plan = solve(costs, plan_budget, solver=solver, micro_batch_sizes=cand)
            return plan.replace(budget_bytes=budget)
        except BudgetError as e:
            err = e
    assert err is not None
    need = None if err.min_feasible_bytes is None else math.ceil((err.min_feasible_bytes + 1) * budget / plan_budget)
    hint = "" if micro_batch_size is None else " or let the planner choose micro_batch_size"
    raise BudgetError(
        f"no {solver} plan trains this batch of {costs.batch_size} within {format_bytes(budget)}: "
        f"the smallest feasible budget is {format_bytes(need) if need else 'unknown'}. Raise memory_budget to at "
        f"least that, use a smaller batch{hint}.", budget_bytes=budget, min_feasible_bytes=need) from err
