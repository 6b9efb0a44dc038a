"""What a :class:`~.planner.Planner` does when no plan is predicted to fit: run the smallest candidates, since
the cost model may over-predict them, and otherwise name the smallest budget at which a plan ran and was
measured (the :class:`~edgetrain.errors.BudgetError` that ``prepare`` raises)."""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from ..errors import BudgetError
from ..plan import Plan
from ..units import format_bytes
from .budgets import RETRY_SLACK, Measured, budget_for, recomputes

__all__ = ["SmallestPlanSearch", "above_budget"]

log = logging.getLogger("edgetrain.api")


class SmallestPlanSearch:
    """The tight-budget half of :class:`~.planner.Planner` (a mixin: it reads and corrects the planner's cost
    model, runs and measured fixed bytes through the planner's own methods)."""

    def _smallest_if_it_fits(self, run: Callable[[Plan], Measured], unallocated: int, grads: int,
                             plan_budget: int) -> Plan | None:
        """When no plan is predicted to fit, run the smallest one: the model may over-predict it.

        Its peak is measured, and the plan is taken only if that fits, so the budget stays a promise.
        """
        try:
            plan = self._solve(self._min_needed())
        except BudgetError:
            return None
        costs_before = self.costs
        model_peak, measured_peak = self._correct(plan, run(plan), unallocated, grads)
        if measured_peak <= plan_budget:
            log.info("smallest plan measured %s, inside the budget the model said it misses",
                     format_bytes(measured_peak))
            return self._measured(plan, measured_peak, model_peak)
        self.costs = costs_before
        largest = self._largest_size_run(run, unallocated, grads, measured_peak)
        if largest is not None and largest[2] <= plan_budget:
            log.info("the largest micro-batch size's smallest plan measured %s, inside the budget",
                     format_bytes(largest[2]))
            return self._measured(largest[0].replace(budget_bytes=self.budget), largest[2], largest[1])
        self.costs = costs_before
        kept = self._smallest_keep_run(run, unallocated, grads)
        if kept is not None and kept[2] <= plan_budget:
            # the named minimum may be such a plan's measurement: a retry at it must find the plan
            log.info("the smallest plan keeping every stage measured %s, inside the budget", format_bytes(kept[2]))
            return self._measured(kept[0].replace(budget_bytes=self.budget), kept[2], kept[1])
        self.costs = costs_before  # leave the model as the infeasible path expects it
        return None

    def _largest_size_run(self, run: Callable[[Plan], Measured], unallocated: int, grads: int,
                          near: int) -> tuple[Plan, int, int] | None:
        """Run the smallest plan of the largest micro-batch size once: ``(plan, model peak, measured peak)``.

        What a run leaves resident depends on the plan as well as its size (ResNet-18, batch 12: 162 MiB
        after everything recomputed at micro-batch 2), sizes never run are extrapolated from the sizes
        that ran, and the cost model may over-predict a size's activations (validation corrects them
        upwards only: 18.2 MiB predicted, 3.7 measured at micro-batch 12). So the smallest plan alone
        can miss a plan that fits and over-state the smallest budget (191.5 MiB named where micro-batch
        12 peaks at 167 MiB). None when that size already ran, or its plan is predicted to need more
        than 1.5x ``near`` (not worth a run, and a run far above the budget could exhaust the memory of
        a small device; a later call, after re-profiling, may judge it again). Runs at most once.
        """
        largest = max(s for group in self._sizes() for s in group)
        if self._largest_run is not None or any(k == largest for k, _ in self._fixed_at):
            return self._largest_run  # it ran (once is enough), or that size ran on the main path
        try:
            self._solve_sizes(0, [largest])
            return None  # a plan of any size fits a budget of 0: nothing to learn
        except BudgetError as e:
            at_largest = int(e.min_feasible_bytes or 0)
        # judged with the fixed bytes measured so far, not their extrapolation to this size
        flat = at_largest - self.fixed_at(largest) + max(self._fixed_at.values(), default=0)
        if not at_largest or flat >= 1.5 * near:
            return None
        costs_before = self.costs
        try:
            plan = self._solve_sizes(at_largest, [largest])
        except BudgetError as e:
            log.debug("could not run the largest micro-batch size: %s", e)
            self.costs = costs_before
            return None
        model_peak, measured = self._correct(plan, run(plan), unallocated, grads)
        self._largest_run = plan, model_peak, measured
        return self._largest_run

    def _smallest_keep_run(self, run: Callable[[Plan], Measured], unallocated: int, grads: int,
                           tries: int = 2) -> tuple[Plan, int, int] | None:
        """``(plan, model peak, measured peak)`` of the smallest plan that keeps every stage as measured
        (run here unless it ran before), or None (not the DP, or none fits).

        The smallest plan by the cost model recomputes, and recomputing plans leave more resident (code
        pages, see :func:`~.budgets.recomputes`); on a small model that outweighs the activations they save (GPT-2,
        batch 8: 17.3 MiB kept at micro-batch 2 against 20.1 recomputed at 1). Until a plan keeping all
        has run, its fixed bytes are estimated from recomputing runs: run the smallest, and again when
        its measurement moves the estimate to another size (``tries`` runs at most).
        """
        if self.solver != "dp":
            return None

        def best() -> tuple[Plan, int, int] | None:
            kept = [r for r in self._runs.values() if not recomputes(r[0]) and r[0].micro_batch_size in allowed]
            return min(kept, key=lambda r: r[2]) if kept else None

        allowed = sorted({m for group in self._sizes() for m in group})  # a fixed micro_batch_size is kept
        for _ in range(tries):
            need, plan = None, None
            for m in allowed:
                try:
                    self._solve_keep(m, 0)
                except BudgetError as e:
                    if e.min_feasible_bytes is not None and (need is None or e.min_feasible_bytes < need):
                        need, plan = e.min_feasible_bytes, m
                    continue
                return best()  # a plan keeping all fits 0 bytes: nothing to learn
            if plan is None or (plan, False) in self._fixed_at:
                break
            try:
                keep = self._solve_keep(plan, int(need))
            except BudgetError:
                break
            self._correct(keep, run(keep), unallocated, grads)
        return best()

    def _infeasible(self, err: BudgetError, run: Callable[[Plan], Measured], unallocated: int,
                    grads: int) -> BudgetError:
        need = int(err.min_feasible_bytes or 0)
        measured = None  # the measured peak of the smallest plan's last run
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
                _, measured = self._correct(plan, run(plan), unallocated, grads)
                measured = self._as_fresh(plan, measured)
                need = self._min_needed()
            except BudgetError as e:
                log.debug("could not refine the smallest feasible budget: %s", e)
                break
        if measured is not None and measured < need:
            # The cost model over-predicts this plan (validation corrects it upwards only): name what it
            # measured. prepare at that budget runs the same smallest plan and takes it on its measurement
            # (_smallest_if_it_fits), so the number stays one at which training works.
            need = measured
        kept = self._smallest_keep_run(run, unallocated, grads)
        if kept is not None:
            need = min(need, self._as_fresh(kept[0], kept[2]))  # a budget at which a plan ran and was measured
        largest = self._largest_size_run(run, unallocated, grads, need)
        if largest is not None:
            need = min(need, self._as_fresh(largest[0], largest[2]))  # likewise
        if self._runs:  # never below every plan's measurement: a cost-model estimate no run has backed
            need = max(need, min(self._as_fresh(r[0], r[2]) for r in self._runs.values()))
        assert self.budget is not None
        # A fresh process profiling at larger sizes loads kernels for more tensor shapes than this failed
        # attempt did, and a plan's run measures a MiB more or less from one process to the next (GPT-2, 3
        # layers: 20.7 and 22.4 MiB at micro-batch 2): keep 5% for that, so that a retry there succeeds.
        if self.margin_share is not None:
            user_need = budget_for(math.ceil(RETRY_SLACK * need), self.margin_share)
        else:
            user_need = math.ceil(RETRY_SLACK * need * self.budget / (self.budget - self.margin))
        # a model that micro-batching cannot train exactly is told why after this message (Analysis.analyse)
        hint = "" if self.micro_batch_size is None or self.whole_batch_only else \
            " or let the planner choose micro_batch_size"
        fixed_shown = self.costs.fixed_bytes  # never more than the need named (that was measured, with them)
        return BudgetError(
            f"no {self.solver} plan trains this batch of {self.costs.batch_size} within "
            f"{format_bytes(self.budget)}: the smallest feasible budget is {format_bytes(user_need)} (of which the "
            f"model, its gradients, optimizer state, batch and runtime take {format_bytes(min(fixed_shown, need))} "
            f"before any activation). Raise memory_budget to at least that, or train a smaller batch{hint}.",
            budget_bytes=self.budget, min_feasible_bytes=user_need)


def above_budget(errors: list[BudgetError], budget: int | None) -> BudgetError:
    """The error naming the smallest of the ways' smallest budgets, never one at or under the budget refused.

    A way names its smallest budget from its runs; runs in this process (a process with more intra-op threads
    than the analysing child validates here) leave kernels and heap behind, so a later run of the same plan
    can measure above what an earlier one led the way to name (MobileViT, 2 threads: 154.1 MiB named for a
    160 MiB budget refused). Such a number would be refused again: the smallest above the budget is named,
    or, when every way named one under it, 5% above the budget."""
    best = min(errors, key=lambda e: e.min_feasible_bytes or float("inf"))
    if budget is None or best.min_feasible_bytes is None or best.min_feasible_bytes > budget:
        return best
    above = [e for e in errors if e.min_feasible_bytes is not None and e.min_feasible_bytes > budget]
    if above:
        return min(above, key=lambda e: e.min_feasible_bytes or float("inf"))
    need = math.ceil(budget * RETRY_SLACK)
    return BudgetError(f"no plan trains this batch within {format_bytes(budget)} in this process: its runs here "
                       f"measured above the budget (they leave kernels and heap behind, the more so with "
                       f"{torch.get_num_threads()} intra-op threads), so the smallest feasible budget is above it; "
                       f"try {format_bytes(need)} or more", budget_bytes=budget, min_feasible_bytes=need)
