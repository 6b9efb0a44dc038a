"""Validation runs: a plan run once (forward and backward of every micro-batch), or whole training steps,
with the resident memory they take measured (used by prepare's planner, :mod:`._planning`), and the cost of a
micro-batch size's first run (:func:`first_run_cost`, used by a budget change)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
from torch import nn

from ..profile import memory
from .budgets import Measured, predicted_activations
from .._state import backward_outside_autocast, preserved_model_state
from ..batch import batch_size_of, slice_batch
from ..errors import InputError
from ..graph import run_micro_batch_sizes
from ..plan import Plan
from ..runtime import pool
from ..runtime.batchnorm import FullBatchStats
from ..runtime.executor import make_executor
from ..units import format_bytes

__all__ = ["run_plan", "run_steps", "first_run_cost"]

log = logging.getLogger("edgetrain.api")


def _samples(env: dict[str, Any], targets: Any) -> int | None:
    try:
        return batch_size_of(targets, *env.values())
    except InputError:
        return None


def _micro_batches(executor: Any, plan: Plan, env_full: dict[str, Any], targets: Any,
                   loss_fn: Callable[..., torch.Tensor], fused: Any = None, bn: Any = None) -> None:
    """Forward and backward of every micro-batch of ``plan``, each loss weighted by its share of samples;
    ``fused`` (a :class:`~edgetrain.runtime.fused.FusedUpdate`): armed around a whole batch's backward; ``bn``
    (the executor's :class:`~edgetrain.runtime.batchnorm.FullBatchStats`): told of each micro-batch, as the
    step tells it."""
    start = 0
    given = _samples(env_full, targets)  # a plan for fewer samples than the example runs its first ones
    for size in run_micro_batch_sizes(plan.batch_size, plan.micro_batch_size):
        if bn is not None:
            bn.micro_batch()
        # not sliced, as the step does not slice it (measured alike)
        whole = size == plan.batch_size and given in (None, size)
        env = dict(env_full) if whole else {k: slice_batch(v, start, start + size) for k, v in env_full.items()}
        loss = loss_fn(executor.forward(env), targets if whole else slice_batch(targets, start, start + size))
        with backward_outside_autocast(), fused.armed() if fused is not None and whole else contextlib.nullcontext():
            (loss * (size / plan.batch_size)).backward()
        del loss, env
        start += size
        if executor.pager is not None:
            executor.pager.reset()


def run_plan(chain: Any, plan: Plan, model: nn.Module, env_full: dict[str, Any], targets: Any,
              loss_fn: Callable[..., torch.Tensor], pager: Any = None, fused: bool = False) -> Measured:
    """Run one forward/backward of every micro-batch of ``plan`` (model state restored) and measure it;
    ``fused``: each gradient is dropped once complete, as a fused update frees it (the model is not updated:
    the update's own bytes are the caller's to add)."""
    from ..runtime.fused import deferred, dropping_gradients

    dropping = dropping_gradients(model.parameters(), deferred(chain)) if fused else contextlib.nullcontext()
    bn = FullBatchStats(model)
    try:
        with preserved_model_state(model), dropping:
            executor = make_executor(chain, plan, bn, pager=pager if "page" in plan.policies else None)
            base = memory.baseline_rss_bytes()
            memory.reset_peak()
            before = memory.rss_bytes()
            bn.begin_step(plan.batch_size, plan.micro_batch_size)  # the statistics a micro-batched step keeps
            _micro_batches(executor, plan, env_full, targets, loss_fn, bn=bn)
            peak = memory.peak_rss_bytes()
            bn.abort()  # no update: the statistics as they were
    finally:
        bn.close()
    pool.release()  # blocks cached for reuse are not memory the run left behind
    return Measured(before - base, peak - base, memory.rss_bytes() - base)


def run_steps(chain: Any, plan: Plan, model: nn.Module, env_full: dict[str, Any], targets: Any,
              loss_fn: Callable[..., torch.Tensor], optimizer: Any, unallocated: int, grads: int,
              steps: int = 2, state_pager: Callable[[Any], Any] | None = None, fused: bool = False) -> Measured:
    """Run ``steps`` whole training steps of ``plan`` (optimizer update included) and measure them.

    For a process that is thrown away afterwards (a fork): it changes the model and the optimizer. What it
    measures is what real steps do, the second one included: the optimizer's state and update, and the
    tensor pool and allocator heaps as the previous step left them, which one forward/backward from a
    fresh state does not show. The result is expressed as :func:`run_plan`'s (gradients allocated during the
    run, the ``unallocated`` bytes added by the planner), so that the planner corrects its model the same way.

    ``state_pager(optimizer)``: makes an :class:`~edgetrain.runtime.optstate.OptimizerStatePager` (its own page
    file) when the plan pages the optimizer state; it is paged out around the passes as a step does, and
    the update's peak then holds the state read back. ``fused``: each parameter is updated inside the backward
    (:mod:`~edgetrain.runtime.fused`), its state paged in and out around it.
    """
    from ..runtime.fused import FusedUpdate, deferred

    bn = FullBatchStats(model)
    executor = make_executor(chain, plan, bn)
    sp = state_pager(optimizer) if state_pager is not None else None
    fu = FusedUpdate(optimizer, sp, deferred(chain)) if fused else None
    try:
        if sp is not None:
            sp.page_out()
            pool.release()
        base = memory.baseline_rss_bytes()
        before = memory.rss_bytes()
        peak = update = 0
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            if sp is not None:
                sp.page_out()
            # from here: the previous update's high-water mark (a paged state read back, the gradients) is
            # the update's, not the passes'
            memory.reset_peak()
            bn.begin_step(plan.batch_size, plan.micro_batch_size)  # the statistics a micro-batched step keeps
            _micro_batches(executor, plan, env_full, targets, loss_fn, fu, bn)
            peak = max(peak, memory.peak_rss_bytes())
            memory.reset_peak()  # the update's transients are the optimizer's, measured apart from activations
            if fu is None:
                if sp is not None:
                    sp.page_in()
                optimizer.step()
            bn.finish()  # the full-batch statistics are combined after the update, as the step does
            update = max(update, memory.peak_rss_bytes())
            memory.reset_peak()
        optimizer.zero_grad(set_to_none=True)
        if sp is not None:
            sp.page_out()  # between steps a paging step holds no state: rss_after must not count it
        pool.release()
        after = memory.rss_bytes()  # holds the optimizer state (unless paged); the gradients are freed
    finally:
        if sp is not None:
            sp.close()
        bn.close()
    # as run_plan's: peaks with the gradients but without what the planner adds (unallocated)
    return Measured(before - base, peak - base - unallocated + grads, after - base - (unallocated - grads),
                    update_peak=update - base - unallocated + grads)


def first_run_cost(table: Any, seen: set[int], run: Callable[[Plan], Measured], room: int, fixed: int,
                   grads: int) -> tuple[int, int] | None:
    """Measure what running a micro-batch size for the first time costs beyond the cost model.

    A new tensor shape makes oneDNN build and cache kernels (kept for later runs) and grows the
    allocators' heaps: a MiB or more for a convolutional network, none of it in the per-stage profile.
    The smallest size of ``table`` not in ``seen`` (the one a budget drop reaches first) is run once
    under its most memory-saving plan, if that fits ``room`` (the budget in force less the margin).

    Returns:
        ``(size, bytes)``: the run's peak above the model's prediction, or what it left behind if more;
        None when every size has run or the run does not fit.
    """
    fresh = sorted({p.micro_batch_size for p in table.plans} - seen)
    if not fresh:
        return None
    plan = next(p for p in table.plans if p.micro_batch_size == fresh[0])
    if plan.peak_bytes > room:
        return None
    measured = run(plan)
    act_pred = predicted_activations(plan, fixed)
    cost = max(0, measured.peak - measured.rss_before - grads - act_pred, measured.rss_after - measured.rss_before)
    log.info("first run of micro-batch %d: %s beyond the cost model", fresh[0], format_bytes(cost))
    return fresh[0], cost
