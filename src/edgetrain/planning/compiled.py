"""``PlanConfig(compile=True)``: whether a prepared step runs compiled, decided on a measurement.

The step is compiled only where its plan keeps every activation (nothing for edgetrain's stages to do) and
the batch is trained in one piece or its model has no BatchNorm (whose statistics a split batch combines
through hooks on every call). With a budget, two compiled steps run in a fork of this process first, on the
example, the first of them compiling; their peak, compiler and generated code included, is what the step's
plan then predicts, and it must fit the budget less the margin. Where it does not, or compiling fails, the
step runs eagerly on the plan made for it, and a warning says why and what budget would run it compiled.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from ..batch import slice_batch
from ..capture import bind_inputs
from ..graph import KEEP, run_micro_batch_sizes
from ..plan import Plan
from ..profile import fork
from ..runtime.compiled import CompiledExecutor, compiled_forward, shape_key
from ..units import format_bytes
from .budgets import budget_for

__all__ = ["CompiledStep", "why_not_compiled", "compile_step"]

log = logging.getLogger("edgetrain.api")

#: steps a trial runs compiled: the first compiles, the second runs as every later step will
TRIAL_STEPS = 2
#: what a compiled step's plan holds beyond its trial's peak: this process's own compiled steps peaked 0.1-0.2
#: MiB over the fork's trial (MobileNetV2, 64x64, batch 32: 283.6-283.7 against 283.5 MiB, in 4 of 4 runs)
TRIAL_SLACK = 512 * 2**10


class CompiledStep:
    """A step's compiled forward and what it was measured at.

    Attributes:
        module: ``torch.compile(model)``.
        peak_bytes: the trial's peak above the import baseline, plus :data:`TRIAL_SLACK` (None: not measured,
            no budget).
        micro_batch_size: the plan's micro-batch size it was measured with.
        shapes: :func:`~edgetrain.runtime.compiled.shape_key` of each micro-batch the trial ran.
    """

    def __init__(self, module: Any, peak_bytes: int | None, micro_batch_size: int,
                 shapes: set[tuple[Any, ...]]) -> None:
        self.module = module
        self.peak_bytes = peak_bytes
        self.micro_batch_size = micro_batch_size
        self.shapes = shapes

    def fits(self, plan: Plan, budget_bytes: int | None, margin_bytes: int) -> bool:
        """Whether ``plan`` may run compiled: it keeps everything, splits the batch as measured, and the measured
        peak fits the budget."""
        if any(p != KEEP for p in plan.policies) or plan.micro_batch_size != self.micro_batch_size:
            return False
        return budget_bytes is None or self.peak_bytes is None or self.peak_bytes <= budget_bytes - margin_bytes

    def executor(self, model: Any, eager: Any) -> CompiledExecutor:
        return CompiledExecutor(model, self.module, self.shapes, eager)

    def mark(self, plan: Plan) -> Plan:
        """``plan`` as the compiled step runs it: its peak is the one measured compiled."""
        metadata = {**plan.metadata, "compiled": True, "eager_peak_bytes": plan.peak_bytes}
        if self.peak_bytes is None:
            return plan.replace(metadata=metadata)
        return plan.replace(peak_bytes=self.peak_bytes, metadata=metadata)


def why_not_compiled(plan: Plan, *, has_batchnorm: bool, paging: bool, elastic: bool, grad_filter: bool) -> str | None:
    """Why a step with ``plan`` cannot run compiled; None when it can."""
    if paging:
        return "a paging (POET) plan runs its stages through edgetrain's pager"
    if elastic:
        return "elastic selection (speedup=) changes which parameters train, and each change would compile again"
    if grad_filter:
        return "gradient filtering runs its own backward for the filtered convolutions"
    changed = sum(p != KEEP for p in plan.policies)
    if changed:
        return (f"the plan for this budget recomputes or pages {changed} of {plan.num_stages} stages, which "
                "compiled code would not do (it saves what its own partitioner chooses)")
    if plan.micro_batch_size < plan.batch_size and has_batchnorm:
        return ("the plan splits the batch of a model with BatchNorm, whose statistics edgetrain combines across "
                "micro-batches through hooks on every call")
    return None


def _shapes(model: Any, inputs: Any, plan: Plan) -> set[tuple[Any, ...]]:
    out, start = set(), 0
    for size in run_micro_batch_sizes(plan.batch_size, plan.micro_batch_size):
        part = inputs if size == plan.batch_size else slice_batch(inputs, start, start + size)
        out.add(shape_key(bind_inputs(model, part)))
        start += size
    return out


def _trial(step: Any, inputs: Any, targets: Any, shapes: set[tuple[Any, ...]]) -> tuple[float, float]:
    """In a fork: run the step compiled; (first step's seconds, compiling included; the last step's)."""
    step._executor = CompiledExecutor(step.model, compiled_forward(step.model), shapes, step._executor)
    times = []
    for _ in range(TRIAL_STEPS):
        t = time.perf_counter()
        step(inputs, targets)
        times.append(time.perf_counter() - t)
    return times[0], times[-1]


def compile_step(step: Any, inputs: Any, targets: Any, reason: str | None) -> None:
    """Switch ``step`` to compiled execution where it can run so (see the module docstring); warn otherwise.

    ``reason``: :func:`why_not_compiled` of the step's options and plan."""
    plan = step.plan
    if reason is not None:
        log.warning("compile=True: the step runs eagerly: %s", reason)
        step.set_plan(plan.replace(metadata={**plan.metadata, "compiled": False, "not_compiled": reason}))
        return
    shapes = _shapes(step.model, inputs, plan)
    if step.budget_bytes is None:  # nothing to keep: compiled on the first step, unmeasured
        step.compiled = CompiledStep(compiled_forward(step.model), None, plan.micro_batch_size, shapes)
        step.set_plan(plan)
        return
    why = None
    log.info("compile=True: two compiled trial steps in a fork, the first compiling (seconds to minutes)")
    res = fork.run_in_child(lambda: _trial(step, inputs, targets, shapes)) if fork.available() else None
    if res is None:
        why = ("a compiled trial step could not run in a forked child (fork unavailable, EDGETRAIN_FORK=0, or the "
               "child died), and a compiled step is not taken unmeasured")
    elif res.error is not None or res.budget_error is not None:
        why = f"a compiled trial step failed: {res.error or res.budget_error[0]}"
    elif res.threads != torch.get_num_threads():
        why = "the trial could not run this process's intra-op threads"
    if why is not None:
        log.warning("compile=True: the step runs eagerly: %s", why)
        step.set_plan(plan.replace(metadata={**plan.metadata, "compiled": False, "not_compiled": why}))
        return
    first_s, step_s = res.value
    room = step.budget_bytes - step.margin_bytes
    peak = res.peak_bytes + TRIAL_SLACK
    if peak > room:
        need = budget_for(peak + TRIAL_SLACK, step.margin_share)  # room for a retry's trial reading higher
        need = math.ceil(need / (2**20 / 10)) * 2**20 // 10  # printed in tenths of a MiB: rounded up
        why = (f"compiled, a trial step peaked at {format_bytes(res.peak_bytes)} (the compiler and its code "
               f"included; {format_bytes(peak)} planned), over the {format_bytes(room)} the budget of "
               f"{format_bytes(step.budget_bytes)} leaves "
               f"after its margin; the eager plan needs {format_bytes(plan.peak_bytes)}. A budget of at least "
               f"{format_bytes(need)} runs it compiled")
        log.warning("compile=True: the step runs eagerly: %s", why)
        step.set_plan(plan.replace(metadata={**plan.metadata, "compiled": False, "not_compiled": why,
                                             "compiled_peak_bytes": peak}))
        return
    log.info("compile=True: compiled trial steps peaked at %s (eager plan %s); first step %.1f s with compiling, "
             "then %.3f s", format_bytes(res.peak_bytes), format_bytes(plan.peak_bytes), first_s, step_s)
    step.compiled = CompiledStep(compiled_forward(step.model), peak, plan.micro_batch_size, shapes)
    step.set_plan(plan.replace(metadata={**plan.metadata, "compile_first_step_s": first_s,
                                         "compiled_step_s": step_s}))
