"""`prepare()`: capture, profile and plan a model for a memory budget, and build its :class:`TrainStep`."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from ._state import batchnorm_modules
from .adaptation.controller import grad_bytes_missing
from .approx import ElasticConfig, GradFilter
from .batch import batch_signature, batch_size_of, slice_batch, split_batch
from .capture import bind_inputs
from .capture.chain import unwrap_compiled
from .capture.draws import PROBE_SAMPLES, BatchDraws, Sites, batch_draws
from .capture.modules import replay_kwargs
from .config import PagingConfig, PlanConfig, resolve_legacy
from .errors import BudgetError, InputError
from .graph import CostChain, run_micro_batch_sizes
from .plan import Plan
from .planning.analysis import FUSED_KEY, Analysis, Outcome
from .planning.compiled import compile_step, why_not_compiled
from .planning.holding import fusing_fields, state_paging_fields
from .planning.budgets import safety_margin_bytes
from .planning.layout import LAYOUT_KEY, choose_layout, convolutional, explained, with_layout
from .planning.threads import train_here
from .planning.guards import (check_materialized, check_optimizer, draws_random, example_copy, loss_norm_safely,
                              mark_micro_batched, one_sample_trains)
from .profile import memory
from .profile.fork import analyse_safely
from .profile.stages import optimizer_costs
from .runtime import pool
from .runtime.executor import needs_stages
from .step import TrainStep
from .units import parse_bytes

__all__ = ["prepare", "TrainStep"]

log = logging.getLogger(__name__)


def _layout(cfg: PlanConfig, plan: Plan | None, model: nn.Module, inputs: Any, *, paging: bool, approx: bool) -> str:
    """The layout to feed the model in (``PlanConfig.layout``, or the given plan's), as far as it can matter:
    "keep" for a model without 2-D convolutions or a batch without images, and "auto" only where the plan
    will be made afresh by the recompute planner (not with paging, an approximation or compilation)."""
    if plan is not None:
        return plan.metadata.get(LAYOUT_KEY, "keep")
    if cfg.layout == "keep" or not convolutional(model, inputs):
        return "keep"
    if cfg.layout == "auto" and (paging or approx or cfg.compile):
        log.info("layout='auto' compares layouts for the recompute planner only; the batch runs as given")
        return "keep"
    if cfg.layout == "auto" and torch.are_deterministic_algorithms_enabled():
        # a choice made by measurement can differ between runs, and with it the float rounding
        log.info("layout='auto' keeps the batch as given under torch.use_deterministic_algorithms(True)")
        return "keep"
    return cfg.layout


def _split_example(example: Any) -> tuple[Any, Any]:
    return split_batch(example, "example")


def _plan_for_whole_draws(analysis: Analysis, chain: Any, example: Any, room: int, can_fork: bool,
                          layout: str) -> tuple[Any, Outcome, Any] | None:
    """Where only the budget rules out drawing the whole batch's dropout masks (the check passed: ``chain``'s
    ``draw_sites``), plan again with their bytes held back: ``(chain, outcome, draws)`` for a plan that draws them
    (or keeps the batch whole: draws ``""``), or None where none fits (the first plan stands, drawing per
    micro-batch)."""
    sites = chain.draw_sites

    def analyse(c: Any, costs: Any = None, *_: Any, **__: Any) -> Any:
        return analysis.analyse(c, costs, reserve=sites.extra_bytes(analysis.batch))

    try:
        with explained(layout):
            found, outcome = analyse_safely(analysis.capture_chain, analyse, analysis.budget, can_fork,
                                            profile=analysis.profile, summary=analysis.profile_summary,
                                            memo=analysis.profiles, more_threads=train_here)
    except BudgetError as e:
        log.info("no plan leaves room for the whole batch's dropout masks (%s): each micro-batch draws its own", e)
        return None
    found = found if found is not None else chain
    found.draw_sites = sites  # the same model and capture: the check's finding stands
    if outcome.plan.micro_batch_size >= analysis.batch:
        return found, outcome, ""
    draws = batch_draws(found, example, analysis.batch, outcome.plan.peak_bytes, room)
    return (found, outcome, draws) if isinstance(draws, BatchDraws) else None


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
            example: Any, memory_budget: int | str | None = None, *, planning: PlanConfig | None = None,
            paging: PagingConfig | None = None, speedup: float | ElasticConfig | None = None,
            grad_filter: GradFilter | None = None, plan: Plan | None = None, costs: CostChain | None = None,
            name: str | None = None, **deprecated: Any) -> TrainStep:
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
        planning: how to plan and run the step (:class:`~edgetrain.config.PlanConfig`: micro-batch size,
            solver, stage count, BatchNorm preference, safety margin, profile cache, allocator).
        paging: POET-style planning (:class:`~edgetrain.config.PagingConfig`): page saved tensors to
            storage as well as recompute, costed for a device profile, minimising time or energy, with an
            optional time budget. None: recompute only, fastest plan.
        speedup: opt-in, approximate: train only the parameter tensors that matter most so a step is this
            many times faster (ElasticTrainer); a float or an ``edgetrain.approx.ElasticConfig``. Re-selects
            every ``interval_steps``; after each selection the memory plan is remade for the trained suffix
            of the chain (the frozen prefix runs forward only and saves nothing). The steps' own times
            correct the selector's target at each re-selection (closed-loop speed-up control).
        grad_filter: opt-in, approximate: an ``edgetrain.approx.GradFilter`` (gradient filtering on the
            last convolutions, earlier layers frozen); applied before profiling, so the plan sees the
            smaller saved activations and backward times.
        plan: reuse a plan an earlier ``prepare`` made for this model, example shape, budget and options
            (its ``step.plan``, e.g. kept as ``Plan.to_json``), with that step's ``costs``: nothing is
            profiled, planned or validated (a federated client plans once and keeps the plan across
            rounds). The caller vouches for the setting; stage count and batch size are checked.
        costs: the ``step.costs`` that came with ``plan`` (required with it).
        name: model name for reports.
        **deprecated: the keyword arguments of earlier releases (``micro_batch_size``, ``solver``,
            ``max_stages``, ``tune_allocator``, ``exact_batchnorm``, ``safety_margin``, ``use_cache``,
            ``paging=True``, ``page_dir``, ``device``, ``objective``, ``time_budget``): still honoured for
            one release, each warning once (``DeprecationWarning``).

    Returns:
        The :class:`TrainStep`.

    Raises:
        BudgetError: no plan fits; ``min_feasible_bytes`` names the smallest budget that would.
        CaptureError: the model does not run on the example.
        InputError: the example is malformed.
    """
    model = unwrap_compiled(model)
    check_materialized(model)
    check_optimizer(optimizer)
    cfg, paging_cfg = resolve_legacy(planning, paging, deprecated)
    micro_batch_size, solver, safety_margin = cfg.micro_batch_size, cfg.solver, cfg.safety_margin
    inputs, targets = _split_example(example)
    batch = batch_size_of(inputs, targets)
    if grad_filter is not None:
        from .approx import apply_grad_filter

        probe = slice_batch(inputs, 0, min(batch, 2)) if isinstance(inputs, torch.Tensor) else None
        report = apply_grad_filter(model, grad_filter, example_input=probe)
        log.info("gradient filtering: %s", report)
    budget = None if memory_budget is None else parse_bytes(memory_budget)
    if cfg.tune_allocator:
        memory.tune_allocator()
        # budget or not: with the mmap threshold import set and no pool, every new tensor of 64 KiB or more
        # is mapped afresh and page-faulted in (a ResNet-18 step 1.5x plain PyTorch's)
        pool.install()
    pool.set_cap(None)
    pool.release()  # memory cached for reuse is not in use: measure from live tensors only
    # forked children measure from here on, each collecting garbage first: collected and frozen once here, the
    # children's collections visit only what was made since (a tiny MLP's prepare 1.8 -> 0.8 s)
    with memory.objects_frozen():
        rss_start = memory.rss_bytes()
        in_use = max(0, rss_start - memory.baseline_rss_bytes())
        opt_costs = optimizer_costs(optimizer)
        fixed = in_use + grad_bytes_missing(model) + opt_costs.state_bytes
        state = state_paging_fields(optimizer, opt_costs, cfg, budget, paging_cfg is not None)
        state.update(fusing_fields(optimizer, opt_costs, cfg, budget, whole_batch=micro_batch_size is None or
                                   micro_batch_size >= batch,
                                   other="a paging (POET) plan" if paging_cfg is not None else
                                   "elastic selection (speedup=)" if speedup is not None else None))
        margin = 0 if budget is None else safety_margin_bytes(budget, safety_margin)
        env = bind_inputs(model, inputs)
        loss_norm = loss_norm_safely(model, env, loss_fn, targets, batch)
        if loss_norm.written_inputs:  # every run on the example would write into the caller's tensors again
            inputs = example_copy(model, inputs, loss_norm.written_inputs)
            env = bind_inputs(model, inputs)
        has_bn = any(m.training for _, m in batchnorm_modules(model))
        # BatchNorm in training refuses one value per channel (after a global pooling): micro-batches of two then;
        # a forward or loss that fails on part of the batch (samples paired up) is profiled on the whole batch
        min_micro = batch if not loss_norm.runs_on_parts else \
            2 if has_bn and batch >= 2 and not one_sample_trains(model, env) else 1
        solver_kw: dict[str, Any] = {}
        pager = None
        page_dir = None
        if paging_cfg is not None:
            from .devices import DeviceProfile, load_profile

            device = paging_cfg.device
            dev_profile = device if isinstance(device, DeviceProfile) else load_profile(device)
            solver = paging_cfg.solver
            solver_kw = {"device": dev_profile, "objective": paging_cfg.objective,
                         "time_budget": paging_cfg.time_budget, "paging": paging_cfg.page}
            page_dir = paging_cfg.directory
            if paging_cfg.page:
                from .runtime.paging import Pager

                pager = Pager(page_dir, keep=list(model.parameters()))
        analysis = Analysis(
            model=model, inputs=inputs, env=env, targets=targets, loss_fn=loss_fn, batch=batch, fixed=fixed,
            rss_start=rss_start, budget=budget, margin=margin, solver=solver, solver_kw=solver_kw,
            micro_batch_size=micro_batch_size, prefer_full_batch=has_bn and cfg.exact_batchnorm, min_micro=min_micro,
            update_bytes=opt_costs.update_bytes, state_bytes=opt_costs.state_bytes, grads=grad_bytes_missing(model),
            max_stages=cfg.max_stages, use_cache=cfg.use_cache, name=name or type(model).__name__, pager=pager,
            optimizer=optimizer, margin_share=safety_margin, **state,
            whole_batch_reasons=() if loss_norm.splittable else (loss_norm.why_unsplittable,),
            argument_writers=loss_norm.writers)
        layout = _layout(cfg, plan, model, inputs, paging=paging_cfg is not None, approx=speedup is not None or
                         grad_filter is not None)
        if layout == "auto":
            analysis, why = choose_layout(analysis)
            log.info("layout: %s", why)
        elif layout == "channels_last":
            analysis = with_layout(analysis, layout)
        layout = "keep" if analysis.inputs is inputs else "channels_last"
        inputs, env = analysis.inputs, analysis.env
        given = plan is not None
        if plan is not None:
            chain = analysis.capture_chain()
            if costs is None or plan.num_stages != len(chain) or batch not in (plan.batch_size, costs.batch_size) \
                    or plan.batch_size != costs.batch_size:
                raise InputError(f"the plan given ({plan.num_stages} stages, batch {plan.batch_size}) was not made for "
                                 f"this model and example ({len(chain)} stages, batch {batch}) or lacks its costs; "
                                 "prepare without plan= to plan afresh")
            reasons = analysis.unsplittable(chain)
            if reasons and plan.micro_batch_size < batch:
                raise InputError(f"the plan given splits the batch, which cannot train this model exactly: "
                                 f"{'; '.join(reasons)}. Prepare without plan= to plan afresh.")
            paged = "optimizer_state_paged_bytes" in plan.metadata
            fused = FUSED_KEY in plan.metadata
            if fused and not analysis.fuse:
                raise InputError("the plan given updates the parameters inside the backward (fused update), which this "
                                 "optimizer or these options rule out; prepare without plan= to plan afresh")
            update_bytes = opt_costs.update_bytes + (analysis.pageable_state if paged else 0)
            outcome = Outcome(plan, costs, 0, [batch] if reasons else None, page_state=paged,
                              update_bytes=update_bytes, fused=fused)
        else:
            with explained(layout):
                chain, outcome = analyse_safely(analysis.capture_chain, analysis.analyse, budget, pager is None,
                                                profile=analysis.profile, summary=analysis.profile_summary,
                                                memo=analysis.profiles, more_threads=train_here)
        plan, costs = outcome.plan, outcome.costs
        if layout != "keep":
            plan = plan.replace(metadata={**plan.metadata, LAYOUT_KEY: layout})
        random = draws_random(model, env, replay_kwargs(model, env))
        example = {k: slice_batch(v, 0, PROBE_SAMPLES) for k, v in env.items()} if random else None
        draws: Any = None if has_bn or budget is not None else \
            "without a memory budget the model's own forward runs (give one to draw whole-batch masks)"
        if random and not has_bn and budget is not None and plan.micro_batch_size < batch:  # split, traced graph
            chain = chain if chain is not None else analysis.capture_chain()
            draws = batch_draws(chain, example, batch, plan.peak_bytes, budget - margin)
            if isinstance(draws, str) and isinstance(chain.draw_sites, Sites) and not given:
                again = _plan_for_whole_draws(analysis, chain, example, budget - margin, pager is None, layout)
                if again is not None:  # exact before fast, as BatchNorm's whole batch is (exact_batchnorm)
                    chain, outcome, draws = again
                    plan, costs = outcome.plan, outcome.costs
                    if layout != "keep":
                        plan = plan.replace(metadata={**plan.metadata, LAYOUT_KEY: layout})
        plan = mark_micro_batched(plan, has_bn, random, warn=True, draws=draws)
        log.info("edgetrain plan:\n%s", plan.summary())
        if pager is not None and "page" not in plan.policies:
            pager.close()
            pager = None
        if chain is None and (pager is not None or needs_stages(plan)):
            chain = analysis.capture_chain()  # the step runs stages: capture before its hooks go on the model
        state_pager = analysis.state_pager(optimizer) if outcome.page_state else None
        fused = None
        if outcome.fused:
            from .runtime.fused import FusedUpdate

            fused = FusedUpdate(optimizer, state_pager)
        step = TrainStep(model, optimizer, loss_fn, chain, costs, plan, budget_bytes=budget, margin_bytes=margin,
                         margin_share=0.0 if budget is None else safety_margin,
                         signature=batch_signature((inputs, targets)), solver=solver, pager=pager,
                         loss_norm=loss_norm, capture=analysis.capture_chain, state_pager=state_pager, fused=fused,
                         layout=layout)
        step.budget.micro_sizes = outcome.sizes
        step.budget.prefer_full_batch = has_bn and cfg.exact_batchnorm  # as the plan was chosen here
        step.draws_random, step.draw_example = random, example
        if budget is not None:
            step.budget.validate = analysis.validator(chain)
            step.budget.seen_micro = set(run_micro_batch_sizes(batch, plan.micro_batch_size))
            step.budget.first_run_bytes = outcome.first_run_bytes
            step.budget.opt_state_bytes = opt_costs.state_bytes - (analysis.pageable_new if outcome.page_state else 0)
            step.budget.update_bytes = outcome.update_bytes
        step.page_dir = page_dir
        if speedup is not None:
            from .approx.elastic.selector import ElasticConfig, ElasticSelector

            elastic_cfg = speedup if isinstance(speedup, ElasticConfig) else ElasticConfig(speedup=float(speedup))
            probe = (slice_batch(inputs, 0, plan.micro_batch_size), slice_batch(targets, 0, plan.micro_batch_size))
            step.elastic = ElasticSelector(elastic_cfg).attach(model, optimizer, probe, loss_fn)
            step.replan_for_selection()
        memory.release_cached()  # what prepare made and dropped; what was alive at its start is left to Python's gc
        if cfg.compile:  # last: its trial forks from the state the first step starts from
            compile_step(step, inputs, targets, why_not_compiled(
                step.plan, has_batchnorm=has_bn, paging=paging_cfg is not None, elastic=speedup is not None,
                grad_filter=grad_filter is not None, exact_draws=isinstance(draws, BatchDraws)))
    return step
