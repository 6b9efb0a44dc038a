"""``PlanConfig(compile=True)``: whether a prepared step runs compiled, and how, decided on measurements.

The step is compiled only where its plan keeps every activation (nothing for edgetrain's stages to do) and
the batch is trained in one piece or its model has no BatchNorm (whose statistics a split batch combines
through hooks on every call). With a budget, each compiler setting of :data:`RATIOS` (how much the compiled
backward recomputes) is tried in a fork of this process: five steps on the example, the first compiling.
A trial's peak, compiler and generated code included, is what the step's plan predicts if it is taken; of
those that fit the budget less the margin the fastest is taken (the lowest peak among those about as fast),
once one eager and one compiled step, run from the same state in another fork, agree (:func:`_disagreement`).
Where none fits or agrees, or compiling fails, the step runs eagerly on the plan made for it, and a warning
says why and, where the trials were over the budget, what budget would run it compiled. Without a budget nothing
is measured, but the check still runs (at PyTorch's default setting): a compiled HF EfficientNet whose gradients
lay 17-48% from eager PyTorch's ran unchecked there.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from .._state import host_rng_state, rng_state, set_host_rng_state, set_rng_state
from ..batch import slice_batch
from ..capture import bind_inputs
from ..graph import KEEP, run_micro_batch_sizes
from ..plan import Plan
from ..profile import fork
from ..runtime.compiled import CompiledExecutor, compiled_forward, shape_key
from ..units import format_bytes
from .budgets import RETRY_SLACK, budget_for
from .guards import attribute_key, changed_attributes

__all__ = ["CompiledStep", "why_not_compiled", "compile_step", "losses_agree", "relative_l2"]

log = logging.getLogger("edgetrain.api")

#: steps a trial runs compiled: the first compiles, the others run as every later step will (the fastest is
#: its time). Two timed steps were too few to choose between settings 10% apart: MobileNetV2's trials read
#: 0.188-0.238 s at setting 0.5 and 0.210-0.228 s at PyTorch's default, whose steps run 0.22-0.26 s, and took the
#: default in 2 of 5 runs (bench/RESULTS.md, 2026-12-06 20:00)
TRIAL_STEPS = 5
#: the settings tried, each in its own trial: ``torch._functorch.config.activation_memory_budget`` None (PyTorch's
#: default: the partitioner saves what it chooses) and 0.5 (it recomputes cheap ops until half the activations
#: its default saves are left; MobileNetV2 at 64x64: 222 MiB against 284, and faster on a CPU). Random draws are
#: never recomputed at either (:func:`~edgetrain.runtime.compiled.random_draws_saved`).
RATIOS: tuple[float | None, ...] = (None, 0.5)
#: trials this much slower than the fastest count as fast as it (the lowest peak among them is taken)
TIE = 0.05
#: how far a compiled step's loss may lie from the eager step's, relative: its kernels add in another order
#: (MobileNetV2, ResNet-18, BERT: 1e-7 apart or less); a BERT whose compiled step drew other dropout masks: 3e-3
#: (activation_memory_budget 0.5 without :func:`~edgetrain.runtime.compiled.random_draws_saved`)
LOSS_RTOL = 1e-4
#: how far its gradients may lie from the eager step's, as the relative L2 norm of the difference over every
#: parameter: the same rounding, carried back through BatchNorm's backward, left MobileNetV2's 0.9-1.1% apart and
#: ResNet-18's 0.3% (plain torch.compile against eager PyTorch); the BERT's with other masks 39-69%
GRAD_RTOL = 0.05
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
        ratio: the ``activation_memory_budget`` it was measured at (None: PyTorch's default).
    """

    def __init__(self, module: Any, peak_bytes: int | None, micro_batch_size: int,
                 shapes: set[tuple[Any, ...]], ratio: float | None = None, chain: Any = None) -> None:
        self.module = module
        self.ratio = ratio
        #: the model's plain attributes when compiled (:func:`~edgetrain.planning.guards.attribute_key`, with the
        #: globals its trace read): a change would compile again, unmeasured, and the step then runs eagerly
        self.attributes = attribute_key(module._orig_mod, chain)
        self.peak_bytes = peak_bytes
        self.micro_batch_size = micro_batch_size
        self.shapes = shapes

    def changed(self, now: dict[str, Any]) -> list[str]:
        """The attributes in :attr:`attributes` that differ in ``now`` (an attribute key of the model), each as
        ``name (old -> new)``. Entries only ``now`` has are not changes: the chain may have been captured since
        compiling, the globals its trace read joining the key."""
        now = {k: now[k] for k in self.attributes if k in now}
        return [] if now == self.attributes else changed_attributes(self.attributes, now)

    def fits(self, plan: Plan, budget_bytes: int | None, margin_bytes: int) -> bool:
        """Whether ``plan`` may run compiled: it keeps everything, splits the batch as measured, and the measured
        peak fits the budget (a step compiled without a budget was never measured: under one it runs eagerly)."""
        if any(p != KEEP for p in plan.policies) or plan.micro_batch_size != self.micro_batch_size:
            return False
        return budget_bytes is None or (self.peak_bytes is not None and self.peak_bytes <= budget_bytes - margin_bytes)

    def executor(self, model: Any, eager: Any) -> CompiledExecutor:
        return CompiledExecutor(model, self.module, self.shapes, eager, self.ratio)

    def mark(self, plan: Plan) -> Plan:
        """``plan`` as the compiled step runs it: its peak is the one measured compiled."""
        metadata = {**plan.metadata, "compiled": True, "eager_peak_bytes": plan.peak_bytes}
        if self.peak_bytes is None:
            return plan.replace(metadata=metadata)
        return plan.replace(peak_bytes=self.peak_bytes, metadata=metadata)


def why_not_compiled(plan: Plan, *, has_batchnorm: bool, paging: bool, elastic: bool, grad_filter: bool,
                     exact_draws: bool = False) -> str | None:
    """Why a step with ``plan`` cannot run compiled; None when it can. ``exact_draws``: the split plan draws the
    whole batch's dropout masks (:mod:`edgetrain.capture.draws`)."""
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
    if plan.micro_batch_size < plan.batch_size and exact_draws:
        return ("the plan splits the batch of a model with dropout, whose masks edgetrain draws for the whole batch "
                "at its first micro-batch (compiled code would draw each micro-batch's)")
    return None


def _shapes(model: Any, inputs: Any, plan: Plan) -> set[tuple[Any, ...]]:
    out, start = set(), 0
    for size in run_micro_batch_sizes(plan.batch_size, plan.micro_batch_size):
        part = inputs if size == plan.batch_size else slice_batch(inputs, start, start + size)
        out.add(shape_key(bind_inputs(model, part)))
        start += size
    return out


def _cache_misses() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]


def _run_compiled(step: Any, shapes: set[tuple[Any, ...]], ratio: float | None) -> None:
    """In a fork: let ``step`` run its model compiled at ``ratio`` for ``shapes``, its eager executor under it."""
    step._executor = CompiledExecutor(step.model, compiled_forward(step.model), shapes, step._executor, ratio)


def _trial(step: Any, inputs: Any, targets: Any, shapes: set[tuple[Any, ...]],
           ratio: float | None) -> tuple[float, float, int]:
    """In a fork: run the step compiled. Returns the first step's seconds (compiling included), the fastest
    later step's, and how many of the compiler's on-disk cache lookups missed."""
    missed = _cache_misses()
    _run_compiled(step, shapes, ratio)
    times = []
    for _ in range(TRIAL_STEPS):
        t = time.perf_counter()
        step(inputs, targets)
        times.append(time.perf_counter() - t)
    return times[0], min(times[1:]), _cache_misses() - missed


def _disagreement(step: Any, inputs: Any, targets: Any, shapes: set[tuple[Any, ...]],
                  ratio: float | None) -> str | None:
    """In a fork: one eager step and one compiled step from the same weights, optimizer state and random state;
    how their losses or gradients differ by more than rounding, or None."""
    model, opt = step.model, step.optimizer
    weights, opt_state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    rng, host = rng_state(), host_rng_state()
    step.fused = None  # the gradients kept until the update, to be read
    grads: list[list[torch.Tensor | None]] = []
    step.before_optimizer_step = lambda: grads.append([None if p.grad is None else p.grad.detach().clone()
                                                       for p in model.parameters()])
    losses = [step(inputs, targets)]
    model.load_state_dict(weights)
    opt.load_state_dict(opt_state)
    set_rng_state(rng)
    set_host_rng_state(host)
    _run_compiled(step, shapes, ratio)
    losses.append(step(inputs, targets))
    if not losses_agree(losses[0], losses[1]):
        return f"loss {losses[1]:.7g} against {losses[0]:.7g}"
    names = [n for n, _ in model.named_parameters()]
    eager, compiled = (dict(zip(names, g)) for g in grads)
    one_sided = next((n for n in names if (eager[n] is None) != (compiled[n] is None)), None)
    if one_sided is not None:
        return f"parameter {one_sided} has a gradient in one step only"
    rel, worst = relative_l2(eager, compiled)
    if rel > GRAD_RTOL:
        return f"gradients {rel:.1%} apart (relative L2 norm; most in {worst})"
    return None


def losses_agree(reference: float, other: float) -> bool:
    """Whether two steps' losses agree up to compiled kernels' rounding (:data:`LOSS_RTOL`)."""
    return abs(other - reference) <= LOSS_RTOL * max(abs(reference), 1e-6)


def relative_l2(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None],
                skip: frozenset[str] | set[str] = frozenset()) -> tuple[float, str | None]:
    """``||a - b|| / ||a||`` over the floating-point tensors two name -> tensor maps share (inf where one side lacks
    one), and the name holding most of the difference."""
    off: dict[str, float] = {}
    total = 0.0
    for name, x in a.items():
        y = b.get(name)
        if name in skip or (x is None and y is None) or (x is not None and not x.is_floating_point()):
            continue
        if x is None or y is None:
            return math.inf, name
        x64, y64 = (t.detach().to_dense().double() if t.is_sparse else t.detach().double() for t in (x, y))
        off[name] = float((x64 - y64).pow(2).sum())
        total += float(x64.pow(2).sum())
    worst = max(off, key=off.__getitem__) if off else None
    diff = sum(off.values())
    return ((diff / total) ** 0.5 if total else (0.0 if diff == 0 else math.inf)), worst


@dataclass
class Trial:
    """One compiled configuration measured in a fork (``error`` set when it could not be)."""

    ratio: float | None
    peak_bytes: int = 0
    first_s: float = 0.0
    step_s: float = 0.0
    error: str | None = None

    def describe(self) -> str:
        name = "PyTorch's default" if self.ratio is None else f"activation_memory_budget {self.ratio:g}"
        if self.error is not None:
            return f"{name}: {self.error}"
        return f"{name}: peak {format_bytes(self.peak_bytes)}, step {self.step_s:.3f} s"


def _in_child(fn: Any) -> Any:
    """:func:`~edgetrain.profile.fork.run_in_child`, forked once more where the child died without an answer (a
    child compiling died once in 1,100 tests, wait status 11, likely TorchInductor's kernel reading past a tensor
    that the pool has since kept bytes mapped after, :mod:`edgetrain.runtime.pool`): a second death is the answer."""
    res = fork.run_in_child(fn)
    return fork.run_in_child(fn) if res is None else res


def _measure(step: Any, inputs: Any, targets: Any, shapes: set[tuple[Any, ...]], ratio: float | None) -> Trial:
    """The compiled step at ``ratio``, measured in a fork of this process. A trial that compiled afresh (its
    lookups in the compiler's on-disk cache missed) is run again in a new fork: this process's own compile,
    after the trials, finds the cache as that second trial did (MobileNetV2: 313 MiB compiling afresh, 222 MiB
    from the cache), so the second is the one that speaks for it."""
    for attempt in range(2):
        res = _in_child(lambda: _trial(step, inputs, targets, shapes, ratio))
        if res is None:
            return Trial(ratio, error="the forked child died twice or could not start")
        if res.error is not None or res.budget_error is not None:
            return Trial(ratio, error=f"failed: {res.error or res.budget_error[0]}")
        if res.threads != torch.get_num_threads():
            return Trial(ratio, error="the child could not run this process's intra-op threads")
        first_s, step_s, misses = res.value
        if not misses:
            break
    return Trial(ratio, res.peak_bytes + TRIAL_SLACK, first_s, step_s)


def _disagreeing(step: Any, inputs: Any, targets: Any, shapes: set[tuple[Any, ...]], ratio: float | None) -> str | None:
    """How the step compiled at ``ratio`` trains otherwise than the eager step (checked in a fork), or None."""
    res = _in_child(lambda: _disagreement(step, inputs, targets, shapes, ratio))
    if res is None:
        return "the check's forked child died twice or could not start"
    if res.error is not None or res.budget_error is not None:
        return f"the check failed: {res.error or res.budget_error[0]}"
    return res.value


def _not_compiled(step: Any, plan: Plan, why: str, **metadata: Any) -> None:
    log.warning("compile=True: the step runs eagerly: %s", why)
    step.set_plan(plan.replace(metadata={**plan.metadata, "compiled": False, "not_compiled": why, **metadata}))


def compile_step(step: Any, inputs: Any, targets: Any, reason: str | None) -> None:
    """Switch ``step`` to compiled execution where it can run so (see the module docstring); warn otherwise.

    ``reason``: :func:`why_not_compiled` of the step's options and plan."""
    plan = step.plan
    if reason is not None:
        _not_compiled(step, plan, reason)
        return
    shapes = _shapes(step.model, inputs, plan)
    if not fork.available():
        _not_compiled(step, plan, "compiled trial steps and the check that the compiled step trains as the eager one "
                                  "does need a forked child (fork unavailable or EDGETRAIN_FORK=0), and a compiled "
                                  "step is not taken unchecked")
        return
    if step.budget_bytes is None:  # no peak to keep: compiled at PyTorch's default setting once it agrees
        why = _disagreeing(step, inputs, targets, shapes, None)
        if why is not None:
            _not_compiled(step, plan, f"the compiled step did not train as the eager step does ({why}): compiled "
                                      "code that would change the result is not run")
            return
        step.compiled = CompiledStep(compiled_forward(step.model), None, plan.micro_batch_size, shapes,
                                     chain=step._chain)
        step.set_plan(plan)
        return
    # a forward that draws random numbers (dropout) is tried at every setting: random_draws_saved keeps its draws
    # out of the compiled backward, where a partitioner saving less would redraw them
    log.info("compile=True: compiled trial steps in forks, %d setting(s), each compiling first (seconds to minutes)",
             len(RATIOS))
    trials = [_measure(step, inputs, targets, shapes, r) for r in RATIOS]
    room = step.budget_bytes - step.margin_bytes
    measured = [t for t in trials if t.error is None]
    fitting = [t for t in measured if t.peak_bytes <= room]
    tried = "; ".join(t.describe() for t in trials)
    if not measured:
        _not_compiled(step, plan, f"no compiled trial step ran ({tried})")
        return
    if not fitting:
        least = min(measured, key=lambda t: t.peak_bytes)
        # as a BudgetError names one: room for a retry, in a process that holds a little more or less, reading higher
        need = math.ceil(budget_for(least.peak_bytes, step.margin_share) * RETRY_SLACK)
        need = math.ceil(need / (2**20 / 10)) * 2**20 // 10  # printed in tenths of a MiB: rounded up
        _not_compiled(step, plan, f"compiled trial steps (the compiler and its code included) were over the "
                                  f"{format_bytes(room)} the budget of {format_bytes(step.budget_bytes)} leaves after "
                                  f"its margin ({tried}); the eager plan needs {format_bytes(plan.peak_bytes)}. A "
                                  f"budget of at least {format_bytes(need)} runs it compiled",
                      compiled_peak_bytes=least.peak_bytes)
        return
    fastest = min(t.step_s for t in fitting)  # and within TIE of it, the lowest peak: a trial's time is noisy
    best = min((t for t in fitting if t.step_s <= fastest * (1 + TIE)), key=lambda t: t.peak_bytes)
    disagreed = []
    for t in [best] + sorted((t for t in fitting if t is not best), key=lambda t: t.step_s):
        why = _disagreeing(step, inputs, targets, shapes, t.ratio)
        if why is None:
            best = t
            break
        disagreed.append(f"{t.describe()}: {why}")
    else:
        _not_compiled(step, plan, "the compiled step did not train as the eager step does (" + "; ".join(disagreed)
                      + "): compiled code that would change the result is not run")
        return
    log.info("compile=True: running compiled (%s); trials: %s; eager plan %s", best.describe(), tried,
             format_bytes(plan.peak_bytes))
    step.compiled = CompiledStep(compiled_forward(step.model), best.peak_bytes, plan.micro_batch_size, shapes,
                                 best.ratio, step._chain)
    step.set_plan(plan.replace(metadata={**plan.metadata, "compile_first_step_s": best.first_s,
                                         "compiled_step_s": best.step_s, "compiled_ratio": best.ratio,
                                         "compile_trials": tried}))
