"""`TrainStep`: one exact optimizer step over a logical batch, inside a memory budget, as :func:`edgetrain.prepare`
planned it; its guards (:mod:`edgetrain.planning.guards`) refuse what the plan did not measure."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch import nn

from ._state import (autocast_state, backward_outside_autocast, host_rng_state, rng_state, set_host_rng_state,
                     set_rng_state)
from .adaptation.controller import BudgetController
from .adaptation.table import PlanTable
from .batch import (batch_signature, batch_size_of, channels_last_images, describe_signature, signature_misfit,
                    slice_batch, split_batch)
from .capture import bind_inputs
from .capture.draws import drawing
from .errors import BudgetError, EdgetrainError, InputError
from .graph import CostChain, run_micro_batch_sizes
from .plan import Plan
from .units import format_bytes
from .planning.analysis import block_solver_options
from .planning.guards import (attribute_key, changed_attributes, check_autocast, check_constants, check_trainable,
                              describe_change, model_key, raise_for_one_sample)
from .planning.layout import LAYOUT_KEY
from .planning.loss import LossNorm
from .runtime.batchnorm import FullBatchStats
from .runtime.compiled import CompiledExecutor
from .runtime.executor import PlainExecutor, make_executor, needs_stages, step_draws

__all__ = ["TrainStep"]

log = logging.getLogger("edgetrain.api")


def _say_single_stage(chain: Any) -> None:
    """Warn, once for the step, why the model trains as one stage (capture itself only logs it: prepare's forked
    children capture the model too)."""
    if chain is not None and chain.warning:
        log.warning("%s", chain.warning)


_BATCH = object()  # step(batch): inputs and targets in one batch


class TrainStep:
    """A prepared training step. Call it with a batch to run one optimizer step; read ``plan``.

    Created by :func:`prepare`; holds references (never copies) to the user's model and optimizer.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
                 chain: Any, costs: CostChain, plan: Plan, *, budget_bytes: int | None, margin_bytes: int,
                 margin_share: float, signature: tuple[Any, ...], solver: str, pager: Any = None,
                 loss_norm: LossNorm | None = None, capture: Callable[[], Any] | None = None,
                 state_pager: Any = None, fused: Any = None, layout: str = "keep") -> None:
        self.model = model
        self.loss_norm = loss_norm or LossNorm("mean")
        self._model_key = model_key(model)
        # the parameters trained when the step was planned: a budgeted plan counts their gradients and the
        # activations their backward needs, and no more
        self._trainable = {id(p) for p in model.parameters() if p.requires_grad}
        self._constants: dict[str, Any] | None = None  # non-tensor inputs, fixed in the traced code
        self._autocast = autocast_state()  # the autocast regions prepare measured the plan under
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self._chain = chain
        self._capture = capture  # captures the chain where it was not (prepared without a budget)
        _say_single_stage(chain)
        self.costs = costs
        self.budget_bytes = budget_bytes
        self.margin_bytes = margin_bytes
        self.margin_share = margin_share  # prepare's safety_margin: a new budget holds back the same share
        self.solver = solver
        self._signature = signature
        self.layout = layout  # how each batch's images are fed: "keep" or "channels_last" (PlanConfig.layout)
        self._bn = FullBatchStats(model)
        self._plan = plan
        self._pager = pager
        #: pages the optimizer state out during the passes (an OptimizerStatePager), or None
        self.state_pager = state_pager
        #: updates each parameter inside the backward of a step that trains the batch in one piece (a
        #: :class:`~edgetrain.runtime.fused.FusedUpdate`), or None: one optimizer.step() after the backward
        self.fused = fused
        self._fused_last = False  # whether the last step updated inside its backward
        self._traced_attributes: dict[str, Any] | None = None  # set by _make_executor for traced code
        self._retraced = False
        #: the compiled forward and its measured peak (``PlanConfig(compile=True)``, :mod:`.planning.compiled`):
        #: plans it fits run compiled
        self.compiled: Any = None
        self._executor = self._make_executor(plan)
        self._defer_shared()
        self.page_dir: str | None = None
        self.elastic: Any = None
        self.steps_done = 0
        self._full_plan: Plan | None = None  # with elastic selection: the plan for full backpropagation
        #: the budget while training: plan table, lookups, the process's drift, the budget source
        self.budget = BudgetController(self)
        # Called once the whole batch's gradients are accumulated, just before optimizer.step() (the
        # Trainer clips gradients here); None: nothing.
        self.before_optimizer_step: Callable[[], None] | None = None

    @property
    def example_signature(self) -> tuple[Any, ...]:
        """Per-sample ``(shape, dtype, device)`` of the example's tensors: what the plan was made for
        (:func:`~edgetrain.batch.batch_signature`); batches no larger in any dimension run on it."""
        return self._signature

    @property
    def plan(self) -> Plan:
        """The plan in force."""
        return self._plan

    #: the forward draws random numbers (dropout); prepare's first samples, to check a split step's draws on
    draws_random: bool = False
    draw_example: dict[str, Any] | None = None

    @property
    def has_batchnorm(self) -> bool:
        """Whether the model has BatchNorm layers in training mode (micro-batching then changes its maths)."""
        return self._bn.has_batchnorm

    @property
    def chain(self) -> Any:
        """The captured chain of stages (:class:`edgetrain.capture.trace.Chain`). A step prepared without a budget
        whose plan recomputes nothing runs the model's own forward and captures it here on first use."""
        if self._chain is None:
            self._chain = self._captured()
            _say_single_stage(self._chain)
        return self._chain

    def _captured(self) -> Any:
        """The model captured afresh; capture runs it on the example, and the user's random streams must not
        move."""
        assert self._capture is not None
        state, host = rng_state(), host_rng_state()
        try:
            return self._capture()
        finally:
            set_rng_state(state)
            set_host_rng_state(host)

    def _make_executor(self, plan: Plan) -> Any:
        self._traced_attributes = None
        if self.budget_bytes is None and self._pager is None and not needs_stages(plan):
            # no budget and nothing recomputed: plain PyTorch's own forward, with no graph captured here
            executor: Any = PlainExecutor(self.model)
        else:
            executor = make_executor(self.chain, plan, self._bn, self._pager)
            if self.chain.method == "fx":  # traced code: plain attributes are baked in (see _retrace_if_changed)
                self._traced_attributes = attribute_key(self.model, self.chain)
        if self.compiled is not None and self.compiled.fits(plan, self.budget_bytes, self.margin_bytes):
            return self.compiled.executor(self.model, executor)
        return executor

    @property
    def runs_compiled(self) -> bool:
        """Whether the plan in force runs compiled (``PlanConfig(compile=True)`` and a plan it fits)."""
        return isinstance(self._executor, CompiledExecutor)

    def _retrace_if_changed(self, now: Any) -> None:
        """Re-trace the model where a plain attribute its traced code froze has changed since the capture (a
        temperature annealed by assignment, a mask tensor replaced), so the step computes with the new value;
        the plan stays (the same stages, the same costs). ``now``: the model's attribute key now."""
        if self._traced_attributes is None or now == self._traced_attributes:
            return
        changed = changed_attributes(self._traced_attributes, now)
        t0 = time.perf_counter()
        chain = self._captured()
        if len(chain) != len(self._chain) or chain.method != self._chain.method:
            raise InputError(f"model attribute(s) {', '.join(changed)} changed since edgetrain.prepare(), and the "
                             f"model traced again is cut otherwise ({len(chain)} {chain.method} stages, not "
                             f"{len(self._chain)}): the plan no longer fits it. Call edgetrain.prepare again.")
        self._chain = chain
        self._executor = self._make_executor(self._plan)
        if not self._retraced:
            log.warning("model attribute(s) %s changed since the model was traced: traced again (%.0f ms), and again "
                        "whenever they change, so that the step computes with the values set",
                        ", ".join(changed), 1e3 * (time.perf_counter() - t0))
        self._retraced = True

    def _uncompile_if_changed(self, now: Any) -> None:
        """Run eagerly from now on where a plain attribute of the model changed since it was compiled: its compiled
        code would compile again for the new value, and that compile's memory was never measured."""
        changed = self.compiled.changed(now) if self.compiled is not None else []
        if not changed:
            return
        log.warning("model attribute(s) %s changed since the step was compiled: it runs eagerly from now on (its "
                    "compiled code would compile again, unmeasured)", ", ".join(changed))
        self.compiled = None
        meta = self._plan.metadata
        self.set_plan(self._plan.replace(peak_bytes=meta.get("eager_peak_bytes", self._plan.peak_bytes),
                                         metadata={**meta, "compiled": False,
                                                   "not_compiled": "model attributes changed after compiling"}))

    @property
    def budget_source(self) -> Callable[[], int | str | None] | None:
        """Called before a step and between micro-batches; returns the budget in force (bytes or a size
        string) or None for "unchanged". Setting one builds the budget table at once (seconds), so that a
        change while training is a lookup (microseconds)."""
        return self.budget.source

    @budget_source.setter
    def budget_source(self, source: Callable[[], int | str | None] | None) -> None:
        if source is not None:
            self.budget.build_table()
        self.budget.source = source

    def __repr__(self) -> str:
        return (f"TrainStep(stages={len(self.costs.stages)}, micro_batch={self._plan.micro_batch_size}/"
                f"{self._plan.batch_size}, budget={self.budget_bytes})")

    def _check(self, inputs: Any, targets: Any) -> tuple[int, tuple[Any, ...]]:
        """The batch's size and per-sample signature, once it is one the plan runs (else an InputError)."""
        key = model_key(self.model)
        if key != self._model_key:
            raise InputError(f"the model changed after edgetrain.prepare(): {describe_change(self._model_key, key)}. "
                             "The prepared step runs the model as it was captured; put it back as it was "
                             "(e.g. model.train() before training), or call edgetrain.prepare again for the "
                             "model as it is now.")
        if self._traced_attributes is not None or self.compiled is not None:
            now = attribute_key(self.model, self._chain)  # once a step: it walks every module
            self._retrace_if_changed(now)
            self._uncompile_if_changed(now)
        check_autocast(self._autocast)
        if self.budget_bytes is not None and self.elastic is None:  # elastic selection sets its own flags
            check_trainable(self.model, self._trainable, self.budget_bytes)
        n = batch_size_of(inputs, targets)
        sig = batch_signature((inputs, targets))
        if sig != self._signature:  # smaller per sample runs on the plan (see __call__); anything else is refused
            misfit = signature_misfit(sig, self._signature)
            if misfit is not None:
                raise InputError(misfit)
        if n > self._plan.batch_size:
            raise InputError(f"batch of {n} samples is larger than the {self._plan.batch_size} the step was "
                             "prepared for (the budget was planned for that batch); prepare with a larger example")
        return n, sig

    def __call__(self, inputs: Any, targets: Any = _BATCH) -> float:
        """One optimizer step over the whole batch; returns its mean loss.

        ``step(inputs, targets)``, or ``step(batch)`` with a batch as ``prepare``'s example takes it (a mapping
        with ``labels``: a Hugging Face collator's). The batch is split into micro-batches of the plan; each
        micro-batch loss is weighted by what it contributes to the batch's, so gradients equal the full batch's.
        """
        if targets is _BATCH:
            inputs, targets = split_batch(inputs, "the batch")
        n, sig = self._check(inputs, targets)
        if self.layout == "channels_last":
            inputs = channels_last_images(inputs)  # a copy the plan counts (planning.layout.with_layout)
        try:
            return self._step(inputs, targets, n)
        except EdgetrainError:
            raise
        except Exception as e:
            if sig == self._signature:
                raise
            # smaller per sample than the example: the model may not take other sizes in every dimension
            raise InputError(f"the step failed on a batch that does not match the example given to prepare() (per "
                             f"sample: {describe_signature(sig)}, against {describe_signature(self._signature)}):"
                             f" {type(e).__name__}: {e}. A batch may be smaller than the example only where the "
                             "model takes other sizes (a sequence's length, an image's size); prepare again with an "
                             "example shaped like this batch otherwise.") from e

    def _step(self, inputs: Any, targets: Any, n: int) -> float:
        self.budget.poll()
        self.budget.cap_pool()
        if self.elastic is not None:
            if self.elastic.maybe_reselect(self.steps_done, (inputs, targets)):
                self.replan_for_selection()
        t_step = time.perf_counter()  # the step's own time, for the elastic selector's closed loop
        env_full = bind_inputs(self.model, inputs)
        self._constants = check_constants(env_full, self._constants)
        held = self.budget.before_step(n)
        self.optimizer.zero_grad(set_to_none=True)
        if self.state_pager is not None:
            self.state_pager.page_out()  # back in memory for the update, with the gradients, not the activations
        fused = self.fused if self._plan.micro_batch_size >= n else None
        if fused is not None and self.before_optimizer_step is not None:
            raise InputError("this step updates each parameter inside the backward (its plan fuses the update), so "
                             "there are no gradients to act on before the update: prepare it with "
                             "PlanConfig(fused_update=False) to clip or read gradients")
        self._fused_last = fused is not None
        self._bn.begin_step(n, self._plan.micro_batch_size)
        norm = self.loss_norm
        total_weight = norm.weight(targets, n) if self._plan.micro_batch_size < n else 1.0
        losses: list[tuple[float, float]] = []
        start = size = 0
        # compiled: the compiler's settings around forward and backward (each compiles at its first run)
        compiler = self._executor.context() if self.runs_compiled else nullcontext()
        try:
            with compiler, drawing(step_draws(self, n)) as draws:
                while start < n:
                    size = run_micro_batch_sizes(n - start, self._plan.micro_batch_size)[0]  # a budget may change m
                    # the whole batch is not sliced: a process's first slice faults in indexing code (up to 0.6 MiB
                    # of pages, 0.1 MiB on a small transformer that slices itself) plain PyTorch's loop never runs
                    env = dict(env_full) if size == n else {k: slice_batch(v, start, start + size)
                                                            for k, v in env_full.items()}
                    part = targets if size == n else slice_batch(targets, start, start + size)
                    self._bn.micro_batch()
                    draws.micro_batch(start, size)
                    # the output is not held through backward (plain PyTorch's loop frees it once the loss is made)
                    loss = self.loss_fn(self._executor.forward(env), part)
                    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                        raise InputError("loss_fn must return a scalar tensor (the mean loss over the batch it is "
                                         f"given), got {type(loss).__name__} {getattr(loss, 'shape', '')}")
                    weight = total_weight if size == n else norm.weight(part, size)
                    scale = norm.scale(weight, total_weight)
                    if weight or scale:  # a slice whose targets all weigh 0 adds nothing (its mean is 0/0)
                        with backward_outside_autocast(), (fused.armed() if fused is not None else nullcontext()):
                            (loss if scale == 1.0 else loss * scale).backward()  # autocast: PyTorch's recipe
                        losses.append((float(loss.detach()), weight))
                    del loss, env, part
                    start += size
                    if self._pager is not None:
                        self._pager.reset()  # raises PagingError (e.g. disk full) before the optimizer steps
                    if start < n:
                        self.budget.poll()  # a budget change re-plans the samples still to run
                if self.before_optimizer_step is not None:
                    self.before_optimizer_step()
        except BaseException as e:
            self._bn.abort()
            self.optimizer.zero_grad(set_to_none=True)
            if fused is not None and fused.stepped:
                e.add_note(f"edgetrain: the step stopped inside its backward after updating {fused.stepped} "
                           "parameter(s) (the update is fused into the backward): the model is part way through "
                           "this step; restore it from the last checkpoint before training on. If the error names "
                           "a variable modified by an inplace operation, the model reads a parameter without its "
                           "gradient after that gradient is complete: prepare with PlanConfig(fused_update=False)")
            if size == 1:
                raise_for_one_sample(e, n, self._plan.micro_batch_size)
            raise
        if fused is None:
            if self.state_pager is not None:
                self.state_pager.page_in()  # (the optimizer's step hook would too; here the order is plain)
            self.optimizer.step()
        self._bn.finish()
        self.steps_done += 1
        if self.elastic is not None:
            self.elastic.record_step_time(time.perf_counter() - t_step, samples=n)
        self.budget.after_step(n, held)
        return losses[0][0] if len(losses) == 1 else norm.combine(losses, total_weight)

    def trained_parameters(self) -> list[nn.Parameter]:
        """The parameters the last step updated from a gradient (those it made a gradient for). After a step
        that fused the update into the backward no gradient is left to look at; this works either way."""
        if self._fused_last and self.fused is not None:
            ids = self.fused.stepped_ids
            return [p for p in self.model.parameters() if id(p) in ids]
        return [p for p in self.model.parameters() if p.grad is not None]

    def set_plan(self, plan: Plan) -> None:
        """Execute ``plan`` from the next micro-batch on (it must be a plan of this step's chain)."""
        if plan.num_stages != len(self.costs.stages):
            raise ValueError(f"plan has {plan.num_stages} stages, this step's chain {len(self.costs.stages)}")
        if "page" in plan.policies and self._pager is None:
            from .runtime.paging import Pager

            self._pager = Pager(self.page_dir, keep=list(self.model.parameters()))
        if self.layout != "keep":
            plan = plan.replace(metadata={**plan.metadata, LAYOUT_KEY: self.layout})
        self._plan = plan  # before the executor: it is chosen for the plan in force
        self._executor = self._make_executor(plan)
        if self.runs_compiled:
            self._plan = self.compiled.mark(plan)
        self._defer_shared()

    def _defer_shared(self) -> None:
        """A fused update leaves the parameters that several stages read to the end (runtime.fused.deferred)."""
        if self.fused is not None:
            from .runtime.fused import deferred

            self.fused.defer = deferred(self.chain)

    def budget_table(self) -> PlanTable:
        """The :class:`~edgetrain.adaptation.PlanTable` a budget change looks plans up in (built once)."""
        return self.budget.build_table()

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
        return self.budget.set_budget(memory_budget)

    def expect_batch_size(self, n: int) -> Plan:
        """Make room now for batches of ``n`` samples that will come later (an epoch's short last batch).

        A micro-batch size run for the first time leaves oneDNN kernels and allocator heap resident for good
        (MobileNetV2 at 32x32: 4-6 MiB), which the plan, validated at the example's size, did not hold: a
        dataset of 40 samples in batches of 32 trained inside an 80 MiB budget until its batch of 8, and at
        81-82 MiB in every step after it. So the plan is run once here on the first ``n`` samples of
        ``prepare``'s example (the model's state, gradients and RNG put back), leaving that memory resident
        before training, and the budget in force is planned again from what the process then holds, as a
        budget change is (:meth:`set_memory_budget`), unless the plan has room for what the run left. Without
        a budget, or when those sizes have run, nothing is done.

        Returns:
            The plan in force afterwards.

        Raises:
            BudgetError: no plan fits the budget with those sizes' kernels resident; ``min_feasible_bytes``
                names the budget that would.
        """
        b = self.budget
        if self.budget_bytes is None or b.validate is None or not 0 < n < self._plan.batch_size:
            return self._plan
        sizes = run_micro_batch_sizes(n, self._plan.micro_batch_size)
        if b.seen_micro.issuperset(sizes):
            return self._plan
        held = b.held()
        b.validate(self._plan.replace(batch_size=n, micro_batch_size=min(self._plan.micro_batch_size, n)))
        b.seen_micro.update(sizes)
        left = max(0, b.held() - held)
        if self._plan.peak_bytes + left <= self.budget_bytes - self.margin_bytes:
            log.info("batches of %d samples run once ahead: they left %s resident, which the plan has room for",
                     n, format_bytes(left))
            return self._plan
        log.info("batches of %d samples run once ahead left %s resident; planning the budget again", n,
                 format_bytes(left))
        self.optimizer.zero_grad(set_to_none=True)  # spent before the next step, which starts from none
        try:
            return self.set_memory_budget(self.budget_bytes)
        except BudgetError as e:
            raise BudgetError(
                f"batches of {n} samples (an epoch's short last batch) run shapes the plan was not validated at, "
                f"and their kernels stay resident ({format_bytes(left)} here): no plan fits the budget of "
                f"{format_bytes(self.budget_bytes)} beside them. Raise it to at least "
                f"{format_bytes(e.min_feasible_bytes)}, or use a batch size that divides the data (or drop the "
                "last batch: DataLoader(drop_last=True)).", budget_bytes=self.budget_bytes,
                min_feasible_bytes=e.min_feasible_bytes) from None

    def replan_for_selection(self, reset: bool = False) -> Plan:
        """After an elastic (re-)selection, plan only the trained suffix of the chain.

        Stages before the one holding the deepest selected tensor need no gradient, so autograd saves
        nothing there: they run forward only, and the budget they would have taken goes to the trained
        stages (fewer recomputed). The plan of the full chain, an upper bound for every selection, stays
        in force when the suffix plan does not fit or there is no budget. Called by the step itself;
        ``reset`` after a budget change, whose new plan is the full chain's.
        """
        if reset:
            self._full_plan = None
        if self.elastic is None or self.budget_bytes is None or self._pager is not None:
            return self._plan
        from .approx.elastic.memory import first_trained_stage, plan_trained_suffix

        if self._full_plan is None:
            self._full_plan = self._plan
        names = {id(m): n for n, m in self.model.named_modules()}
        layers = [[names[id(sub)] for mod in st.modules for sub in mod.modules() if id(sub) in names]
                  for st in self.chain.stages]
        first = first_trained_stage(layers, self.elastic.deepest_layer)
        plan = plan_trained_suffix(self._full_plan, self.costs, first, self.budget_bytes - self.margin_bytes,
                                   block_solver_options(self.chain, "dp"))
        self.set_plan(plan)
        return plan

    def report(self, path: str, batch: Any = None, **options: Any) -> Any:
        """Write the plan report (HTML with embedded figures, and PNGs beside it) to ``path``; ``batch`` (inputs,
        targets) is run once to measure the memory timeline (see :func:`edgetrain.report.write_report`)."""
        from .report import write_report

        return write_report(self, path, batch=batch, **options)

    def close(self) -> None:
        """Remove edgetrain's hooks on the model and the optimizer, and its page files (state read back first)."""
        self._bn.close()
        if self._pager is not None:
            self._pager.close(raise_errors=False)
        if self.state_pager is not None:
            self.state_pager.close()
            self.state_pager = None

    def __enter__(self) -> "TrainStep":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


