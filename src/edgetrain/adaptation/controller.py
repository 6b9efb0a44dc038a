"""`BudgetController`: keeps a running step inside a memory budget that changes while it trains.

A :class:`~edgetrain.api.TrainStep` owns one. It builds the table of plans once (:class:`PlanTable`), so a
new budget is a lookup; it reads what the process holds now beyond the cost model (kernel caches of the
shapes run since prepare, allocator slack) and, for a micro-batch size not yet run here, what a first run
costs; it polls a budget source between micro-batches; and it caps the tensor pool's cache to what the
budget leaves.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Protocol

from ..capture.draws import batch_draws
from ..errors import BudgetError
from ..graph import run_micro_batch_sizes
from ..plan import Plan
from ..planning.analysis import block_solver_options
from ..planning.budgets import RETRY_SLACK, Measured, budget_for, safety_margin_bytes
from ..planning.guards import mark_micro_batched
from ..planning.runs import first_run_cost
from ..profile import memory
from ..runtime import pool
from ..units import format_bytes, parse_bytes
from .table import PlanTable

__all__ = ["BudgetController"]

log = logging.getLogger(__name__)


class Step(Protocol):
    """What the controller reads and calls on the step it serves (an :class:`edgetrain.api.TrainStep`)."""

    model: Any
    optimizer: Any
    chain: Any
    costs: Any
    elastic: Any
    state_pager: Any  # an OptimizerStatePager, or None
    budget_bytes: int | None
    margin_bytes: int
    margin_share: float
    steps_done: int

    @property
    def plan(self) -> Plan: ...

    @property
    def has_batchnorm(self) -> bool: ...

    def set_plan(self, plan: Plan) -> None: ...

    def replan_for_selection(self, reset: bool = False) -> Plan: ...


def grad_bytes_missing(model: Any) -> int:
    """Bytes of the gradients a step will still allocate (trainable parameters whose ``grad`` is None)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None)


class BudgetController:
    """The budget side of a :class:`~edgetrain.api.TrainStep`: table, lookups, drift, source polling.

    Attributes:
        validate: runs a plan once on prepare's example and measures it (set by prepare when there is a
            budget; None: no budget, nothing is measured).
        seen_micro: micro-batch sizes run in this process.
        micro_sizes: the micro-batch sizes the model accepts (None: any).
        first_run_bytes: the most a size's first run has cost beyond the cost model (kernel caches for new
            shapes): a budget change to a size not yet run keeps that in hand.
        opt_state_bytes: optimizer state the first step creates.
        source: the budget source polled before a step and between micro-batches (None: none).
    """

    def __init__(self, step: Step) -> None:
        self.step = step
        self.table: PlanTable | None = None
        self.validate: Callable[[Plan], Measured] | None = None
        self.seen_micro: set[int] = set()
        self.micro_sizes: list[int] | None = None
        self.first_run_bytes = 0
        self.opt_state_bytes = 0
        self.update_bytes = 0  # what the update adds to the fixed bytes (a paged state read back included)
        self.source: Callable[[], int | str | None] | None = None
        # BatchNorm kept exact (prepare(exact_batchnorm=True)): a whole-batch plan is taken wherever one fits, as
        # prepare takes it, before the fastest of every size (each micro-batch normalised on its own)
        self.prefer_full_batch = False
        self.full_table: PlanTable | None = None

    def build_table(self) -> PlanTable:
        """The table a budget change looks plans up in (built on the first call)."""
        step = self.step
        if self.table is None:
            # A budget change may change the micro-batch size, even one fixed at prepare().
            table = PlanTable.build(step.costs, micro_batch_sizes=self.micro_sizes,
                                    **block_solver_options(step.chain, "dp"))
            if self.validate is not None and step.budget_bytes is not None:
                # The last step's gradients are spent (the next step starts from zero); freeing them lets
                # the measuring run allocate its own, as a step does.
                step.optimizer.zero_grad(set_to_none=True)
                if step.state_pager is not None:
                    step.state_pager.page_out()  # out during the passes, as in a step: the run measures them
                room = step.budget_bytes - step.margin_bytes - self.drift()
                probed = first_run_cost(table, self.seen_micro, self.validate, room, step.costs.fixed_bytes,
                                        grad_bytes_missing(step.model))
                if probed is not None:  # replaces prepare's bound, which held every first-run effect
                    self.seen_micro.add(probed[0])
                    self.first_run_bytes = probed[1]
            self.table = table
            if self.prefer_full_batch and self.micro_sizes != [step.costs.batch_size]:
                try:
                    self.full_table = PlanTable.build(step.costs, micro_batch_sizes=[step.costs.batch_size],
                                                      **block_solver_options(step.chain, "dp"))
                except BudgetError:
                    self.full_table = None  # no whole-batch plan at any budget: the table's plans it is
        return self.table

    def set_budget(self, memory_budget: int | str) -> Plan:
        """Switch the step to the fastest table plan that fits ``memory_budget`` (see
        :meth:`edgetrain.api.TrainStep.set_memory_budget`)."""
        step = self.step
        budget = parse_bytes(memory_budget)
        margin = safety_margin_bytes(budget, step.margin_share)
        table = self.build_table()  # built first: its measuring run adds to what the process holds
        drift = self.drift()

        batch = step.plan.batch_size
        tables = [t for t in (self.full_table, table) if t is not None]  # whole-batch plans first, where preferred
        new = {m for m in {p.micro_batch_size for t in tables for p in t.plans}
               if not self.seen_micro.issuperset(run_micro_batch_sizes(batch, m))}

        update = step.costs.fixed_bytes + self.update_bytes

        def need(t: PlanTable, i: int) -> int:  # plan budget table entry i needs, with the first run of a new size
            extra = self.first_run_bytes if t.plans[i].micro_batch_size in new else 0
            return max(t.budgets[i], update) + drift + extra

        plan_budget = budget - margin
        fits: list[int] = []
        for t in tables:
            fits = [i for i in range(len(t)) if need(t, i) <= plan_budget]
            if fits:
                table = t
                break
        if not fits:
            # what this process needs now, with prepare's retry slack: kernel caches and allocator slack differ
            # from one process to the next (2% was too little: a fresh process at the named 28.7 MiB held
            # 0.7 MiB more and was refused again), and a retry at the named budget must work
            least = math.ceil(budget_for(min(need(table, i) for i in range(len(table))), step.margin_share)
                              * RETRY_SLACK)
            raise BudgetError(
                f"no plan fits the new budget {format_bytes(budget)}: the smallest this process can train in now "
                f"is {format_bytes(least)} (it holds {format_bytes(drift)} more than when it was planned: kernel "
                "caches of the shapes run since). The plan in force is unchanged; raise the budget to at least "
                "that.", budget_bytes=budget, min_feasible_bytes=least)
        plan = table.plans[fits[-1]]
        # a change that splits a batch the plan in force kept whole says what that changes, as prepare does
        whole = step.plan.micro_batch_size >= step.plan.batch_size
        random = getattr(step, "draws_random", False)
        draws = batch_draws(step.chain, getattr(step, "draw_example", None), batch, plan.peak_bytes, plan_budget) \
            if random and not step.has_batchnorm and plan.micro_batch_size < batch else None
        plan = mark_micro_batched(plan, step.has_batchnorm, random, warn=whole, draws=draws)
        step.budget_bytes, step.margin_bytes = budget, margin  # first: the executor is chosen under a budget
        step.set_plan(plan.replace(budget_bytes=budget))
        pool.reset_peak()  # the old plan's high-water mark must not let the cache hold more than the new one
        self.cap_pool()
        if step.elastic is not None:
            step.replan_for_selection(reset=True)
        log.info("budget now %s: micro-batch %d, %d recomputed", format_bytes(budget), plan.micro_batch_size,
                 plan.policies.count("recompute"))
        return step.plan

    def drift(self) -> int:
        """How much more the process holds at rest than the cost model's fixed bytes say.

        Every new tensor shape leaves oneDNN kernels and caches behind, and allocators keep what they
        freed; read now (resident memory less the pool's cache, plus the gradients and optimizer state a
        step will still allocate), so that a budget change plans with it.
        """
        if self.validate is None:
            return 0
        step = self.step
        missing = grad_bytes_missing(step.model) + (0 if step.optimizer.state else self.opt_state_bytes)
        # a paged state is in memory between steps (read back for the last update) but out during the passes
        paged = step.state_pager.resident_bytes() if step.state_pager is not None else 0
        return max(0, self.held() - paged + missing - step.costs.fixed_bytes)

    @staticmethod
    def held() -> int:
        """Resident bytes above the import baseline, less what the tensor pool caches for reuse."""
        return memory.rss_bytes() - memory.baseline_rss_bytes() - pool.stats().cached_bytes

    def cap_pool(self) -> None:
        """Let the tensor pool cache only what the budget leaves beside the memory outside the pool."""
        step = self.step
        if not pool.installed() or step.budget_bytes is None:
            return
        st = pool.stats()
        outside = memory.rss_bytes() - st.live_bytes - st.cached_bytes
        pool.set_cap(step.budget_bytes - step.margin_bytes + memory.baseline_rss_bytes() - outside)

    def poll(self) -> None:
        """Ask the budget source for the budget in force; switch plans if it changed."""
        if self.source is None:
            return
        new = self.source()
        if new is not None and parse_bytes(new) != self.step.budget_bytes:
            self.set_budget(new)

    def before_step(self, n: int) -> int | None:
        """Called before a step of ``n`` samples: what the process holds, when this step runs a micro-batch
        size for the first time (its first-run cost is measured against it), else None."""
        new_sizes = not self.seen_micro.issuperset(run_micro_batch_sizes(n, self.step.plan.micro_batch_size))
        return self.held() if new_sizes and self.step.steps_done else None

    def after_step(self, n: int, held: int | None) -> None:
        """Called after a step of ``n`` samples with :meth:`before_step`'s reading."""
        if held is not None:  # what this size's first run left behind bounds the next new size's
            self.first_run_bytes = max(self.first_run_bytes, self.held() - held)
        self.seen_micro.update(run_micro_batch_sizes(n, self.step.plan.micro_batch_size))
