"""Automatic gradient filtering: which convs, at which radius, meet a backward speed-up or memory target.

Backward FLOPs are a poor guide to backward *time* for some layers. A depthwise conv has almost no
arithmetic to save, and reading the full-size ``dL/dy`` and writing the full-size ``dL/dx`` remain; in
channels-last memory format PyTorch's exact depthwise backward is fast enough that filtering gains
little or is even *slower* on a wide 8x8 layer, while its FLOPs promise several times less work.
So :func:`plan_grad_filter` times, by default, the model's whole exact backward and each candidate
conv's exact and filtered backward on this machine, on the input each conv really sees (in its memory
format), and predicts with those times. ``timing="flops"`` keeps the FLOPs model (no measuring).

Rule: among every suffix of the trainable convs (the paper filters the last layers) and radius 2 or 4,
and, with a speed-up target and measured times, the same suffix without the convs that filtering makes
slower, take the fewest filtered convs that meet every target; among equal counts the smaller radius.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import nn

from ...batch import is_channels_last
from ...errors import BudgetError
from ...units import format_bytes, parse_bytes
from .trace import ModelTrace, _side_effects_undone, layer_costs, trace_model
from .core import GradFilter, _filtered_class, _select, apply_grad_filter, remove_grad_filter

__all__ = ["FilterTimings", "GradFilterPlan", "measure_filter_timings", "plan_grad_filter", "auto_grad_filter"]

logger = logging.getLogger(__name__)

RADII = (2, 4)


@dataclass(frozen=True)
class FilterTimings:
    """Measured backward seconds (medians of interleaved runs) on one example input.

    Attributes:
        backward_s: exact backward of one step of the whole model (``output.backward(g)``).
        exact_s: per conv name, its exact backward run alone on its real input.
        filtered_s: per conv name, ``{radius: seconds}`` of its filtered backward on the same input.
    """

    backward_s: float
    exact_s: dict[str, float]
    filtered_s: dict[str, dict[int, float]]

    def saving_s(self, name: str, radius: int) -> float:
        """Seconds filtering ``name`` at ``radius`` takes off the backward (negative: it adds time)."""
        return self.exact_s[name] - self.filtered_s[name][radius]


@dataclass(frozen=True)
class GradFilterPlan:
    """What :func:`plan_grad_filter` chose and why.

    Attributes:
        config: the chosen filter (``freeze_earlier=False``; apply it with ``apply_grad_filter``).
        layers: the filtered convs, in forward order.
        predicted_speedup: predicted backward speed-up of one step.
        predicted_saved_bytes: predicted saved-activation bytes of one step.
        timing: ``"measured"`` or ``"flops"``: what the speed-up prediction rests on.
        left_exact: convs of the chosen suffix left exact because filtering them measured slower.
        timings: the measurements (None with ``timing="flops"``).
        measured_speedup: the chosen filter's backward speed-up measured on the whole model (None when
            not verified).
    """

    config: GradFilter
    layers: tuple[str, ...]
    predicted_speedup: float
    predicted_saved_bytes: int
    timing: str
    left_exact: tuple[str, ...] = ()
    timings: FilterTimings | None = None
    measured_speedup: float | None = None


def median_backward(runs: list[Callable[[], tuple[torch.Tensor, torch.Tensor | None]]], repeats: int,
                    clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Median seconds of ``out.backward(grad)`` for each ``run() -> (out, grad)``, interleaved.

    The order alternates from one repetition to the next, so no variant always runs right after another
    one's backward (whose writes evict the caches and whose frees shape the allocator's cache); two
    warm-up rounds (oneDNN builds its kernels on first use) are not counted.
    """
    samples: list[list[float]] = [[] for _ in runs]
    for rep in range(repeats + 2):
        order = list(enumerate(runs))
        for i, run in (order if rep % 2 == 0 else order[::-1]):
            out, grad = run()
            sync = torch.cuda.synchronize if out.is_cuda else (lambda: None)   # GPU work is asynchronous
            sync()
            t0 = clock()
            out.backward(grad)
            sync()
            if rep >= 2:
                samples[i].append(clock() - t0)
    return [statistics.median(s) for s in samples]


@contextlib.contextmanager
def _probing(model: nn.Module, device: torch.device):
    """Parameter gradients, running statistics and the RNG as they were, after timing runs."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    try:
        with _side_effects_undone(model, device):
            yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def _output_gradient(model: nn.Module, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random ``dL/d output`` for ``model(x)`` (the model must return one tensor)."""
    with torch.no_grad():
        out = model(x)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"timing the backward needs a model that returns one tensor; this one returns "
                         f"{type(out).__name__}: use timing='flops'")
    return torch.randn(out.shape, generator=gen, dtype=out.dtype, device=out.device)


def _filtered_twin(conv: nn.Conv2d, radius: int) -> nn.Conv2d:
    """A filtered copy of ``conv`` that shares its parameters (the model is not touched)."""
    twin = copy.copy(conv)
    twin.__class__ = _filtered_class(type(conv))
    twin.grad_filter_radius = radius
    return twin


def measure_filter_timings(model: nn.Module, example_input: torch.Tensor, names: list[str],
                           radii: tuple[int, ...] = RADII, repeats: int = 5,
                           trace: ModelTrace | None = None) -> FilterTimings:
    """Time the exact backward of ``model`` and, per conv in ``names``, exact vs filtered backward.

    Each conv runs alone on the input it sees in ``model(example_input)`` (same memory format), with
    the gradients it needs there (its input's only if backward reaches past it). Parameter gradients,
    running statistics and the RNG are restored afterwards. A copy of every timed conv's input is held
    until that conv is timed (at most about one step's saved activations).

    Args:
        model: the model, not filtered.
        example_input: one input batch of the size you train with.
        names: conv module names to time.
        radii: radii to time.
        repeats: timed repetitions per variant (after two warm-ups).
        trace: a :func:`trace_model` trace with ``record_saved=True`` (made when None).

    Returns:
        The timings.

    Raises:
        ValueError: when the model's output is not a tensor (use ``timing="flops"``).
    """
    trace = trace if trace is not None else trace_model(model, example_input, record_saved=True)
    params = list(model.parameters())
    inputs: dict[str, torch.Tensor] = {}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: inputs.setdefault(n, a[0].detach().clone())) for n in names]
    gen = torch.Generator(device=example_input.device).manual_seed(0)
    with _probing(model, example_input.device):
        try:
            g_out = _output_gradient(model, example_input, gen)
        finally:
            for h in hooks:
                h.remove()

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            for p in params:
                p.grad = None
            return model(example_input), g_out

        backward_s = median_backward([step], repeats)[0]
        exact_s: dict[str, float] = {}
        filtered_s: dict[str, dict[int, float]] = {}
        for k, name in enumerate(names):
            conv = model.get_submodule(name)
            inp = inputs.pop(name).requires_grad_(trace.convs[name].need_x)
            with torch.no_grad():
                y = conv(inp)
            gy = torch.randn(y.shape, generator=gen, dtype=y.dtype, device=y.device)
            if is_channels_last(y):  # the layout the layer's real dL/dy has
                gy = gy.contiguous(memory_format=torch.channels_last)

            def run(module: nn.Module, inp: torch.Tensor = inp, gy: torch.Tensor = gy,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
                for p in module.parameters():
                    p.grad = None
                inp.grad = None
                return module(inp), gy

            variants = [conv] + [_filtered_twin(conv, r) for r in radii]
            times = median_backward([lambda m=m: run(m) for m in variants], repeats)
            exact_s[name] = times[0]
            filtered_s[name] = dict(zip(radii, times[1:]))
            logger.info("grad filter timing %d/%d %s: exact %.3f ms, %s", k + 1, len(names), name,
                        1e3 * times[0], ", ".join(f"r={r} {1e3 * t:.3f} ms" for r, t in zip(radii, times[1:])))
    return FilterTimings(backward_s, exact_s, filtered_s)


def _measure_speedup(model: nn.Module, x: torch.Tensor, config: GradFilter, repeats: int) -> float:
    """Backward speed-up of ``config`` on the whole model: exact and filtered steps interleaved.

    The filter is applied in place for the filtered runs (a class swap) and removed afterwards.
    """
    params = list(model.parameters())
    gen = torch.Generator(device=x.device).manual_seed(1)
    quiet = logging.getLogger(apply_grad_filter.__module__)
    level = quiet.level
    with _probing(model, x.device):
        g_out = _output_gradient(model, x, gen)

        def step(filtered: bool) -> tuple[torch.Tensor, torch.Tensor]:
            if filtered:
                apply_grad_filter(model, config)
            else:
                remove_grad_filter(model)
            for p in params:
                p.grad = None
            return model(x), g_out

        try:
            quiet.setLevel(logging.WARNING)  # one apply per run: no log line each
            exact, filtered = median_backward([lambda: step(False), lambda: step(True)], repeats)
        finally:
            remove_grad_filter(model)
            quiet.setLevel(level)
    return exact / filtered


def plan_grad_filter(model: nn.Module, example_input: torch.Tensor, target_speedup: float | None = None,
                     target_saved_bytes: int | str | None = None, timing: str = "measured",
                     timings: FilterTimings | None = None, repeats: int = 5, verify: bool = True,
                     tolerance: float = 0.05) -> GradFilterPlan:
    """Choose the convs and radius that meet a backward speed-up and/or saved-memory target.

    The baseline is exact backprop of ``model`` as it is now (nothing extra is frozen; the chosen
    config has ``freeze_earlier=False``, so freeze a backbone yourself first to fine-tune only a head
    part). Candidates, for each suffix of ``n`` trainable convs and radius ``r`` in (2, 4): the suffix,
    and (with a speed-up target and measured times) the suffix without the convs whose filtered
    backward measured slower than their exact one. For a set ``S``:

    * measured (default): speed-up = ``B / (B - k sum_{i in S} (exact_i - filtered_i))`` with ``B`` the
      measured exact backward of one step and ``exact_i``, ``filtered_i`` each conv's measured backward
      on its real input (:func:`measure_filter_timings`, a few seconds for a ResNet-18); ``k`` starts
      at 1 (see ``verify``);
    * ``timing="flops"``: the same with backward FLOPs of every Conv2d and Linear (elementwise layers
      not counted), which over-states layers bound by memory traffic (depthwise, small 1x1);
    * saved bytes = the measured saved-activation bytes of one step, minus the conv inputs that only
      filtered convs save, plus the pooled inputs.

    The fewest filtered convs that meet every target win; among equal counts, the smaller radius, then
    the whole suffix.

    With ``verify`` (measured timing and a speed-up target), the choice is applied in place, its whole
    backward timed against the exact one (interleaved), and removed again. A layer timed alone runs
    with warm caches, so savings can be over-stated; when the measured speed-up is short of the target
    by more than ``tolerance``, ``k`` becomes measured / predicted saving and the choice is made again
    (at most 3 rounds). A choice still short after that is returned with a warning naming its measured
    speed-up; ``plan.measured_speedup`` always holds the last measurement.

    Args:
        model: the model (not filtered).
        example_input: one input batch of the size you train with.
        target_speedup: wanted backward speed-up (> 1), or None.
        target_saved_bytes: wanted upper bound on saved-activation bytes (int or "300MiB"), or None.
        timing: ``"measured"`` or ``"flops"``.
        timings: measurements to reuse (from an earlier plan's ``timings``); measured when None.
        repeats: timed repetitions per variant when measuring.
        verify: measure the chosen filter's real speed-up and correct (measured timing only).
        tolerance: relative shortfall of the measured speed-up that is accepted (timing noise).

    Returns:
        The plan; ``plan.config`` is what to apply.

    Raises:
        ValueError: when neither target is given, ``target_speedup`` is not above 1, ``timing`` is
            unknown, or (measured) the model does not return one tensor.
        BudgetError: when no candidate meets a target (the message gives the best reachable values).
    """
    if target_speedup is None and target_saved_bytes is None:
        raise ValueError("auto grad filter needs target_speedup (e.g. 2.0) or target_saved_bytes "
                         "(e.g. '64MiB')")
    if target_speedup is not None and not target_speedup > 1.0:
        raise ValueError(f"target_speedup must be above 1; got {target_speedup!r}")
    if timing not in ("measured", "flops"):
        raise ValueError(f"timing must be 'measured' or 'flops'; got {timing!r}")
    budget = None if target_saved_bytes is None else parse_bytes(target_saved_bytes)
    trace = trace_model(model, example_input, record_saved=True)
    order = _select(model, GradFilter(last_n=None), trace)
    if timing == "measured" and timings is None:
        logger.info("grad filter: timing exact and filtered backward of %d convs", len(order))
        timings = measure_filter_timings(model, example_input, order, RADII, repeats, trace)
    if timing == "flops":
        timings = None
    elif missing := [n for n in order if n not in timings.exact_s]:
        raise ValueError(f"the timings given do not cover {missing[:3]}; measure them for this model")
    candidates = _candidates(trace, order, timings, target_speedup is not None)
    plan = _choose(candidates, 1.0, target_speedup, budget, timing, timings)
    if not (verify and timings is not None and target_speedup is not None):
        return plan
    scale, seen = 1.0, {}
    for round_ in range(3):
        if plan.config not in seen:
            seen[plan.config] = _measure_speedup(model, example_input, plan.config, repeats)
        plan = dataclasses.replace(plan, measured_speedup=seen[plan.config])
        logger.info("auto grad filter: %s at r=%d measured %.2fx (predicted %.2fx)", ", ".join(plan.layers),
                    plan.config.radius, plan.measured_speedup, plan.predicted_speedup)
        if plan.measured_speedup >= target_speedup * (1 - tolerance):
            return plan
        scale *= max(1 - 1 / plan.measured_speedup, 0.0) / (1 - 1 / plan.predicted_speedup)
        if round_ == 2 or scale <= 0:
            break
        again = _choose(candidates, scale, target_speedup, budget, timing, timings)  # BudgetError: unreachable
        if again.config in seen:
            break
        plan = again
    warnings.warn(f"auto grad filter: the chosen filter ({len(plan.layers)} convs at r={plan.config.radius}) "
                  f"measured a {plan.measured_speedup:.2f}x backward speed-up against the {target_speedup}x "
                  f"asked; filter more layers by hand or relax the target", stacklevel=2)
    return plan


class _Candidate(NamedTuple):
    """One set of convs to filter at one radius, with its relative backward saving and saved bytes."""

    radius: int
    chosen: list[str]              # the convs filtered, in forward order
    suffix: list[str]              # the suffix of trainable convs it was taken from (itself, or a subset)
    saving: float                  # fraction of the exact backward it saves (time or FLOPs)
    saved_bytes: int               # saved-activation bytes of one step with it

    def order(self) -> tuple[int, int, bool]:   # fewest convs, then smaller radius, then the whole suffix
        return len(self.chosen), self.radius, len(self.chosen) < len(self.suffix)


def _candidates(trace: ModelTrace, order: list[str], timings: FilterTimings | None, speed: bool,
                ) -> list[_Candidate]:
    """Every suffix at every radius, and (``speed`` with ``timings``) the suffix without its slower convs."""
    out = []
    for n in range(1, len(order) + 1):
        suffix = order[-n:]
        for radius in RADII:
            sets = [suffix]
            if timings is not None and speed:
                faster = [name for name in suffix if timings.saving_s(name, radius) > 0]
                if faster and len(faster) < len(suffix):
                    sets.append(faster)
            for chosen in sets:
                costs = layer_costs(trace, chosen, radius)
                if timings is None:
                    saving = (sum(c.backward_flops_exact - c.backward_flops_filtered for c in costs)
                              / max(trace.backward_flops, 1))
                else:
                    saving = sum(timings.saving_s(name, radius) for name in chosen) / timings.backward_s
                saved_bytes = trace.saved_bytes - sum(c.freed_bytes for c in costs)
                out.append(_Candidate(radius, chosen, suffix, saving, saved_bytes))
    return sorted(out, key=_Candidate.order)


#: the largest backward speed-up a plan predicts (see :func:`_choose`)
MAX_PREDICTED_SPEEDUP = 100.0


def _choose(candidates: list[_Candidate], scale: float, target_speedup: float | None, budget: int | None,
            timing: str, timings: FilterTimings | None) -> GradFilterPlan:
    """The first candidate (fewest convs, smaller radius) whose speed-up (saving x ``scale``) and bytes fit."""
    def speedup(saving: float) -> float:
        # Filtering never removes a whole backward (dL/dy is still read, dL/dx still written): a saving that
        # noisy timings put at or past the whole backward is held at MAX_PREDICTED_SPEEDUP, never infinite.
        left = 1 - scale * saving
        return min(1 / left, MAX_PREDICTED_SPEEDUP) if left > 0 else MAX_PREDICTED_SPEEDUP

    for c in candidates:
        speed = speedup(c.saving)
        if (target_speedup is None or speed >= target_speedup) and (budget is None or c.saved_bytes <= budget):
            config = (GradFilter(radius=c.radius, last_n=len(c.chosen), freeze_earlier=False)
                      if len(c.chosen) == len(c.suffix) else
                      GradFilter(radius=c.radius, layers=tuple(c.chosen), freeze_earlier=False))
            left = tuple(n for n in c.suffix if n not in c.chosen)
            logger.info("auto grad filter (%s): %s at r=%d, predicted backward speed-up %.2fx, saved %s%s",
                        timing, ", ".join(c.chosen), c.radius, speed, format_bytes(c.saved_bytes),
                        f"; left exact (slower filtered): {', '.join(left)}" if left else "")
            return GradFilterPlan(config, tuple(c.chosen), speed, c.saved_bytes, timing, left, timings)
    best_speed = max(speedup(c.saving) for c in candidates)
    best_bytes = min(c.saved_bytes for c in candidates)
    raise BudgetError(
        f"no choice of convs meets the target: the best reachable backward speed-up is {best_speed:.2f}x "
        f"({timing}) and the smallest saved-activation size {format_bytes(best_bytes)}; relax the target "
        f"or freeze more layers first", budget_bytes=budget, min_feasible_bytes=best_bytes)


def auto_grad_filter(model: nn.Module, example_input: torch.Tensor,
                     target_speedup: float | None = None,
                     target_saved_bytes: int | str | None = None, timing: str = "measured") -> GradFilter:
    """Choose the convs and radius that meet a target (see :func:`plan_grad_filter` for the rule).

    Args:
        model: the model (not filtered).
        example_input: one input batch of the size you train with.
        target_speedup: wanted backward speed-up (> 1), or None.
        target_saved_bytes: wanted upper bound on saved-activation bytes (int or "300MiB"), or None.
        timing: ``"measured"`` (time the backward on this machine, the default) or ``"flops"``.

    Returns:
        The chosen :class:`GradFilter` (``freeze_earlier=False``).

    Raises:
        ValueError: when neither target is given, ``target_speedup`` is not above 1 or ``timing`` is
            unknown.
        BudgetError: when no choice meets a target (the message gives the best reachable values).
    """
    return plan_grad_filter(model, example_input, target_speedup, target_saved_bytes, timing).config
