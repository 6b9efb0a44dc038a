"""`prepare()` and `TrainStep`: one exact optimizer step over a logical batch, inside a memory budget."""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass
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
from ._state import preserved_model_state
from .profile import optimizer_costs, profile_chain
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


@dataclass(frozen=True)
class _Measured:
    """One validation run, in bytes above the import baseline."""

    rss_before: int
    peak: int
    rss_after: int


def _validate(chain: Any, plan: Plan, model: nn.Module, env_full: dict[str, Any], targets: Any,
              loss_fn: Callable[..., torch.Tensor]) -> _Measured:
    """Run one forward/backward of every micro-batch of ``plan`` (model state restored) and measure it."""
    executor = Executor(chain, plan)
    sizes = micro_batch_sizes(plan.batch_size, plan.micro_batch_size)
    base = memory.baseline_rss_bytes()
    with preserved_model_state(model):
        memory.reset_peak()
        before = memory.rss_bytes()
        start = 0
        for size in sizes:
            env = {k: slice_batch(v, start, start + size) for k, v in env_full.items()}
            loss = loss_fn(executor.forward(env), slice_batch(targets, start, start + size))
            (loss * (size / plan.batch_size)).backward()
            del loss, env
            start += size
        peak = memory.peak_rss_bytes()
    return _Measured(before - base, peak - base, memory.rss_bytes() - base)


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
    opt_costs = optimizer_costs(optimizer)
    fixed = in_use + _grad_bytes_missing(model) + opt_costs.state_bytes
    margin = 0 if budget is None else int(budget * safety_margin)
    plan_budget = None if budget is None else budget - margin
    env = bind_inputs(model, inputs)
    chain = capture(model, slice_batch(inputs, 0, min(batch, 2)), max_stages=max_stages)
    has_bn = any(m.training for _, m in batchnorm_modules(model))
    min_micro = 2 if has_bn and batch >= 2 else 1
    costs = profile_chain(chain, model, env, targets, loss_fn, batch_size=batch, fixed_bytes=fixed,
                          budget_bytes=plan_budget, use_cache=use_cache, name=name or type(model).__name__,
                          min_micro_batch=min_micro)
    overhead = max(0, memory.rss_bytes() - rss_start)
    costs = CostChain(costs.stages, batch, costs.input_bytes, fixed + overhead, costs.loss_s,
                      costs.step_fixed_s, costs.name)
    planner = _Planner(costs, budget, margin, solver, micro_batch_size, has_bn and exact_batchnorm, min_micro,
                       opt_costs.update_bytes)
    planner.reprofile = lambda b: profile_chain(
        chain, model, env, targets, loss_fn, batch_size=batch, fixed_bytes=costs.fixed_bytes, budget_bytes=b,
        use_cache=use_cache, name=name or type(model).__name__, min_micro_batch=min_micro)
    if plan_budget is None:
        plan = planner.plan(None)
    else:
        grads = _grad_bytes_missing(model)
        plan, costs = planner.plan_validated(lambda p: _validate(chain, p, model, env, targets, loss_fn),
                                             grads + opt_costs.state_bytes, grads)
    if has_bn and plan.num_micro_batches > 1:
        plan = plan.replace(bn_micro_batched=True)
        warnings.warn(f"{plan.num_micro_batches} micro-batches: BatchNorm normalises each micro-batch of "
                      f"{plan.micro_batch_size} with its own statistics, so gradients differ slightly from one "
                      "full-batch step (running statistics stay exact). Raise the budget to avoid it.",
                      stacklevel=2)
    log.info("edgetrain plan:\n%s", plan.summary())
    return TrainStep(model, optimizer, loss_fn, chain, costs, plan, budget_bytes=budget, margin_bytes=margin,
                     signature=batch_signature((inputs, targets)), solver=solver)


class _Planner:
    """Plans, validates plans by running them once, and names the smallest feasible budget when none fits.

    Validation measures what the cost model cannot see (kernel caches for new tensor shapes, allocator
    slack); the excess is added to the fixed bytes and the plan is made again, so the steps that follow
    stay inside the budget. The same correction applies to the smallest feasible budget a BudgetError
    names: it is the budget at which a plan was actually run and measured.
    """

    def __init__(self, costs: CostChain, budget: int | None, margin: int, solver: str,
                 micro_batch_size: int | None, prefer_full_batch: bool, min_micro: int, update_bytes: int) -> None:
        self.costs = costs
        self.budget = budget
        self.margin = margin
        self.solver = solver
        self.micro_batch_size = micro_batch_size
        self.prefer_full_batch = prefer_full_batch
        self.min_micro = min_micro
        self.update_bytes = update_bytes
        self.reprofile: Callable[[int], CostChain] | None = None

    def _with_fixed(self, extra: int) -> None:
        c = self.costs
        self.costs = CostChain(c.stages, c.batch_size, c.input_bytes, c.fixed_bytes + extra, c.loss_s,
                               c.step_fixed_s, c.name)

    def _sizes(self) -> list[list[int]]:
        b = self.costs.batch_size
        if self.micro_batch_size is not None:
            return [[min(self.micro_batch_size, b)]]
        lo = min(self.min_micro, b)  # and no trailing micro-batch smaller than that (BatchNorm needs 2)
        sizes = [m for m in _candidate_sizes(b) if m >= lo and (b % m == 0 or b % m >= lo)]
        return [[b], sizes] if self.prefer_full_batch else [sizes]

    def _min_needed(self) -> int:
        """Smallest plan budget for the current cost model."""
        try:
            self._solve(0)
        except BudgetError as e:
            return int(e.min_feasible_bytes or 0)
        return 0

    def _solve(self, plan_budget: int) -> Plan:
        from .planners import solve

        update_peak = self.costs.fixed_bytes + self.update_bytes
        err: BudgetError | None = None
        for cand in self._sizes():
            try:
                plan = solve(self.costs, plan_budget, solver=self.solver, micro_batch_sizes=cand)
            except BudgetError as e:
                err = e
                continue
            if update_peak <= plan_budget:
                return plan.replace(peak_bytes=max(plan.peak_bytes, update_peak), budget_bytes=self.budget)
            err = BudgetError("the optimizer update does not fit", min_feasible_bytes=plan.peak_bytes)
            break
        assert err is not None
        need = max(update_peak, int(err.min_feasible_bytes or 0))
        raise BudgetError(str(err), budget_bytes=plan_budget, min_feasible_bytes=need)

    def plan(self, plan_budget: int | None) -> Plan:
        if plan_budget is None:
            from .planners import solve

            sizes = [self.micro_batch_size or self.costs.batch_size]
            return solve(self.costs, 2**62, solver=self.solver, micro_batch_sizes=sizes).replace(budget_bytes=None)
        return self._solve(plan_budget)

    def plan_validated(self, run: Callable[[Plan], _Measured], unallocated: int,
                       grads: int) -> tuple[Plan, CostChain]:
        """Plan, run the plan once, correct the cost model by what was measured, and re-plan if needed.

        Args:
            run: runs a plan's micro-batches once (no optimizer step) and measures resident memory.
            unallocated: bytes the real steps add that validation does not (gradients freed again
                afterwards, optimizer state not yet created).
            grads: gradient bytes allocated during validation.
        """
        assert self.budget is not None
        plan_budget = self.budget - self.margin
        for _ in range(4):
            try:
                plan = self._solve(plan_budget)
            except BudgetError as e:
                raise self._infeasible(e, run, unallocated, grads) from None
            if self._correct(plan, run(plan), unallocated, grads) <= plan_budget:
                return plan, self.costs
        try:
            return self._solve(plan_budget), self.costs
        except BudgetError as e:
            raise self._infeasible(e, run, unallocated, grads) from None

    def _correct(self, plan: Plan, m: _Measured, unallocated: int, grads: int) -> int:
        """Set the fixed bytes to what the process really holds, plus any activation under-prediction.

        Returns the plan's peak under the corrected model.
        """
        act_pred = int(plan.metadata.get("activation_peak_bytes", plan.peak_bytes - self.costs.fixed_bytes))
        act_meas = m.peak - m.rss_before - grads
        act_excess = max(0, act_meas - act_pred)
        fixed = m.rss_after + unallocated + act_excess
        log.info("validation: activations measured %.1f MiB vs %.1f predicted; fixed %.1f MiB (was %.1f)",
                 act_meas / 2**20, act_pred / 2**20, fixed / 2**20, self.costs.fixed_bytes / 2**20)
        self._with_fixed(fixed - self.costs.fixed_bytes)
        return max(fixed + act_pred, fixed + self.update_bytes)

    def _infeasible(self, err: BudgetError, run: Callable[[Plan], _Measured], unallocated: int,
                    grads: int) -> BudgetError:
        need = int(err.min_feasible_bytes or 0)
        # Do what a retry at the estimated budget would do (profile at the sizes it allows, run its plan once
        # and correct), twice, so that the number we name is one at which a fresh run really works.
        for _ in range(2):
            try:
                if self.reprofile is not None:
                    fixed = self.costs.fixed_bytes
                    self.costs = self.reprofile(int(need * 1.1))
                    self._with_fixed(max(0, fixed - self.costs.fixed_bytes))
                    need = self._min_needed()
                plan = self._solve(need)
                self._correct(plan, run(plan), unallocated, grads)
                need = self._min_needed()
            except BudgetError as e:
                log.debug("could not refine the smallest feasible budget: %s", e)
                break
        assert self.budget is not None
        # A fresh process profiling at larger sizes loads kernels for more tensor shapes than this failed
        # attempt did; keep 3% for that, so that a retry at the named budget succeeds.
        user_need = math.ceil(1.03 * need * self.budget / (self.budget - self.margin))
        hint = "" if self.micro_batch_size is None else " or let the planner choose micro_batch_size"
        return BudgetError(
            f"no {self.solver} plan trains this batch of {self.costs.batch_size} within "
            f"{format_bytes(self.budget)}: the smallest feasible budget is {format_bytes(user_need)} (the model, "
            f"its gradients, optimizer state, batch and runtime take {format_bytes(self.costs.fixed_bytes)} before "
            f"any activation). Raise memory_budget to at least that, or train a smaller batch{hint}.",
            budget_bytes=self.budget, min_feasible_bytes=user_need)
