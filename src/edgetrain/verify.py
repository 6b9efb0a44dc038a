"""``edgetrain.verify``: run one step through the prepared plan and through plain PyTorch, and compare.

The safety net to run before a long job: on deep copies of the model and the optimizer (the originals are
not touched), one optimizer step on the example batch goes through :func:`edgetrain.prepare`'s plan and
one through plain PyTorch from the same RNG state; the largest relative differences of parameters,
gradients and buffers name the tensor they occur in, and pass or fail against a tolerance.

When the plan splits the batch and draws the whole batch's dropout masks (:mod:`edgetrain.capture.draws`), the
plain reference is one full-batch step. Otherwise, when it splits the batch, the plain reference accumulates
gradients over the same micro-batches in the same order (what a user would write by hand), so dropout draws
the same masks; a BatchNorm layer then normalises each micro-batch on its own in both, and its running
statistics, which edgetrain keeps equal to one full-batch forward's, are left out of the comparison (the
report says so). When the plan feeds
the images channels-last (``PlanConfig(layout=)``), so is the reference: the comparison is of edgetrain's
machinery, not of two layouts' kernels, whose float sums differ (the report says so too).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ._state import (backward_outside_autocast, batchnorm_modules, host_rng_state, rng_state, set_host_rng_state,
                     set_rng_state)
from .batch import batch_size_of, channels_last_images, slice_batch
from .capture import bind_inputs
from .capture.chain import unwrap_compiled
from .capture.draws import EXACT_DRAWS_NOTE
from .graph import run_micro_batch_sizes

__all__ = ["VerifyReport", "verify"]


@dataclass(frozen=True)
class Difference:
    """The largest relative difference in a group of tensors: ``max|a - b| / max(max|a|, tiny)``."""

    relative: float = 0.0
    tensor: str = ""

    def __str__(self) -> str:
        return f"{self.relative:.2e}" + (f" ({self.tensor})" if self.tensor else "")


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found.

    Attributes:
        passed: every difference is within ``tolerance``.
        tolerance: the relative tolerance used.
        parameters, gradients, buffers: the largest relative difference of each group and its tensor.
        loss_plain, loss_edgetrain: the step's loss either way.
        micro_batch_size, batch_size, stages, recomputed: what the plan did.
        notes: what was left out of the comparison and why.
        criterion: the terms ``passed`` was judged on where they are not ``tolerance`` per tensor ("": they are):
            a compiled step is judged as prepare judged it against the eager step, by the loss and by the
            relative L2 norm of the gradients' and buffers' differences.
    """

    passed: bool
    tolerance: float
    parameters: Difference
    gradients: Difference
    buffers: Difference
    loss_plain: float
    loss_edgetrain: float
    micro_batch_size: int
    batch_size: int
    stages: int
    recomputed: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    criterion: str = ""

    def __str__(self) -> str:
        terms = self.criterion or f"relative tolerance {self.tolerance:g}"
        lines = [f"edgetrain verify: {'PASS' if self.passed else 'FAIL'} ({terms})",
                 f"  plan: {self.stages} stages, {self.recomputed} recomputed, micro-batch "
                 f"{self.micro_batch_size} of {self.batch_size}",
                 f"  loss: plain {self.loss_plain:.6g}, edgetrain {self.loss_edgetrain:.6g}",
                 f"  parameters: {self.parameters}", f"  gradients:  {self.gradients}",
                 f"  buffers:    {self.buffers}"]
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _largest(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None], skip: set[str]) -> Difference:
    worst = Difference()
    for name, x in a.items():
        y = b.get(name)
        if name in skip or (x is None and y is None):
            continue
        if x is None or y is None:
            return Difference(math.inf, f"{name} (missing on one side)")
        # a sparse gradient (nn.Embedding(sparse=True)) is compared as the dense tensor it stands for
        x64, y64 = (t.detach().to_dense().double() if t.is_sparse else t.detach().double() for t in (x, y))
        scale = max(float(x64.abs().max()) if x64.numel() else 0.0, 1e-12)
        rel = float((x64 - y64).abs().max()) / scale if x64.numel() else 0.0
        if not math.isfinite(rel) or rel > worst.relative:
            worst = Difference(rel, name)
    return worst


def _copy_model(model: nn.Module) -> nn.Module:
    """A deep copy of ``model``. A tensor a module keeps as a plain attribute that autograd made (the ``weight`` of
    ``torch.nn.utils.prune`` and of the old ``weight_norm``, remade by their hooks before every forward) is copied
    detached: torch refuses to deep-copy a tensor that is not a leaf of its graph."""
    memo: dict[int, Any] = {}
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, torch.Tensor) and v.grad_fn is not None:
                memo[id(v)] = v.detach().clone()
    return copy.deepcopy(model, memo)


def _plain_repeat(model: nn.Module, optimizer: torch.optim.Optimizer, plain: nn.Module, loss_fn: Callable[..., Any],
                  inputs: Any, targets: Any, micro: int, loss_norm: Any, rng: tuple[Any, Any], tolerance: float) -> str:
    """Where a comparison failed: run the plain step again on another copy, from the same random state, and say
    so if it differs from the first (the model reseeds or draws from a generator that cannot be restored, as
    Hugging Face's Reformer calls ``torch.seed()`` in its forward): the failure then says nothing of the plan."""
    again = _copy_model(model)
    state, host = rng_state(), host_rng_state()
    try:
        set_rng_state(rng[0])
        set_host_rng_state(rng[1])
        _plain_step(again, _copy_optimizer(optimizer, model, again), loss_fn, inputs, targets, micro, loss_norm)
    finally:
        set_rng_state(state)
        set_host_rng_state(host)
    diff = max((_largest(dict(plain.named_parameters()), dict(again.named_parameters()), set()),
                _largest({n: p.grad for n, p in plain.named_parameters()},
                         {n: p.grad for n, p in again.named_parameters()}, set())), key=lambda d: d.relative)
    if diff.relative <= tolerance:
        return ""
    return (f"plain PyTorch's own step does not repeat for this model: a second plain step from the same weights and "
            f"random state differs from the first by {diff} (its forward reseeds torch's generator, as Hugging "
            "Face's Reformer does with torch.seed(), or draws from one that cannot be restored), so this comparison "
            "cannot tell edgetrain's plan from the model's own variation")


def _copy_optimizer(optimizer: torch.optim.Optimizer, original: nn.Module, clone: nn.Module) -> torch.optim.Optimizer:
    """The optimizer's class, hyper-parameters and state over ``clone``'s parameters."""
    index = {id(p): i for i, p in enumerate(original.parameters())}
    params = list(clone.parameters())
    groups = []
    for g in optimizer.param_groups:
        try:
            mapped = [params[index[id(p)]] for p in g["params"]]
        except KeyError:
            raise ValueError("the optimizer holds tensors that are not parameters of the model; verify needs "
                             "an optimizer over model.parameters()") from None
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": mapped})
    opt = type(optimizer)(groups)
    opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return opt


def _plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
                inputs: Any, targets: Any, micro: int, norm: Any) -> float:
    env = bind_inputs(model, inputs)
    n = batch_size_of(inputs, targets)
    optimizer.zero_grad(set_to_none=True)
    if micro >= n:
        loss = loss_fn(model(**env), targets)
        with backward_outside_autocast():
            loss.backward()
        optimizer.step()
        return float(loss.detach())
    total = norm.weight(targets, n)
    parts = []
    stop = 0
    for size in run_micro_batch_sizes(n, micro):  # as the step splits it
        start, stop = stop, stop + size
        part = slice_batch(targets, start, stop)
        loss = loss_fn(model(**{k: slice_batch(v, start, stop) for k, v in env.items()}), part)
        weight = norm.weight(part, stop - start)
        if weight or norm.kind == "sum":
            with backward_outside_autocast():
                (loss * norm.scale(weight, total)).backward()
            parts.append((float(loss.detach()), weight))
    optimizer.step()
    return norm.combine(parts, total)


def verify(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor], example: Any,
           memory_budget: int | str | None = None, *, tolerance: float = 1e-5, **prepare_kw: Any) -> VerifyReport:
    """Compare one step of the prepared plan with plain PyTorch on copies of the model and optimizer.

    Args:
        model, optimizer, loss_fn, example, memory_budget: as for :func:`edgetrain.prepare` (copies are
            prepared and stepped; the originals are left exactly as they are).
        tolerance: the largest relative difference (``max|a - b| / max|a|`` per tensor) that passes. Float32
            sums taken in another order (a recomputed, sliced convolution) differ by about 1e-7.
        **prepare_kw: any other option of :func:`edgetrain.prepare` (``solver=``, ``micro_batch_size=``, ...).

    Returns:
        The :class:`VerifyReport` (``str(report)`` is a readable summary).

    Raises:
        Whatever :func:`edgetrain.prepare` raises for these arguments (a BudgetError for an infeasible budget).
    """
    from .api import _split_example, prepare

    model = unwrap_compiled(model)
    inputs, targets = _split_example(example)
    ours, plain = _copy_model(model), _copy_model(model)
    opt_ours, opt_plain = _copy_optimizer(optimizer, model, ours), _copy_optimizer(optimizer, model, plain)
    state, host = rng_state(), host_rng_state()
    try:
        step = prepare(ours, opt_ours, loss_fn, example, memory_budget, **prepare_kw)
        recorded: dict[int, torch.Tensor] | None = None
        if step.fused is not None:  # its gradients are freed as it goes: copied here to be compared
            recorded = step.fused.record = {}
        try:
            start, host_start = rng_state(), host_rng_state()  # NumPy's and Python's too: a forward may draw there
            loss_ours = step(inputs, targets)
            compiled = step.runs_compiled
        finally:
            step.close()
            if step.fused is not None:
                step.fused.record = None
        if recorded:
            for p in ours.parameters():
                if id(p) in recorded:
                    p.grad = recorded[id(p)]
        set_rng_state(start)
        set_host_rng_state(host_start)
        plan = step.plan
        whole_draws = EXACT_DRAWS_NOTE in plan.notes and plan.micro_batch_size < plan.batch_size
        fed = channels_last_images(inputs) if step.layout == "channels_last" else inputs  # as the step feeds it
        # a split step that draws the whole batch's dropout masks is one full-batch step (edgetrain.capture.draws)
        micro = plan.batch_size if whole_draws else plan.micro_batch_size
        loss_plain = _plain_step(plain, opt_plain, loss_fn, fed, targets, micro, step.loss_norm)
    finally:
        set_rng_state(state)
        set_host_rng_state(host)
    notes = []
    if recorded:
        notes.append("the plan fuses the optimizer update into the backward: each gradient compared as it was "
                     "completed, before its parameter's update")
    if compiled:
        notes.append("the step ran compiled (PlanConfig(compile=True)): TorchInductor's kernels round differently from "
                     "eager PyTorch's, and a tensor near zero (the gradient of a BatchNorm bias that the next "
                     "BatchNorm cancels, the first AdamW update of that bias) can then differ by its own size, so "
                     "the step is judged as prepare judged it against the eager step; verify with compile=False "
                     "compares edgetrain's plan with plain PyTorch bit for bit")
    if fed is not inputs:
        notes.append("the plan feeds the images channels-last (PlanConfig.layout), so the plain reference is fed them "
                     "channels-last too: against an NCHW step, values differ by the layout's float rounding")
    skip: set[str] = set()
    if whole_draws:
        notes.append(f"the plan splits the batch into micro-batches of {plan.micro_batch_size} and draws the whole "
                     "batch's dropout masks, so the plain reference is one full-batch step")
    elif plan.micro_batch_size < plan.batch_size:
        for name, _ in batchnorm_modules(ours):
            skip.update(f"{name}.{b}" for b in ("running_mean", "running_var", "num_batches_tracked"))
        if skip:
            notes.append("micro-batched BatchNorm: running statistics not compared (edgetrain keeps them equal to "
                         "one full-batch forward's; the accumulating reference updates them per micro-batch)")
        notes.append(f"the plain reference accumulates micro-batches of {plan.micro_batch_size}, as the plan does")
    params = _largest(dict(plain.named_parameters()), dict(ours.named_parameters()), set())
    grads = _largest({n: p.grad for n, p in plain.named_parameters()},
                     {n: p.grad for n, p in ours.named_parameters()}, set())
    buffers = _largest(dict(plain.named_buffers()), dict(ours.named_buffers()), skip)
    passed = all(d.relative <= tolerance for d in (params, grads, buffers))
    criterion = ""
    if compiled or whole_draws:
        from .planning.compiled import GRAD_RTOL, LOSS_RTOL, losses_agree, relative_l2

        g = relative_l2({n: p.grad for n, p in plain.named_parameters()},
                        {n: p.grad for n, p in ours.named_parameters()})[0]
        b = relative_l2(dict(plain.named_buffers()), dict(ours.named_buffers()), skip)[0]
        # the update is the optimizer's own eager code on these gradients; an adaptive one (AdamW) turns rounding in
        # a near-zero gradient into a full-size step, so the parameters are shown but judged through the gradients
        if compiled:
            passed = losses_agree(loss_plain, loss_ours) and max(g, b) <= GRAD_RTOL
            criterion = (f"loss within {LOSS_RTOL:g} relative; gradients {g:.2%} and buffers {b:.2%} apart as "
                         f"relative L2 norms, at most {GRAD_RTOL:.0%}")
        else:  # the micro-batches' float sums against one batch's: a gradient that is all rounding (attention's
            # key bias) is as far apart as it is large, so the gradients are judged together
            passed = abs(loss_ours - loss_plain) <= tolerance * max(abs(loss_plain), 1e-6) and max(g, b) <= tolerance
            criterion = (f"loss within {tolerance:g} relative; gradients {g:.1e} and buffers {b:.1e} apart as "
                         f"relative L2 norms, at most {tolerance:g}")
    if not passed and not compiled:
        repeat = _plain_repeat(model, optimizer, plain, loss_fn, fed, targets, micro, step.loss_norm,
                               (start, host_start), tolerance)
        if repeat:
            notes.append(repeat)
    return VerifyReport(passed, tolerance, params, grads, buffers, loss_plain, loss_ours, plan.micro_batch_size,
                        plan.batch_size, plan.num_stages, plan.policies.count("recompute"), tuple(notes), criterion)
