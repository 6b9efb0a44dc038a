"""`prepare()` and `TrainStep`: one exact optimizer step over a logical batch, inside a memory budget."""

from __future__ import annotations

import logging
import math
import time
import warnings
from typing import Any, Callable

import torch
from torch import nn

from .profile import memory
from .planning.analysis import Analysis, Outcome, block_solver_options
from .profile.fork import analyse_safely
from .planning.guards import describe_change, loss_norm_safely, model_key
from .planning.loss import LossNorm
from .planning.planner import Measured, budget_for, first_run_cost, safety_margin_bytes
from ._state import batchnorm_modules
from .batch import batch_signature, batch_size_of, slice_batch
from .capture import bind_inputs
from .errors import BudgetError, InputError
from .graph import CostChain, micro_batch_sizes
from .plan import Plan
from .profile.stages import optimizer_costs
from .runtime import pool
from .runtime.batchnorm import FullBatchStats
from .runtime.executor import make_executor
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
                 margin_share: float, signature: tuple[Any, ...], solver: str, pager: Any = None,
                 loss_norm: LossNorm | None = None) -> None:
        self.model = model
        self.loss_norm = loss_norm or LossNorm("mean")
        self._model_key = model_key(model)
        self._constants: dict[str, Any] | None = None  # non-tensor inputs, fixed in the traced code
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.chain = chain
        self.costs = costs
        self.budget_bytes = budget_bytes
        self.margin_bytes = margin_bytes
        self.margin_share = margin_share  # prepare's safety_margin: a new budget holds back the same share
        self.solver = solver
        self._signature = signature
        self._bn = FullBatchStats(model)
        self._plan = plan
        self._pager = pager
        self._executor = make_executor(chain, plan, self._bn, pager)
        self._table: Any = None
        self._fixed_micro = False
        self.page_dir: str | None = None
        self.elastic: Any = None
        self.steps_done = 0
        self._budget_source: Callable[[], int | str | None] | None = None
        self._full_plan: Plan | None = None  # with elastic selection: the plan for full backpropagation
        # Runs a plan once on prepare's example and measures it (set by prepare when there is a budget).
        self._validate: Callable[[Plan], Measured] | None = None
        self._opt_state_bytes = 0  # optimizer state the first step creates
        # Micro-batch sizes run in this process, and the most a size's first run has cost beyond the cost
        # model (kernel caches for new shapes): a budget change to a size not yet run keeps that in hand.
        self._seen_micro: set[int] = set()
        self._micro_sizes: list[int] | None = None  # the sizes the model accepts (None: any)
        self._first_run_bytes = 0
        # Called once the whole batch's gradients are accumulated, just before optimizer.step() (the
        # Trainer clips gradients here); None: nothing.
        self.before_optimizer_step: Callable[[], None] | None = None

    @property
    def plan(self) -> Plan:
        """The plan in force."""
        return self._plan

    @property
    def budget_source(self) -> Callable[[], int | str | None] | None:
        """Called before a step and between micro-batches; returns the budget in force (bytes or a size
        string) or None for "unchanged". Setting one builds the budget table at once (seconds), so that a
        change while training is a lookup (microseconds)."""
        return self._budget_source

    @budget_source.setter
    def budget_source(self, source: Callable[[], int | str | None] | None) -> None:
        if source is not None:
            self.budget_table()
        self._budget_source = source

    def __repr__(self) -> str:
        return (f"TrainStep(stages={len(self.chain)}, micro_batch={self._plan.micro_batch_size}/"
                f"{self._plan.batch_size}, budget={self.budget_bytes})")

    def _check(self, inputs: Any, targets: Any) -> int:
        key = model_key(self.model)
        if key != self._model_key:
            raise InputError(f"the model changed after edgetrain.prepare(): {describe_change(self._model_key, key)}. "
                             "The prepared step runs the model as it was captured; put it back as it was "
                             "(e.g. model.train() before training), or call edgetrain.prepare again for the "
                             "model as it is now.")
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
        self._poll_budget()
        self._cap_pool()
        if self.elastic is not None:
            if self.elastic.maybe_reselect(self.steps_done, (inputs, targets)):
                self.replan_for_selection()
        t_step = time.perf_counter()  # the step's own time, for the elastic selector's closed loop
        env_full = bind_inputs(self.model, inputs)
        constants = {k: v for k, v in env_full.items() if not isinstance(v, torch.Tensor)}
        if self._constants is None:
            self._constants = constants
        elif constants != self._constants:
            changed = sorted(k for k in set(constants) | set(self._constants)
                             if constants.get(k) != self._constants.get(k))
            raise InputError(f"non-tensor input(s) {', '.join(changed)} differ from the first step's "
                             f"({', '.join(f'{k}={self._constants.get(k)!r}' for k in changed)}): edgetrain traced the "
                             "model with them fixed. Prepare a step for each setting.")
        new_sizes = not self._seen_micro.issuperset(micro_batch_sizes(n, self._plan.micro_batch_size))
        held = self._held() if new_sizes and self.steps_done else None
        self.optimizer.zero_grad(set_to_none=True)
        accumulate = self._plan.micro_batch_size < n and self._bn.has_batchnorm
        self._bn.begin(accumulate)
        norm = self.loss_norm
        total_weight = norm.weight(targets, n) if self._plan.micro_batch_size < n else 1.0
        losses: list[tuple[float, float]] = []
        start = 0
        try:
            while start < n:
                size = min(self._plan.micro_batch_size, n - start)
                env = {k: slice_batch(v, start, start + size) for k, v in env_full.items()}
                part = slice_batch(targets, start, start + size)
                out = self._executor.forward(env)
                loss = self.loss_fn(out, part)
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise InputError("loss_fn must return a scalar tensor (the mean loss over the batch it is "
                                     f"given), got {type(loss).__name__} {getattr(loss, 'shape', '')}")
                weight = total_weight if size == n else norm.weight(part, size)
                scale = norm.scale(weight, total_weight)
                if weight or scale:  # a slice whose targets all weigh 0 adds nothing (its mean is 0/0)
                    (loss if scale == 1.0 else loss * scale).backward()
                    losses.append((float(loss.detach()), weight))
                del out, loss, env, part
                start += size
                if self._pager is not None:
                    self._pager.reset()  # raises PagingError (e.g. disk full) before the optimizer steps
                if start < n:
                    self._poll_budget()  # a budget change re-plans the samples still to run
            if self.before_optimizer_step is not None:
                self.before_optimizer_step()
        except BaseException:
            self._bn.abort()
            self.optimizer.zero_grad(set_to_none=True)
            raise
        self.optimizer.step()
        self._bn.finish()
        self.steps_done += 1
        if self.elastic is not None:
            self.elastic.record_step_time(time.perf_counter() - t_step, samples=n)
        if held is not None:  # what this size's first run left behind bounds the next new size's
            self._first_run_bytes = max(self._first_run_bytes, self._held() - held)
        self._seen_micro.update(micro_batch_sizes(n, self._plan.micro_batch_size))
        return losses[0][0] if len(losses) == 1 else norm.combine(losses, total_weight)

    def set_plan(self, plan: Plan) -> None:
        """Execute ``plan`` from the next micro-batch on (it must be a plan of this step's chain)."""
        if plan.num_stages != len(self.chain):
            raise ValueError(f"plan has {plan.num_stages} stages, this step's chain {len(self.chain)}")
        if "page" in plan.policies and self._pager is None:
            from .runtime.paging import Pager

            self._pager = Pager(self.page_dir, keep=list(self.model.parameters()))
        self._executor = make_executor(self.chain, plan, self._bn, self._pager)
        self._plan = plan

    def budget_table(self) -> Any:
        """The :class:`~edgetrain.planners.PlanTable` a budget change looks plans up in (built once)."""
        if self._table is None:
            from .planners import PlanTable

            # A budget change may change the micro-batch size, even one fixed at prepare().
            table = PlanTable.build(self.costs, micro_batch_sizes=self._micro_sizes,
                                    **block_solver_options(self.chain, "dp"))
            if self._validate is not None and self.budget_bytes is not None:
                # The last step's gradients are spent (the next step starts from zero); freeing them lets
                # the measuring run allocate its own, as a step does.
                self.optimizer.zero_grad(set_to_none=True)
                room = self.budget_bytes - self.margin_bytes - self._drift()
                probed = first_run_cost(table, self._seen_micro, self._validate, room, self.costs.fixed_bytes,
                                        _grad_bytes_missing(self.model))
                if probed is not None:  # replaces prepare's bound, which held every first-run effect
                    self._seen_micro.add(probed[0])
                    self._first_run_bytes = probed[1]
            self._table = table
        return self._table

    def set_memory_budget(self, memory_budget: int | str) -> Plan:
        """Switch to the best plan for a new budget (a table lookup, microseconds once the table is built).

        The table (:meth:`budget_table`) holds the exact plan at a geometric grid of budgets. The fastest
        plan is taken whose grid budget, plus what the process now holds beyond the cost model's fixed
        bytes (kernel caches of shapes run since prepare, allocator slack: read from resident memory at
        the call), plus, for a micro-batch size not yet run here, the first-run cost measured when the
        table was built, fits the new budget less the margin. Building the table runs its smallest
        micro-batch size once (if not yet run) and frees the last step's gradients, which the next step
        would discard anyway.

        Safe between steps and, through ``budget_source``, between micro-batches: the optimizer state,
        the gradients accumulated so far and the samples still to run are kept.

        Raises:
            BudgetError: no plan fits the new budget; the plan in force, the model and the optimizer are
                left exactly as they were. ``min_feasible_bytes`` is what the process needs now plus 2%.
        """
        budget = parse_bytes(memory_budget)
        margin = safety_margin_bytes(budget, self.margin_share)
        table = self.budget_table()  # built first: its measuring run adds to what the process holds
        drift = self._drift()

        batch = self._plan.batch_size
        new = {m for m in {p.micro_batch_size for p in table.plans}
               if not self._seen_micro.issuperset(micro_batch_sizes(batch, m))}

        def need(i: int) -> int:  # plan budget table entry i needs, with the first run of a new size
            extra = self._first_run_bytes if table.plans[i].micro_batch_size in new else 0
            return table.budgets[i] + drift + extra

        plan_budget = budget - margin
        fits = [i for i in range(len(table)) if need(i) <= plan_budget]
        if not fits:
            # what this process needs now, plus 2%: kernel caches differ by a few hundred KiB from one
            # process to the next, and a retry at the named budget in a fresh process must work
            least = math.ceil(budget_for(min(need(i) for i in range(len(table))), self.margin_share) * 1.02)
            raise BudgetError(
                f"no plan fits the new budget {format_bytes(budget)}: the smallest this process can train in now "
                f"is {format_bytes(least)} (it holds {format_bytes(drift)} more than when it was planned: kernel "
                "caches of the shapes run since). The plan in force is unchanged; raise the budget to at least "
                "that.", budget_bytes=budget, min_feasible_bytes=least)
        plan = table.plans[fits[-1]]
        if plan.micro_batch_size < self._plan.batch_size and self._bn.has_batchnorm:
            plan = plan.replace(bn_micro_batched=True)
        self.set_plan(plan.replace(budget_bytes=budget))
        self.budget_bytes, self.margin_bytes = budget, margin
        pool.reset_peak()  # the old plan's high-water mark must not let the cache hold more than the new one
        self._cap_pool()
        if self.elastic is not None:
            self._full_plan = None
            self.replan_for_selection()
        log.info("budget now %s: micro-batch %d, %d recomputed", format_bytes(budget), plan.micro_batch_size,
                 plan.policies.count("recompute"))
        return self._plan

    def replan_for_selection(self) -> Plan:
        """After an elastic (re-)selection, plan only the trained suffix of the chain.

        Stages before the one holding the deepest selected tensor need no gradient, so autograd saves
        nothing there: they run forward only, and the budget they would have taken goes to the trained
        stages (fewer recomputed). The plan of the full chain, an upper bound for every selection, stays
        in force when the suffix plan does not fit or there is no budget. Called by the step itself.
        """
        if self.elastic is None or self.budget_bytes is None or self._pager is not None:
            return self._plan
        from .approx.elastic.memory import elastic_chain, first_trained_stage
        from .planners import solve

        if self._full_plan is None:
            self._full_plan = self._plan
        names = {id(m): n for n, m in self.model.named_modules()}
        layers = [[names[id(sub)] for mod in st.modules for sub in mod.modules() if id(sub) in names]
                  for st in self.chain.stages]
        first = first_trained_stage(layers, self.elastic.deepest_layer)
        full = self._full_plan
        if first == 0 or first >= len(self.chain):
            self.set_plan(full)
            return full
        ec = elastic_chain(self.costs, first)
        micro = full.micro_batch_size
        budget = self.budget_bytes - self.margin_bytes
        try:
            sub = solve(ec.chain, budget, solver="dp", micro_batch_sizes=[micro],
                        **block_solver_options(self.chain, "dp"))
        except BudgetError:
            self.set_plan(full)
            return full
        prefix_peak = int(ec.prefix_peak_bytes(micro) + self.costs.fixed_bytes)
        if prefix_peak > budget:
            self.set_plan(full)
            return full
        plan = full.replace(
            policies=("keep",) * first + sub.policies,
            groups=tuple(range(first)) + tuple(g + first for g in sub.groups),
            peak_bytes=max(sub.peak_bytes, prefix_peak), step_time_s=sub.step_time_s,
            notes=full.notes + (f"elastic selection: stages 0-{first - 1} frozen (forward only, nothing saved); "
                                "planned for the trained suffix",))
        self.set_plan(plan)
        log.info("elastic re-plan: %d frozen stages, %d of %d trained stages recomputed", first,
                 sub.policies.count("recompute"), len(sub.policies))
        return plan

    def _drift(self) -> int:
        """How much more the process holds at rest than the cost model's fixed bytes say.

        Every new tensor shape leaves oneDNN kernels and caches behind, and allocators keep what they
        freed; read now (resident memory less the pool's cache, plus the gradients and optimizer state a
        step will still allocate), so that a budget change plans with it.
        """
        if self._validate is None:
            return 0
        missing = _grad_bytes_missing(self.model) + (0 if self.optimizer.state else self._opt_state_bytes)
        return max(0, self._held() + missing - self.costs.fixed_bytes)

    @staticmethod
    def _held() -> int:
        """Resident bytes above the import baseline, less what the tensor pool caches for reuse."""
        return memory.rss_bytes() - memory.baseline_rss_bytes() - pool.stats().cached_bytes

    def _cap_pool(self) -> None:
        """Let the tensor pool cache only what the budget leaves beside the memory outside the pool."""
        if not pool.installed() or self.budget_bytes is None:
            return
        st = pool.stats()
        outside = memory.rss_bytes() - st.live_bytes - st.cached_bytes
        pool.set_cap(self.budget_bytes - self.margin_bytes + memory.baseline_rss_bytes() - outside)

    def _poll_budget(self) -> None:
        if self.budget_source is None:
            return
        new = self.budget_source()
        if new is not None and parse_bytes(new) != self.budget_bytes:
            self.set_memory_budget(new)

    def report(self, path: str, batch: Any = None, **options: Any) -> Any:
        """Write the plan report (HTML with embedded figures, and the PNGs beside it) to ``path``.

        ``batch`` (inputs, targets) is run once, model and optimizer restored afterwards, to measure the
        memory timeline; see :func:`edgetrain.report.write_report` for ``options``.
        """
        from .report import write_report

        return write_report(self, path, batch=batch, **options)

    def close(self) -> None:
        """Remove the hooks edgetrain put on the model and the page file, if any."""
        self._bn.close()
        if self._pager is not None:
            self._pager.close(raise_errors=False)

    def __enter__(self) -> "TrainStep":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
            example: Any, memory_budget: int | str | None = None, *, micro_batch_size: int | None = None,
            solver: str = "dp", max_stages: int = 48, tune_allocator: bool = True,
            exact_batchnorm: bool = True,
            safety_margin: float = 0.03, use_cache: bool = True, name: str | None = None,
            paging: bool = False, page_dir: str | None = None, device: Any = "host", objective: str = "time",
            time_budget: float | None = None, speedup: Any = None, grad_filter: Any = None,
            plan: Plan | None = None, costs: CostChain | None = None) -> TrainStep:
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
        tune_allocator: install edgetrain's CPU tensor pool (``edgetrain.runtime.pool``: freed tensor memory is
            reused but never held beyond the peak of live tensors) and fix glibc's mmap threshold for the rest
            (process-wide).
        exact_batchnorm: for models with BatchNorm in training mode, prefer plans without micro-batching
            (identical to plain PyTorch) and micro-batch only if no such plan fits.
        safety_margin: share of the budget held back for what validation cannot see of a real step
            (allocator noise, code and heap a process touches that its fork did not), and at least
            ``MIN_MARGIN_BYTES`` (1 MiB) when above 0.
        use_cache: reuse profiles measured earlier on this machine.
        name: model name for reports.
        paging: let the planner page tensors saved for backward to storage (``page_dir``) as well as
            recompute (POET-style); uses the ``"poet"`` planner unless ``solver="poet-milp"``.
        page_dir: directory of the page file (CPU training; default a temp directory). Put it on the
            storage you want to page to.
        device: device profile the paging planner costs transfers and energy with: ``"host"`` (measured
            here), a bundled profile name (``edgetrain.devices.list_profiles()``) or a ``DeviceProfile``.
        objective: with paging or a time budget, minimise ``"time"`` or ``"energy"``.
        time_budget: at most this multiple of the fastest step's time (e.g. 1.3); uses the POET planner.
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

    Returns:
        The :class:`TrainStep`.

    Raises:
        BudgetError: no plan fits; ``min_feasible_bytes`` names the smallest budget that would.
        CaptureError: the model does not run on the example.
        InputError: the example is malformed.
    """
    inputs, targets = _split_example(example)
    batch = batch_size_of(inputs, targets)
    if grad_filter is not None:
        from .approx import apply_grad_filter

        probe = slice_batch(inputs, 0, min(batch, 2)) if isinstance(inputs, torch.Tensor) else None
        report = apply_grad_filter(model, grad_filter, example_input=probe)
        log.info("gradient filtering: %s", report)
    budget = None if memory_budget is None else parse_bytes(memory_budget)
    if not 0 <= safety_margin < 0.5:
        raise ValueError(f"safety_margin must be in [0, 0.5), got {safety_margin}")
    if micro_batch_size is not None and not 1 <= micro_batch_size:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if tune_allocator:
        memory.tune_allocator()
        pool.install()
    pool.set_cap(None)
    pool.release()  # memory cached for reuse is not in use: measure from live tensors only
    rss_start = memory.rss_bytes()
    in_use = max(0, rss_start - memory.baseline_rss_bytes())
    opt_costs = optimizer_costs(optimizer)
    fixed = in_use + _grad_bytes_missing(model) + opt_costs.state_bytes
    margin = 0 if budget is None else safety_margin_bytes(budget, safety_margin)
    env = bind_inputs(model, inputs)
    loss_norm = loss_norm_safely(model, env, loss_fn, targets, batch)
    has_bn = any(m.training for _, m in batchnorm_modules(model))
    min_micro = 2 if has_bn and batch >= 2 else 1
    solver_kw: dict[str, Any] = {}
    pager = None
    if paging or time_budget is not None or solver.startswith("poet"):
        from .devices import DeviceProfile, load_profile

        dev_profile = device if isinstance(device, DeviceProfile) else load_profile(device)
        solver = solver if solver.startswith("poet") else "poet"
        solver_kw = {"device": dev_profile, "objective": objective, "time_budget": time_budget, "paging": paging}
    if paging:
        from .runtime.paging import Pager

        pager = Pager(page_dir, keep=list(model.parameters()))
    analysis = Analysis(model, inputs, env, targets, loss_fn, batch, fixed, rss_start, budget, margin, solver,
                        solver_kw, micro_batch_size, has_bn and exact_batchnorm, min_micro, opt_costs.update_bytes,
                        opt_costs.state_bytes, _grad_bytes_missing(model), max_stages, use_cache,
                        name or type(model).__name__, pager, optimizer, safety_margin,
                        () if loss_norm.splittable else (
                            "the loss is neither a mean nor a sum over samples on the example batch (split in "
                            "two, its parts do not add up to the whole), so micro-batches could not reproduce "
                            "its gradients",))
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
        outcome = Outcome(plan, costs, 0, [batch] if reasons else None)
    else:
        chain, outcome = analyse_safely(analysis.capture_chain, analysis.analyse, budget, pager is None,
                                        profile=analysis.profile)
    plan, costs = outcome.plan, outcome.costs
    if has_bn and plan.num_micro_batches > 1:
        plan = plan.replace(bn_micro_batched=True)
        warnings.warn(f"{plan.num_micro_batches} micro-batches: BatchNorm normalises each micro-batch of "
                      f"{plan.micro_batch_size} with its own statistics, so gradients differ slightly from one "
                      "full-batch step (running statistics stay exact). Raise the budget to avoid it.",
                      stacklevel=2)
    log.info("edgetrain plan:\n%s", plan.summary())
    if pager is not None and "page" not in plan.policies:
        pager.close()
        pager = None
    step = TrainStep(model, optimizer, loss_fn, chain, costs, plan, budget_bytes=budget, margin_bytes=margin,
                     margin_share=0.0 if budget is None else safety_margin,
                     signature=batch_signature((inputs, targets)), solver=solver, pager=pager,
                     loss_norm=loss_norm)
    step._fixed_micro = micro_batch_size is not None
    step._micro_sizes = outcome.sizes
    if budget is not None:
        step._validate = analysis.validator(chain)
        step._seen_micro = set(micro_batch_sizes(batch, plan.micro_batch_size))
        step._first_run_bytes = outcome.first_run_bytes
        step._opt_state_bytes = opt_costs.state_bytes
    step.page_dir = page_dir
    if speedup is not None:
        from .approx.elastic.selector import ElasticConfig, ElasticSelector

        cfg = speedup if isinstance(speedup, ElasticConfig) else ElasticConfig(speedup=float(speedup))
        probe = (slice_batch(inputs, 0, plan.micro_batch_size), slice_batch(targets, 0, plan.micro_batch_size))
        step.elastic = ElasticSelector(cfg).attach(model, optimizer, probe, loss_fn)
        step.replan_for_selection()
    return step
