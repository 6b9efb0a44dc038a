"""What ``prepare()`` does between capturing a model and building its step: profile, plan and validate.

Kept apart from ``api.py`` so that the forked children of ``_fork.py`` and the process itself run the same
code: :meth:`Analysis.profile` in one child, :meth:`Analysis.analyse` (plan, then validate every candidate
plan in a fresh fork of its own) in a second, and again here from the children's costs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn

from ..profile import memory
from ..profile.fork import available as fork_available
from ..profile.fork import measure_in_child, run_in_child
from .planner import Measured, Planner
from .smallest import above_budget
from .runs import run_plan, run_steps
from .._state import preserved_model_state
from ..batch import slice_batch
from ..capture import capture
from ..errors import BudgetError, CaptureError, InputError
from ..graph import CostChain
from ..plan import Plan
from ..profile.stages import profile_chain
from ..runtime import pool

__all__ = ["Analysis", "ChainSummary", "FUSED_KEY", "Outcome", "block_solver_options"]

log = logging.getLogger("edgetrain.api")

SLOW_PLAN = 1.25  #: a validated plan this much slower than the step without a budget: the other ways are run too


@dataclass(frozen=True)
class ChainSummary:
    """What planning needs to know of a chain captured in a forked child (it crosses back pickled): a
    step prepared without a budget captures the chain in its own process only when its plan runs stages,
    so that plain PyTorch's schedule carries none of capture's graphs, kernels and heap."""

    method: str
    length: int
    unmanaged_mutations: tuple[str, ...]
    model_name: str
    skips_blocks: bool = False

    def __len__(self) -> int:
        return self.length

    @classmethod
    def of(cls, chain: Any) -> "ChainSummary":
        return cls(chain.method, len(chain), tuple(chain.unmanaged_mutations), type(chain.model).__name__,
                   chain.skips_blocks)


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
    page_state: bool = False  # the optimizer state is paged out during the passes
    update_bytes: int = 0  # what the update adds to the fixed bytes (the paged state read back included)
    fused: bool = False  # the optimizer steps each parameter inside the backward (runtime.fused)
    # the plan as its way's planner validated it, before that way's time and notes were added (another
    # process's analysis runs it first: ``Analysis.analyse``'s ``tried``)
    validated: Plan | None = None


@dataclass(kw_only=True)
class Analysis:
    """Everything ``prepare()`` decided before profiling; its methods do the measuring and planning. Built by
    keyword only: most fields are ints, and a positional call could swap two unnoticed."""

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
    # the forward's ops writing into arguments autograd saves, as the loss check saw them (None: unseen)
    argument_writers: tuple[str, ...] | None = None
    # paging the optimizer state (PlanConfig.page_optimizer_state): "auto", True or False; the bytes it
    # moves (state there now plus state the first update creates) and the part still to be created; the
    # page file's directory and its measured seconds per byte written and read back
    state_mode: Any = False
    pageable_state: int = 0
    pageable_new: int = 0
    state_dir: str | None = None
    state_s_per_byte: float = 0.0
    # the update fused into the backward (runtime.fused): whether it may be planned, what it holds at once
    # (the largest parameter's gradient, state and update temporaries) and what it costs a step in calls
    fuse: bool | str = False  # False, "auto" or True (PlanConfig.fused_update), False where ruled out
    fused_bytes: int = 0
    fused_s: float = 0.0
    fused_held: int = 0  # gradients of parameters several stages read: held to the end (runtime.fused.deferred)
    # the cost model's fastest step holding the gradients (set by _state_modes; inf: none fits the model)
    _unfused_best_s: float = field(default=float("inf"), init=False, repr=False)
    #: profiles this analysis took, by cache key (:func:`~edgetrain.profile.stages.profile_chain`'s ``memo``)
    profiles: dict[str, Any] = field(default_factory=dict)
    batch_copy: int = 0  # bytes a step copies each batch into (PlanConfig.layout), beside the caller's batch

    @property
    def can_page_state(self) -> bool:
        return self.state_mode is not False and self.pageable_state > 0 and self.budget is not None

    @property
    def plan_budget(self) -> int | None:
        return None if self.budget is None else self.budget - self.margin

    def capture_chain(self, part: int = 2) -> Any:
        """The model's chain, captured on two samples of the example, or on all where the forward fails on two and
        the batch trains whole anyway (``min_micro``: a graph's nodes, a forward tied to one batch size). InputError
        where it runs on the whole example but not on two samples, which the loss check missed."""
        part = min(self.batch, part)
        try:
            return capture(self.model, slice_batch(self.inputs, 0, part), max_stages=self.max_stages,
                           carry_cuts=not self.solver.startswith("poet"),  # the paging model has no carried tensors
                           writers=self.argument_writers, isolate=_in_child)
        except CaptureError as e:
            if part == self.batch or not _runs(self.model, self.env):
                raise
            if self.min_micro >= self.batch:
                return self.capture_chain(self.batch)
            name = type(self.model).__name__
            raise InputError(f"{name} runs on the example's {self.batch} samples but fails on {part} of them "
                             f"({e.__cause__ or e}): edgetrain captures, measures and micro-batches a model on "
                             "parts of the batch, so it cannot train a forward tied to one batch size (a recurrent "
                             "state kept between batches, a buffer sized for the batch). Pass such state as an "
                             "input batched on dim 0, or make the forward work for any number of samples") from e

    def unallocated(self, paged: bool, fused: bool = False) -> int:
        """Bytes real steps hold during the passes that validation runs do not: the gradients (none with the
        update fused into the backward), and the optimizer state the first update creates (unless it is paged
        out then)."""
        return (0 if fused else self.grads) + self.state_bytes - (self.pageable_new if paged else 0)

    def fused_shift(self) -> int:
        """Bytes the fused update takes off the fixed bytes: every gradient but what one update holds."""
        return max(0, self.grads - self.fused_bytes - self.fused_held)

    def state_pager(self, optimizer: Any) -> Any:
        from ..runtime.optstate import OptimizerStatePager

        return OptimizerStatePager(optimizer, self.state_dir)

    def validator(self, chain: Any, isolated: bool = False, paged: bool = False,
                  fused: bool = False) -> Callable[[Plan], Measured]:
        """Runs a plan once and measures it; ``isolated`` runs each plan in a fresh fork of this process (when it
        can: no pager, a child running this process's threads), so that every run is measured as this process's
        first step will be, without the kernels and heap earlier runs of other micro-batch sizes leave. ``paged``:
        the steps page the optimizer state out during the passes (the fork's too); ``fused``: they update each
        parameter inside the backward."""
        def run(p: Plan) -> Measured:
            measured = None
            if isolated and self.pager is None:
                if self.optimizer is not None:  # the fork is thrown away: run real steps, update included
                    measured = measure_in_child(lambda: run_steps(
                        chain, p, self.model, self.env, self.targets, self.loss_fn, self.optimizer,
                        self.unallocated(paged, fused), 0 if fused else self.grads,
                        state_pager=self.state_pager if paged else None, fused=fused))
                else:
                    measured = measure_in_child(
                        lambda: run_plan(chain, p, self.model, self.env, self.targets, self.loss_fn, None))
            if measured is None:
                measured = run_plan(chain, p, self.model, self.env, self.targets, self.loss_fn, self.pager, fused)
                if fused:  # the run dropped the gradients but updated nothing: one update's bytes on top
                    measured = replace(measured, peak=measured.peak + self.fused_bytes)
            return replace(measured, peak=measured.peak + self.batch_copy,  # converted by real steps, not by runs
                           process_rss=memory.rss_bytes() - memory.baseline_rss_bytes())
        return run

    def _profile_at(self, chain: Any, fixed: int, budget: int | None) -> CostChain:
        return profile_chain(chain, self.model, self.env, self.targets, self.loss_fn, batch_size=self.batch,
                             fixed_bytes=fixed, budget_bytes=budget, use_cache=self.use_cache, name=self.name,
                             min_micro_batch=self.min_micro, memo=self.profiles)

    def profile(self, chain: Any, with_overhead: bool = False) -> CostChain:
        """The chain's costs; ``with_overhead`` counts what profiling left resident in the fixed bytes."""
        # where the state may be paged out, the passes have that much more room: profile sizes it admits
        costs = self._profile_at(chain, self.fixed - (self.pageable_state if self.can_page_state else 0),
                                 self.plan_budget)
        pool.release()  # blocks the profiling runs left cached are not overhead the step will carry
        overhead = max(0, memory.rss_bytes() - self.rss_start) if with_overhead else 0
        return CostChain(costs.stages, self.batch, costs.input_bytes, self.fixed + overhead, costs.loss_s,
                         costs.step_fixed_s, costs.name)

    def profile_summary(self, chain: Any) -> tuple[CostChain, ChainSummary]:
        """:meth:`profile` with what profiling leaves counted, and the chain's :class:`ChainSummary`."""
        return self.profile(chain, with_overhead=True), ChainSummary.of(chain)

    def unsplittable(self, chain: Any) -> tuple[str, ...]:
        """Why this model's step must not be split into micro-batches (empty: it may be)."""
        reasons = list(self.whole_batch_reasons)
        mutated = chain.unmanaged_mutations
        if mutated:
            shown = ", ".join(mutated[:4]) + (", ..." if len(mutated) > 4 else "")
            reasons.append(f"the forward writes buffer(s) {shown} in place, once per call, so micro-batches "
                           "would change them once per micro-batch")
        return tuple(reasons)

    def analyse(self, chain: Any, costs: CostChain | None = None, tried: Outcome | None = None, *,
                strict: bool = False, reserve: int = 0) -> Outcome:
        """Profile (unless ``costs`` are given), plan and validate; ``tried``, what another process's analysis
        found from these costs: its way of holding the state is tried first and its plan run first
        (:meth:`Planner.plan_validated`), since that process validated the ways against each other.

        ``strict``: ``tried``'s plan is taken as its run here measures it, or :class:`RunOver` raised (a process
        with more intra-op threads than the analysing child). ``reserve``: bytes held back from the budget for
        what such a process measured over the child (:func:`~edgetrain.planning.threads.reserved`).
        """
        if reserve:
            from .threads import reserved

            return reserved(self, reserve, lambda: self.analyse(chain, costs))
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
            return self._analyse(chain, costs, micro, reasons, tried, strict)
        except BudgetError as e:
            if not reasons:
                raise
            raise BudgetError(f"{e} Micro-batching is off for this model: {'; '.join(reasons)}.",
                              budget_bytes=e.budget_bytes, min_feasible_bytes=e.min_feasible_bytes) from e

    def _analyse(self, chain: Any, costs: CostChain, micro: int | None, reasons: tuple[str, ...],
                 tried: Outcome | None = None, strict: bool = False) -> Outcome:
        def reprofile(b: int) -> CostChain:
            def work() -> tuple[CostChain, dict[str, Any]]:
                known = set(self.profiles)
                got = self._profile_at(chain, costs.fixed_bytes, b)
                return got, {k: v for k, v in self.profiles.items() if k not in known}
            # in a fork when it can: the kernels profiling builds must not inflate later validation runs;
            # what the child profiled comes back with its costs, so that sizes are profiled once a prepare
            got, new = measure_in_child(work) or work()
            self.profiles.update(new)
            return got

        def reprofile_less(by: int) -> Callable[[int], CostChain]:
            """Re-profiling for a planner whose fixed bytes are ``by`` less than the profile's: the sizes profiled
            are those its room admits, and its model keeps the shift (the smallest budget it names is then its
            own way's)."""
            def again(b: int) -> CostChain:
                got = reprofile(b + by)
                return replace(got, fixed_bytes=got.fixed_bytes - by)
            return again if by else reprofile

        def planner_for(paged: bool, fused: bool = False) -> Planner:
            shift = self.pageable_state if paged else 0  # out during the passes, back for the update
            opts = {**self.solver_kw, **block_solver_options(chain, self.solver)}
            if fused:  # no update after the passes; one parameter's gradient at a time, the whole batch at once
                shift += self.fused_shift()
                return Planner(replace(costs, fixed_bytes=costs.fixed_bytes - shift), self.budget, self.margin,
                               self.solver, self.batch, True, self.min_micro, 0, opts, reprofile=reprofile_less(shift),
                               margin_share=self.margin_share, whole_batch_only=True, runs_vary=chain.skips_blocks)
            return Planner(replace(costs, fixed_bytes=costs.fixed_bytes - shift), self.budget, self.margin,
                           self.solver, micro, self.prefer_full_batch, self.min_micro, self.update_bytes + shift, opts,
                           reprofile=reprofile_less(shift), margin_share=self.margin_share,
                           whole_batch_only=bool(reasons), runs_vary=chain.skips_blocks)

        if self.fuse:
            from ..runtime.fused import shared_parameter_bytes

            self.fused_held = shared_parameter_bytes(chain)
        if self.plan_budget is None:
            planner = planner_for(False)
            plan = planner.plan(None)
            return Outcome(_noted(plan, reasons), costs, 0, planner.sizes())
        errors: list[BudgetError] = []
        fallback: Outcome | None = None
        modes = self._state_modes(planner_for)
        chosen = None if tried is None else (tried.page_state, tried.fused)
        if chosen in modes:
            modes.remove(chosen)
            modes.insert(0, chosen)
        unbudgeted_s = planner_for(False).plan(None).step_time_s
        for i, (paged, fused) in enumerate(modes):
            more = i + 1 < len(modes) and chosen != (paged, fused)  # another way is left to validate
            planner = planner_for(paged, fused)
            try:
                first = tried.validated if tried is not None and (paged, fused) == chosen else None
                plan, costs_v = planner.plan_validated(
                    self.validator(chain, isolated=True, paged=paged, fused=fused), self.unallocated(paged, fused),
                    0 if fused else self.grads, first=first, strict=strict and first is not None)
            except BudgetError as e:
                log.info("%s fits no plan (smallest budget %s)", _mode_name(paged, fused),
                         "?" if e.min_feasible_bytes is None else f"{e.min_feasible_bytes / 2**20:.1f} MiB")
                errors.append(e)  # another way of holding the state may fit
                continue
            validated = plan
            if paged:
                plan = self._paged_plan(plan, per_parameter=fused)
            floor = planner.floor if planner.floor is not None else costs_v.fixed_bytes
            first_run = max(0, costs_v.fixed_bytes - floor)
            update = planner.update_bytes
            if fused:
                plan = self._fused_plan(plan)
                # a budget change re-plans on the model of a step that holds its gradients (it may split the
                # batch, and then does): the fixed bytes get them back
                costs_v = replace(costs_v, fixed_bytes=costs_v.fixed_bytes + self.fused_shift())
                update = self.update_bytes + (self.pageable_state if paged else 0)
            outcome = Outcome(_noted(plan, reasons), costs_v, first_run, planner_for(paged).sizes(),
                              page_state=paged, update_bytes=update, fused=fused, validated=validated)
            if more and fused and self.fuse == "auto" and plan.step_time_s >= 0.98 * self._unfused_best_s:
                # validation corrected the fused model into a plan no faster than holding the gradients promised:
                # that way is validated too, and the faster of the two validated plans taken
                log.info("the update fused into the backward validated a plan predicted at %.0f ms, no faster than "
                         "%.0f ms after it: trying that way", plan.step_time_s * 1e3, self._unfused_best_s * 1e3)
                fallback = fallback or outcome
                continue
            if fallback is not None and fallback.plan.step_time_s < outcome.plan.step_time_s:
                outcome = fallback  # validated, that way needed more: the earlier plan is the faster after all
            if more and not (fused and self.fuse is True) and outcome.plan.step_time_s >= SLOW_PLAN * unbudgeted_s:
                # ways are ordered by the model before any run (MobileNetV2, 80 MiB: state paged, micro-batches of 8 at
                # 1.49x, 210 ms; the fused update fits the batch at 148 ms); a way asked for is not traded for speed
                log.info("%s validated a plan predicted at %.0f ms, far slower than without a budget: trying the other "
                         "ways too", _mode_name(outcome.page_state, outcome.fused), outcome.plan.step_time_s * 1e3)
                fallback = outcome
                continue
            return outcome
        if fallback is not None:
            return fallback
        # no way fits: name the smallest of their smallest budgets (a retry there takes that way)
        raise above_budget(errors, self.budget)

    def state_io_s(self) -> float:
        """Predicted seconds a step spends writing the optimizer state out and reading it back."""
        return self.pageable_state * self.state_s_per_byte

    def _state_modes(self, planner_for: Callable[..., Planner]) -> list[tuple[bool, bool]]:
        """How to hold the optimizer state and the gradients, as ``(page the state, fuse the update)``, in
        the order to try: by the cost model's fastest plan each way (the page file's transfers and the fused
        update's calls added), the fastest first; each falls back to the next when it fits no validated
        plan."""
        modes = [(paged, False) for paged in self._paging_modes(planner_for)]
        if not self.fuse:
            return modes
        paged = self.can_page_state  # fused, the state goes out parameter by parameter: no update holds it all
        if self.fuse is True:
            return [(paged, True)] + modes
        try:
            t = planner_for(paged, True).plan(self.plan_budget).step_time_s + self.fused_s + \
                (self.state_io_s() if paged else 0.0)
        except BudgetError:
            return modes + [(paged, True)]  # a run may still fit where the model says not
        times = []
        for p, _ in modes:
            try:
                times.append(planner_for(p).plan(self.plan_budget).step_time_s + (self.state_io_s() if p else 0.0))
            except BudgetError:
                times.append(float("inf"))
        self._unfused_best_s = min(times, default=float("inf"))
        # fusing must win clearly: holding the gradients is the plainer step
        at = next((i for i, other in enumerate(times) if t < 0.98 * other), len(modes))
        return modes[:at] + [(paged, True)] + modes[at:]

    def _paging_modes(self, planner_for: Callable[..., Planner]) -> list[bool]:
        """Whether to page the optimizer state (the update after the passes), in the order to try: by the
        cost model's fastest plan each way (the page file's transfers added to the paged one), the faster
        first; ``"auto"`` falls back to the other when the first fits no validated plan."""
        if not self.can_page_state:
            return [False]
        if self.state_mode is True:
            return [True]
        times = {}
        for paged in (False, True):
            planner = planner_for(paged)
            try:
                times[paged] = planner.plan(self.plan_budget).step_time_s + (self.state_io_s() if paged else 0.0)
            except BudgetError:
                times[paged] = float("inf")
            if not paged and times[paged] == float("inf"):
                # the model holds every gradient through the backward; a full-batch step makes them as it goes
                # (Planner._gradients_later): resident state is tried first where that alone rules it out
                try:
                    times[paged] = planner.plan_gradients_later(self.plan_budget, self.grads).step_time_s
                except BudgetError:
                    pass
        # paging must win clearly: the transfers' cost is a estimate until steps measure it
        return [True, False] if times[True] < 0.98 * times[False] or times[False] == float("inf") else [False, True]

    def _paged_plan(self, plan: Plan, per_parameter: bool = False) -> Plan:
        from ..units import format_bytes

        io = self.state_io_s()
        where = self.state_dir or "the temporary directory"
        when = (f"kept in {where}, each parameter's read back for its update in the backward and written out again"
                if per_parameter else
                f"paged out to {where} during the forward and backward passes, read back for the update")
        return plan.replace(
            step_time_s=plan.step_time_s + io,
            metadata={**plan.metadata, "optimizer_state_paged_bytes": self.pageable_state,
                      "optimizer_state_io_s": io},
            notes=plan.notes + (f"optimizer state ({format_bytes(self.pageable_state)}) {when} "
                                f"(predicted {io * 1e3:.0f} ms a step)",))

    def _fused_plan(self, plan: Plan) -> Plan:
        from ..units import format_bytes

        return plan.replace(
            step_time_s=plan.step_time_s + self.fused_s,
            metadata={**plan.metadata, FUSED_KEY: True},
            notes=plan.notes + (f"optimizer update fused into the backward: each parameter is stepped as soon as its "
                                f"gradient is complete and the gradient freed ({format_bytes(self.fused_shift())} "
                                "of gradients never held at once; the same update as one optimizer.step())",))


def _mode_name(paged: bool, fused: bool) -> str:
    return ("the update fused into the backward" if fused else "the update after the backward") + \
        (", the optimizer state paged" if paged else "")


#: the plan metadata key of a step that fuses the optimizer update into the backward
FUSED_KEY = "optimizer_update_fused"


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
    name = getattr(chain, "model_name", None) or type(chain.model).__name__
    raise InputError(f"solver {solver!r} (or paging) needs a model torch.fx can trace; "
                     f"{name} runs as {len(chain)} blocks of its module tree, which "
                     "solver='dp', 'no_saving' and 'recompute_all' plan")


def _noted(plan: Plan, reasons: tuple[str, ...]) -> Plan:
    if not reasons:
        return plan
    notes = tuple(f"never micro-batched: {r}" for r in reasons)
    return plan.replace(notes=tuple(n for n in plan.notes if n not in notes) + notes)  # a plan noted before


def _runs(model: nn.Module, env: dict[str, Any]) -> bool:
    """Whether ``model`` runs on ``env`` (no gradients; its buffers and the generators put back after)."""
    try:
        with preserved_model_state(model), torch.no_grad():
            model(**env)
    except Exception:
        return False
    return True


def _in_child(fn: Callable[[], Any]) -> Any:
    """``fn()``'s value from a child forked as the analysis forks its own (:func:`run_in_child`), or None."""
    if not fork_available():
        return None
    res = run_in_child(fn)
    return res.value if res is not None and res.error is None else None
