"""Plan, validate plans by running them once, and name the smallest feasible budget (used by prepare)."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from typing import Any, Callable

from ..errors import BudgetError
from ..graph import KEEP, CostChain, candidate_micro_batch_sizes, simulate
from ..plan import Plan
from ..profile import memory
from ..units import format_bytes
from .budgets import (RETRY_SLACK, STALE_BYTES, Measured, RunOver, later_growth, plan_key, predicted_activations,
                      recomputes)
from .smallest import SmallestPlanSearch

#: keeping every stage at the full batch is run once where the model puts it at most this many times the
#: plan budget (:meth:`Planner._gradients_later`)
KEEP_ALL_TRY = 1.2

__all__ = ["Measured", "Planner", "RETRY_SLACK"]

log = logging.getLogger("edgetrain.api")


class Planner(SmallestPlanSearch):
    """Plans, validates plans by running them once, and names the smallest feasible budget when none fits.

    Validation measures what the cost model cannot see (kernel caches for new tensor shapes, allocator
    slack); the excess is added to the fixed bytes and the plan is made again, so the steps that follow
    stay inside the budget. The same correction applies to the smallest feasible budget a BudgetError
    names: it is the budget at which a plan was actually run and measured.
    """

    def __init__(self, costs: CostChain, budget: int | None, margin: int, solver: str,
                 micro_batch_size: int | None, prefer_full_batch: bool, min_micro: int, update_bytes: int,
                 solver_kw: dict[str, Any] | None = None, *,
                 reprofile: Callable[[int], CostChain] | None = None, margin_share: float | None = None,
                 whole_batch_only: bool = False, runs_vary: bool = False) -> None:
        self.costs = costs
        # the forward skips blocks at random: a run that skipped some measured less than a step that skips
        # none holds, so a run's peak is taken as at least the cost model's
        self.runs_vary = runs_vary
        self.budget = budget
        self.margin = margin
        self.solver = solver
        self.micro_batch_size = micro_batch_size
        self.prefer_full_batch = prefer_full_batch
        self.min_micro = min_micro
        self.update_bytes = update_bytes
        self.solver_kw = dict(solver_kw or {})
        self.reprofile = reprofile  # profiles again for a budget (None: never)
        self.margin_share = margin_share  # prepare's safety_margin (the margin then has a floor)
        # Fixed bytes measured per micro-batch size and plan kind (see budgets.recomputes): a run leaves kernels and
        # heap behind that grow with the size it ran, and code that only recomputing plans run.
        self._fixed_at: dict[tuple[int, bool], int] = {}
        self.floor: int | None = None  # fixed bytes before a run (validation measured; no residue)
        self._ran_at: dict[tuple[int, tuple[str, ...]], int] = {}  # plan -> process RSS after its last run
        self._largest_run: tuple[Plan, int, int] | None = None  # _largest_size_run's one run
        # every plan run: (plan, model peak, measured peak), the last run of each plan
        self._runs: dict[tuple[int, tuple[str, ...]], tuple[Plan, int, int]] = {}
        # what the planning process itself had grown by, since its first run, when a plan last ran
        self._rss0: int | None = None
        self._grown: dict[tuple[int, tuple[str, ...]], int] = {}
        self.whole_batch_only = whole_batch_only  # micro-batching would not be exact (loss, buffers)

    def _with_fixed(self, extra: int) -> None:
        self.costs = replace(self.costs, fixed_bytes=self.costs.fixed_bytes + extra)

    def fixed_at(self, m: int, recomputes: bool = True) -> int:
        """Fixed bytes a plan of micro-batch size ``m`` (recomputing or not) is expected to find.

        Piecewise linear through the sizes validation measured for plans of that kind (of the other kind
        while none of it ran), from the fixed bytes before any run at size 0, extended past the largest
        with the last slope; the cost model's single figure until a run was measured. A plan never run is
        validated before it is taken, so an estimate that is low costs one more validation run, never the
        budget.
        """
        if not self._fixed_at or self.floor is None:
            return self.costs.fixed_bytes
        same = {k: v for (k, r), v in self._fixed_at.items() if r == recomputes}
        measured = same or {k: v for (k, _), v in self._fixed_at.items()}
        if m in measured:
            return measured[m]
        pts = [(0, min(self.floor, min(measured.values())))] + sorted(measured.items())
        for (m0, f0), (m1, f1) in zip(pts, pts[1:]):
            if m <= m1:
                return int(f0 + (f1 - f0) * (m - m0) / (m1 - m0))
        (m0, f0), (m1, f1) = pts[-2], pts[-1]
        return int(f1 + max(0.0, (f1 - f0) / (m1 - m0)) * (m - m1))

    def _costs_at(self, m: int, recomputes: bool = True) -> CostChain:
        return replace(self.costs, fixed_bytes=self.fixed_at(m, recomputes))

    def sizes(self) -> list[int]:
        """Every micro-batch size the model accepts (a budget change may pick any, even when prepare's
        was fixed): none below ``min_micro``, nor one leaving a trailing micro-batch below it."""
        b = self.costs.batch_size
        if self.whole_batch_only:
            return [b]
        lo = min(self.min_micro, b)  # BatchNorm in training needs 2 samples where maps are 1x1
        return [m for m in candidate_micro_batch_sizes(b) if m >= lo and (b % m == 0 or b % m >= lo)]

    def _sizes(self) -> list[list[int]]:
        b = self.costs.batch_size
        if self.micro_batch_size is not None:
            return [[min(self.micro_batch_size, b)]]
        return [[b], self.sizes()] if self.prefer_full_batch else [self.sizes()]

    def _min_needed(self) -> int:
        """Smallest plan budget for the current cost model."""
        try:
            self._solve(0)
        except BudgetError as e:
            return int(e.min_feasible_bytes or 0)
        return 0

    def _solve(self, plan_budget: int) -> Plan:
        err: BudgetError | None = None
        for cand in self._sizes():
            try:
                plan = self._solve_sizes(plan_budget, cand)
            except BudgetError as e:
                err = e
                continue
            update_peak = self.fixed_at(plan.micro_batch_size, recomputes(plan)) + self.update_bytes
            if update_peak <= plan_budget:
                return plan.replace(peak_bytes=max(plan.peak_bytes, update_peak), budget_bytes=self.budget)
            err = BudgetError("the optimizer update does not fit", min_feasible_bytes=update_peak)
            break
        assert err is not None
        need = max(self.costs.fixed_bytes + self.update_bytes if not self._fixed_at else 0,
                   int(err.min_feasible_bytes or 0))
        raise BudgetError(str(err), budget_bytes=plan_budget, min_feasible_bytes=need)

    def _solve_sizes(self, plan_budget: int, sizes: list[int]) -> Plan:
        """The fastest plan over ``sizes``, each planned with the fixed bytes expected at its size."""
        from ..planners import solve

        if not self._fixed_at:
            return solve(self.costs, plan_budget, solver=self.solver, micro_batch_sizes=sizes, **self.solver_kw)
        best: Plan | None = None
        need: int | None = None
        last: BudgetError | None = None
        # the DP's plans recompute; keeping every stage is planned apart, with its own fixed bytes
        kinds = (True, False) if self.solver == "dp" else (True,)
        for m, rec in ((m, rec) for m in sizes for rec in kinds):
            try:
                plan = solve(self._costs_at(m), plan_budget, solver=self.solver, micro_batch_sizes=[m],
                             **self.solver_kw) if rec else self._solve_keep(m, plan_budget)
            except BudgetError as e:
                last = e
                if e.min_feasible_bytes is not None:
                    if rec and len(kinds) > 1 and not self._minrecomputes(m, e.min_feasible_bytes):
                        continue  # the DP's smallest keeps every stage: the other branch judges it
                    need_m = max(e.min_feasible_bytes, self.fixed_at(m, rec) + self.update_bytes)
                    need = need_m if need is None else min(need, need_m)
                continue
            if rec and len(kinds) > 1 and not recomputes(plan):
                continue  # keeps every stage: judged with the fixed bytes of its kind (the other branch)
            update_peak = self.fixed_at(m, rec) + self.update_bytes
            if update_peak > plan_budget:
                need = update_peak if need is None else min(need, update_peak)
                last = BudgetError("the optimizer update does not fit", min_feasible_bytes=update_peak)
                continue
            if best is None or plan.step_time_s < best.step_time_s:
                best = plan
        if best is not None:
            return best
        assert last is not None
        raise BudgetError(str(last), budget_bytes=plan_budget, min_feasible_bytes=need)

    def _minrecomputes(self, m: int, need: int) -> bool:
        """Whether the DP's smallest plan at micro-batch ``m`` (``need`` bytes with the fixed bytes of
        recomputing plans) recomputes. Where it keeps every stage (recomputing saves nothing at that size),
        its need is not one of a recomputing plan: judged with those plans' fixed bytes, which are lower
        where recomputing code stays resident, it would name a budget no plan was measured in (an LSTM's
        named 17.0 MiB, where every plan measured 22 MiB or more)."""
        from ..planners import solve

        try:
            return recomputes(solve(self._costs_at(m), need, solver=self.solver, micro_batch_sizes=[m],
                                     **self.solver_kw))
        except BudgetError:
            return True

    def plan(self, plan_budget: int | None) -> Plan:
        if plan_budget is None:
            from ..planners import solve

            sizes = [self.micro_batch_size or self.costs.batch_size]
            return solve(self.costs, 2**62, solver=self.solver, micro_batch_sizes=sizes,
                         **self.solver_kw).replace(budget_bytes=None)
        return self._solve(plan_budget)

    def plan_gradients_later(self, plan_budget: int, grads: int, sizes: list[int] | None = None) -> Plan:
        """The fastest plan (over ``sizes``, every size by default) of the cost model with ``grads`` bytes of
        gradients out of the fixed bytes: what a step training the batch in one piece can fit, since it makes
        its gradients stage by stage as activations are freed (:meth:`_gradients_later`). Planned on a copy;
        this planner's cost model is unchanged. Only a run can take such a plan.

        Raises:
            BudgetError: nothing fits ``plan_budget`` even so.
        """
        shifted = copy.copy(self)
        shifted.costs = replace(self.costs, fixed_bytes=self.costs.fixed_bytes - grads)
        shifted._fixed_at = {k: v - grads for k, v in self._fixed_at.items()}
        shifted.floor = None if self.floor is None else self.floor - grads
        return shifted._solve_sizes(plan_budget, sizes) if sizes else shifted._solve(plan_budget)

    def plan_validated(self, run: Callable[[Plan], Measured], unallocated: int, grads: int,
                       first: Plan | None = None, strict: bool = False) -> tuple[Plan, CostChain]:
        """The fastest plan whose validation run fits, validated from the state the steps will start in.

        A run measures a step begun from the process as it was then. Planning after it (other candidates,
        other runs) can leave the process larger, and the real step starts from there: when it has grown by
        more than :data:`STALE_BYTES` the plan is run again, and if it no longer fits, planned anew.

        ``first``, a plan validated elsewhere from these costs (the analysing child's), is run before any:
        taken if its run fits here, and bettered only by a plan the model puts faster whose run fits. The
        costs carry what that child's runs measured above the profile, not below it (a keep-everything plan
        the profile over-states), so planning from them alone can take a slower plan than the child's.

        ``strict``: ``first`` is taken as it is when its run fits (no faster candidate is run), and a run over the
        budget raises :class:`RunOver` instead of planning on: a process that validates in itself (more intra-op
        threads than the child) keeps what every further run leaves resident, so the caller plans again in a
        child with what this process measured over it held back.
        """
        plan = self._plan_validated(run, unallocated, grads, first, strict)
        for _ in range(3):
            memory.release_heap()  # what planning left free is not the step's: prepare hands it back last
            ran_at = self._ran_at.get(plan_key(plan))
            grown = 0 if ran_at is None else memory.rss_bytes() - memory.baseline_rss_bytes() - ran_at
            if grown <= STALE_BYTES:
                break
            log.info("this process grew %s since the plan's validation run; running it again", format_bytes(grown))
            _, measured_peak = self._correct(plan, run(plan), unallocated, grads)
            if measured_peak <= self.budget - self.margin:
                plan = plan.replace(peak_bytes=measured_peak) if measured_peak > plan.peak_bytes else plan
                break
            plan = self._plan_validated(run, unallocated, grads)
        self.costs = self._costs_at(plan.micro_batch_size, recomputes(plan))
        return plan, self.costs

    def _plan_validated(self, run: Callable[[Plan], Measured], unallocated: int, grads: int,
                        first: Plan | None = None, strict: bool = False) -> Plan:
        """Plan, run the plan once, correct the cost model by what was measured, and re-plan if needed.

        Args:
            run: runs a plan's micro-batches once (no optimizer step) and measures resident memory.
            unallocated: bytes the real steps add that validation does not (gradients freed again
                afterwards, optimizer state not yet created).
            grads: gradient bytes allocated during validation.
        """
        assert self.budget is not None
        plan_budget = self.budget - self.margin
        if first is not None and first.micro_batch_size in self.sizes():
            model_peak, measured_peak = self._correct(first, run(first), unallocated, grads)
            log.info("the plan validated elsewhere measured %s here (%s there), plan budget %s",
                     format_bytes(measured_peak), format_bytes(first.peak_bytes), format_bytes(plan_budget))
            if measured_peak <= plan_budget:
                plan = self._measured(first.replace(budget_bytes=self.budget), measured_peak, model_peak)
                return plan if strict else self._improved(plan, plan_budget, run, unallocated, grads)
            if strict:
                raise RunOver(measured_peak, first.peak_bytes, plan_budget)
        measured_peak = 0
        for _ in range(8):  # every size measured moves the fixed bytes; a plan is taken only once it has run
            try:
                plan = self._solve(plan_budget)
            except BudgetError as e:
                fitted = self._smallest_if_it_fits(run, unallocated, grads, plan_budget)
                if fitted is not None:  # the corrected model may now admit a faster plan than the smallest
                    return self._improved(fitted, plan_budget, run, unallocated, grads)
                raise self._infeasible(e, run, unallocated, grads) from None
            model_peak, measured_peak = self._correct(plan, run(plan), unallocated, grads)
            if measured_peak <= plan_budget:
                if measured_peak != plan.peak_bytes:  # the run's peak, above or below the prediction
                    plan = self._measured(plan, measured_peak, max(model_peak, plan.peak_bytes))
                return self._improved(plan, plan_budget, run, unallocated, grads)
        fitted = self._smallest_if_it_fits(run, unallocated, grads, plan_budget)
        if fitted is not None:
            return self._improved(fitted, plan_budget, run, unallocated, grads)
        err = BudgetError("no plan run measured inside the budget", budget_bytes=plan_budget,
                          min_feasible_bytes=max(self._min_needed(), measured_peak))
        raise self._infeasible(err, run, unallocated, grads)

    def _improved(self, plan: Plan, plan_budget: int, run: Callable[[Plan], Measured], unallocated: int,
                  grads: int, tries: int = 3) -> Plan:
        """A faster plan than the accepted ``plan`` when the corrected model allows one and its run fits.

        Validation can lower the fixed bytes (the profile ran in a process holding kernel caches for shapes
        the step never uses, or the cost model over-predicted): the room that frees may admit a plan with
        less recomputation. Each candidate is run and measured like the first; one that does not fit
        corrects the model at its micro-batch size and the next candidate is planned from that, up to
        ``tries`` runs (what a run leaves resident varies by a few MiB from one run to the next, so a
        single miss must not leave a step at the smallest plan: the transformer at 35% of plain's peak
        stayed at micro-batch 1, 1.5 s a step, where micro-batch 8 fits at 0.11 s).
        """
        costs = self.costs
        for _ in range(tries):
            try:
                better = self._solve(plan_budget)
            except BudgetError:
                break
            if better.step_time_s >= plan.step_time_s * 0.99:
                break
            model_peak, measured_peak = self._correct(better, run(better), unallocated, grads)
            if measured_peak <= plan_budget:
                log.info("validation freed room: a plan predicted %.0f%% faster fits (%s measured)",
                         100 * (1 - better.step_time_s / plan.step_time_s), format_bytes(measured_peak))
                plan = self._measured(better, measured_peak, max(model_peak, better.peak_bytes)) \
                    if measured_peak != better.peak_bytes else better
                return self._gradients_later(plan, plan_budget, run, unallocated, grads)
        self.costs = costs
        return self._gradients_later(plan, plan_budget, run, unallocated, grads)

    def _gradients_later(self, plan: Plan, plan_budget: int, run: Callable[[Plan], Measured], unallocated: int,
                         grads: int) -> Plan:
        """A faster full-batch plan than ``plan`` that the cost model rules out but a run may fit, if its run fits.

        Two candidates, each run once and taken on its measurement only, as every plan is:

        * the fastest plan of the model without the gradients' bytes: the model holds every gradient from the
          start of the backward, and a step that trains the batch in one piece makes them stage by stage as
          activations are freed, so its peak can lie up to their bytes below the model's (ResNet-18, batch 32
          at 32x32: everything kept measured 174.7 MiB, the model said 195.8, and a budget of 200 MiB took a
          plan recomputing part of 12 stages);
        * keeping every stage, when the model puts it at most :data:`KEEP_ALL_TRY` times the plan budget:
          validation corrects activations upwards only, and the profile can over-state what keeping
          everything holds (the transformer of the bench: 67.5 MiB predicted, 49.5 measured, so a budget it
          fitted with room took 4 recomputed stages; such a run exceeds the budget by little, in a fork).
        """
        b = self.costs.batch_size
        if (self.micro_batch_size or b) < b:
            return plan
        candidates = []
        if grads > 0:
            try:
                candidates.append(self.plan_gradients_later(plan_budget, grads, [b]))
            except BudgetError:
                pass
        if self.solver == "dp":
            try:
                candidates.append(self._solve_keep(b, int(KEEP_ALL_TRY * plan_budget)))
            except BudgetError:
                pass
        for candidate in candidates:
            if candidate.step_time_s >= plan.step_time_s * 0.99 or plan_key(candidate) in self._runs:
                continue
            candidate = candidate.replace(budget_bytes=self.budget)
            model = self.costs, self.update_bytes, self.floor
            model_peak, measured_peak = self._correct(candidate, run(candidate), unallocated, grads)
            if measured_peak > plan_budget:
                self.costs, self.update_bytes, self.floor = model  # the model of the plan taken
                continue
            log.info("a full-batch plan the cost model ruled out, predicted %.0f%% faster, fits when run (%s "
                     "measured)", 100 * (1 - candidate.step_time_s / plan.step_time_s), format_bytes(measured_peak))
            return self._measured(candidate, measured_peak, max(model_peak, candidate.peak_bytes))
        return plan

    def _measured(self, plan: Plan, measured_peak: int, model_peak: int) -> Plan:
        """``plan`` with the peak its validation run measured, above or below the cost model's (a plan that
        pages the optimizer state peaks in the update, with the state read back); the model's figure stays in
        ``metadata["model_peak_bytes"]``."""
        note = (f"peak from the cost model corrected by a validation run ({format_bytes(measured_peak)}; a run "
                "that skipped blocks measures less)" if self.runs_vary else
                f"peak from the validation run ({format_bytes(measured_peak)}, with later steps' growth); the cost "
                f"model predicted {format_bytes(model_peak)}")
        earlier = tuple(n for n in plan.notes if not n.startswith(("peak from the validation run",
                                                                    "peak from the cost model corrected")))
        return plan.replace(peak_bytes=measured_peak, metadata={**plan.metadata, "model_peak_bytes": model_peak},
                            notes=earlier + (note,))

    def _correct(self, plan: Plan, m: Measured, unallocated: int, grads: int) -> tuple[int, int]:
        """Set the fixed bytes to what the process really holds, plus any activation under-prediction.

        Returns the plan's peak under the corrected model (before a run that began above where it ended
        raised it to the run's), and the peak its run measured (plus what real steps add: optimizer state;
        and the optimizer update's transient).
        """
        rec = recomputes(plan)
        act_pred = predicted_activations(plan, self.fixed_at(plan.micro_batch_size, rec))
        # What the run left resident (kernels built for new shapes, allocator heap growth) is in rss_after and
        # so in the fixed bytes below; measuring activations from before the run would count it twice.
        act_meas = m.peak - max(m.rss_before, m.rss_after) - grads
        act_excess = max(0, act_meas - act_pred)
        # A run never leaves less than nothing resident: a reading below the zero point is the heap of a
        # grown process given back (a test suite's process: -12 KiB after a tiny model's run, and a 1 KiB
        # budget then "fitted"), not a negative cost.
        fixed = max(0, m.rss_after) + unallocated + act_excess
        # real steps measured the update itself: its transients replace the probes' estimate
        update = self.update_bytes if m.update_peak is None else max(0, m.update_peak + unallocated - grads - fixed)
        run_peak = m.peak + unallocated - grads
        predicted = fixed + max(act_pred, update)
        # A run that began above where it ended (a heap given back during it) peaks above the fixed bytes it
        # leaves plus its activations: the model must still put this plan at its run's peak, or the next solve
        # takes it again and re-reads the same miss (ResNet-18 batch 32, update fused: 196.4 MiB measured,
        # 195.2 modelled, 195.7 the plan budget).
        fixed += max(0, run_peak - predicted)
        log.info("validation: activations measured %.1f MiB vs %.1f predicted; fixed %.1f MiB at micro-batch "
                 "%d (was %.1f)", act_meas / 2**20, act_pred / 2**20, fixed / 2**20, plan.micro_batch_size,
                 self.fixed_at(plan.micro_batch_size, rec) / 2**20)
        self._fixed_at[(plan.micro_batch_size, rec)] = fixed
        if m.process_rss is not None:
            self._ran_at[plan_key(plan)] = m.process_rss
        self.floor = m.rss_before + unallocated
        self._with_fixed(fixed - self.costs.fixed_bytes)
        self.update_bytes = update
        measured = max(run_peak, fixed + update)
        measured += later_growth(measured)  # the steps after the run grow a little (see LATER_GROWTH_BYTES)
        model_peak = fixed + max(act_pred, update)
        if self.runs_vary:
            measured = max(measured, model_peak)
        self._runs[plan_key(plan)] = plan, model_peak, measured
        if self._rss0 is None:
            self._rss0 = m.rss_before
        self._grown[plan_key(plan)] = max(0, m.rss_before - self._rss0)
        return predicted, measured

    def _as_fresh(self, plan: Plan, measured: int) -> int:
        """A run's measurement as a fresh process would take it: less what the planning process had grown by
        since its first run when the plan ran (planner state, re-profiled costs: timm-style ViT, batch 8, its
        keep-everything plan measured 27.0, 28.0 and 29.1 MiB in three runs, 1 MiB more after each re-profile,
        and the 29.1 named a minimum 10% above what a fresh process trains in). Used to name the smallest
        feasible budget only; a plan is taken on its run as measured."""
        return measured - self._grown.get(plan_key(plan), 0)

    def _solve_keep(self, m: int, plan_budget: int) -> Plan:
        """The plan keeping every stage at micro-batch ``m``, with the fixed bytes of its kind."""
        from ..planners import solve

        costs = self._costs_at(m, False)
        need = simulate(costs, m, (KEEP,) * costs.n, tuple(range(costs.n))).peak_bytes
        if need > plan_budget:  # said here: the baseline's own message would run the DP for its hint
            raise BudgetError("keeping every stage does not fit", budget_bytes=plan_budget,
                              min_feasible_bytes=int(need))
        return solve(costs, plan_budget, solver="no_saving", micro_batch_sizes=[m])
