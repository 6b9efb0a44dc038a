"""What ``prepare()`` does between capturing a model and building its step: profile, plan and validate.

Kept apart from ``api.py`` so that the forked children of ``_fork.py`` and the process itself run the same
code: :meth:`Analysis.profile` in one child, :meth:`Analysis.analyse` (plan, then validate every candidate
plan in a fresh fork of its own) in a second, and again here from the children's costs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from ..profile import memory
from ..profile.fork import measure_in_child
from .planner import Measured, Planner
from .runs import run_plan, run_steps
from ..batch import slice_batch
from ..capture import capture
from ..errors import BudgetError, InputError
from ..graph import CostChain
from ..plan import Plan
from ..profile.stages import profile_chain
from ..runtime import pool

__all__ = ["Analysis", "Outcome", "block_solver_options"]


@dataclass
class Outcome:
    """What an analysis found.

    Attributes:
        plan: the plan to run.
        costs: the cost model, its fixed bytes as validation measured them at the plan's micro-batch size.
        first_run_bytes: what the plan's first run left resident (kernels, heap): the estimate of what a
            micro-batch size not yet run in this process costs on its first run.
        sizes: the micro-batch sizes the model accepts.
    """

    plan: Plan
    costs: CostChain
    first_run_bytes: int
    sizes: list[int]


@dataclass
class Analysis:
    """Everything ``prepare()`` decided before profiling; its methods do the measuring and planning."""

    model: nn.Module
    inputs: Any
    env: dict[str, Any]
    targets: Any
    loss_fn: Callable[..., torch.Tensor]
    batch: int
    fixed: int  # bytes held before profiling: model, gradients and optimizer state to come, batch
    rss_start: int
    budget: int | None
    margin: int
    solver: str
    solver_kw: dict[str, Any]
    micro_batch_size: int | None
    prefer_full_batch: bool
    min_micro: int
    update_bytes: int
    state_bytes: int
    grads: int
    max_stages: int
    use_cache: bool
    name: str
    pager: Any = None
    optimizer: Any = None
    margin_share: float | None = None  # prepare's safety_margin
    whole_batch_reasons: tuple[str, ...] = ()  # why micro-batching would not be exact (loss, buffers)

    @property
    def plan_budget(self) -> int | None:
        return None if self.budget is None else self.budget - self.margin

    def capture_chain(self) -> Any:
        return capture(self.model, slice_batch(self.inputs, 0, min(self.batch, 2)), max_stages=self.max_stages,
                       carry_cuts=not self.solver.startswith("poet"))  # the paging model has no carried tensors

    def validator(self, chain: Any, isolated: bool = False) -> Callable[[Plan], Measured]:
        """Runs a plan once and measures it; ``isolated`` runs each plan in a fresh fork of this process
        (when it can: one intra-op thread, no pager), so that every run is measured as this process's first
        step will be, without the kernels and heap earlier trial runs of other micro-batch sizes leave."""
        def run(p: Plan) -> Measured:
            measured = None
            if isolated and self.pager is None:
                if self.optimizer is not None:  # the fork is thrown away: run real steps, update included
                    measured = measure_in_child(lambda: run_steps(
                        chain, p, self.model, self.env, self.targets, self.loss_fn, self.optimizer,
                        self.grads + self.state_bytes, self.grads))
                else:
                    measured = measure_in_child(
                        lambda: run_plan(chain, p, self.model, self.env, self.targets, self.loss_fn, None))
            if measured is None:
                measured = run_plan(chain, p, self.model, self.env, self.targets, self.loss_fn, self.pager)
            return replace(measured, process_rss=memory.rss_bytes() - memory.baseline_rss_bytes())
        return run

    def _profile_at(self, chain: Any, fixed: int, budget: int | None) -> CostChain:
        return profile_chain(chain, self.model, self.env, self.targets, self.loss_fn, batch_size=self.batch,
                             fixed_bytes=fixed, budget_bytes=budget, use_cache=self.use_cache, name=self.name,
                             min_micro_batch=self.min_micro)

    def profile(self, chain: Any, with_overhead: bool = False) -> CostChain:
        """The chain's costs; ``with_overhead`` counts what profiling left resident in the fixed bytes."""
        costs = self._profile_at(chain, self.fixed, self.plan_budget)
        pool.release()  # blocks the profiling runs left cached are not overhead the step will carry
        overhead = max(0, memory.rss_bytes() - self.rss_start) if with_overhead else 0
        return CostChain(costs.stages, self.batch, costs.input_bytes, self.fixed + overhead, costs.loss_s,
                         costs.step_fixed_s, costs.name)

    def unsplittable(self, chain: Any) -> tuple[str, ...]:
        """Why this model's step must not be split into micro-batches (empty: it may be)."""
        reasons = list(self.whole_batch_reasons)
        mutated = chain.unmanaged_mutations
        if mutated:
            shown = ", ".join(mutated[:4]) + (", ..." if len(mutated) > 4 else "")
            reasons.append(f"the forward writes buffer(s) {shown} in place, once per call, so micro-batches "
                           "would change them once per micro-batch")
        return tuple(reasons)

    def analyse(self, chain: Any, costs: CostChain | None = None) -> Outcome:
        """Profile (unless ``costs`` are given), plan and validate."""
        reasons = self.unsplittable(chain)
        micro = self.micro_batch_size
        if reasons:
            if micro is not None and micro < self.batch:
                raise InputError(f"micro_batch_size={micro} cannot train this model exactly: {'; '.join(reasons)}. "
                                 "Leave micro_batch_size unset or at the batch size.")
            micro = self.batch
        if costs is None:
            costs = self.profile(chain, with_overhead=True)
        try:
            return self._analyse(chain, costs, micro, reasons)
        except BudgetError as e:
            if not reasons:
                raise
            raise BudgetError(f"{e} Micro-batching is off for this model: {'; '.join(reasons)}.",
                              budget_bytes=e.budget_bytes, min_feasible_bytes=e.min_feasible_bytes) from e

    def _analyse(self, chain: Any, costs: CostChain, micro: int | None, reasons: tuple[str, ...]) -> Outcome:
        planner = Planner(costs, self.budget, self.margin, self.solver, micro,
                          self.prefer_full_batch, self.min_micro, self.update_bytes,
                          {**self.solver_kw, **block_solver_options(chain, self.solver)})
        if reasons:
            planner.whole_batch_only = True

        def reprofile(b: int) -> CostChain:
            def work() -> CostChain:
                return self._profile_at(chain, costs.fixed_bytes, b)
            # in a fork when it can: the kernels profiling builds must not inflate later validation runs
            return measure_in_child(work) or work()

        planner.reprofile = reprofile
        planner.margin_share = self.margin_share
        if self.plan_budget is None:
            plan = planner.plan(None)
            return Outcome(_noted(plan, reasons), costs, 0, planner.sizes())
        plan, costs = planner.plan_validated(self.validator(chain, isolated=True), self.grads + self.state_bytes,
                                             self.grads)
        floor = planner.floor if planner.floor is not None else costs.fixed_bytes
        return Outcome(_noted(plan, reasons), costs, max(0, costs.fixed_bytes - floor), planner.sizes())


def block_solver_options(chain: Any, solver: str) -> dict[str, Any]:
    """Planner options a chain of module-tree blocks needs: blocks are recomputed one at a time (the model's
    own code between them cannot be re-run on its own), so only planners that can plan that way take it.

    Raises:
        InputError: the planner cannot plan such a chain.
    """
    if chain.method != "modules":
        return {}
    if solver == "dp":
        return {"allow_segments": False}
    if solver in ("no_saving", "recompute_all"):
        return {}
    raise InputError(f"solver {solver!r} (or paging) needs a model torch.fx can trace; "
                     f"{type(chain.model).__name__} runs as {len(chain)} blocks of its module tree, which "
                     "solver='dp', 'no_saving' and 'recompute_all' plan")


def _noted(plan: Plan, reasons: tuple[str, ...]) -> Plan:
    if not reasons:
        return plan
    return plan.replace(notes=plan.notes + tuple(f"never micro-batched: {r}" for r in reasons))
