"""Which memory layout a convolutional model's step runs in: the batch as given, or channels-last.

oneDNN, PyTorch's CPU convolution library, is fastest on channels-last (NHWC) maps: a plain PyTorch step of
MobileNetV2 at 64x64 runs about 1.6x faster with its images channels-last, ResNet-18 at 32x32 about 1.06x
(bench/bench_layout.py). Feeding the model channels-last images is enough: every convolution then picks the
channels-last kernels and its output keeps the layout, through BatchNorm, activations and additions, with the
model's parameters untouched. The values are the same maths; the kernels round differently (about 1e-6
relative in float32), as any change of kernel does.

Channels-last costs memory where edgetrain's leaner kernels do not cover it: lean BatchNorm's exact kernel
reproduces PyTorch's NCHW backward only, so a channels-last graph runs BatchNorm as written, holding more for
its backward. Whether the faster kernels win depends on the budget: under a tight one, the extra bytes cost
recomputation. So ``PlanConfig(layout="auto")`` profiles the chain both ways, each in a fork of its own (the
profiles are kept, so the layout chosen is not profiled again), and takes channels-last where the cost model's
fastest step inside the budget is at least :data:`MARGIN` faster than the given layout's.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

from torch import nn

from ..batch import channels_last_copy_bytes, channels_last_images, has_images
from ..capture import bind_inputs
from ..errors import BudgetError, CaptureError
from ..graph import CostChain
from ..profile.fork import measure_in_child
from .planner import Planner

__all__ = ["LAYOUT_KEY", "MARGIN", "choose_layout", "convolutional", "explained", "predicted_step_s", "with_layout"]

log = logging.getLogger("edgetrain.api")

#: the plan's metadata key naming the layout its step feeds the model (absent: the batch as given)
LAYOUT_KEY = "layout"

#: channels-last is taken by ``layout="auto"`` only where its predicted step is this much faster (profiles
#: of one process vary by a few percent; a tie keeps the layout the user gave, and lean BatchNorm's memory)
MARGIN = 0.05


def convolutional(model: nn.Module, inputs: Any) -> bool:
    """Whether channels-last can change anything: the model has 2-D convolutions and the batch has images
    (4-D floating-point tensors)."""
    return has_images(inputs) and any(isinstance(m, nn.Conv2d) for m in model.modules())


def with_layout(analysis: Any, layout: str) -> Any:
    """``analysis`` for the batch in ``layout`` (``"keep"``: itself), with profiles of its own."""
    if layout == "keep":
        return analysis
    inputs = channels_last_images(analysis.inputs)
    # a step converts each batch it is given: that copy is held through the step beside the caller's batch
    copied = channels_last_copy_bytes(analysis.inputs)
    return replace(analysis, inputs=inputs, env=bind_inputs(analysis.model, inputs), profiles={},
                   fixed=analysis.fixed + copied, batch_copy=copied)


def predicted_step_s(analysis: Any, chain: Any, costs: CostChain) -> float | None:
    """The cost model's fastest step inside ``analysis``'s budget (no plan is run), or None where none fits."""
    from .analysis import block_solver_options

    reasons = analysis.unsplittable(chain)
    micro = analysis.batch if reasons else analysis.micro_batch_size
    opts = {**analysis.solver_kw, **block_solver_options(chain, analysis.solver)}
    planner = Planner(costs, analysis.budget, analysis.margin, analysis.solver, micro, analysis.prefer_full_batch,
                      analysis.min_micro, analysis.update_bytes, opts, margin_share=analysis.margin_share,
                      whole_batch_only=bool(reasons), runs_vary=chain.skips_blocks)
    try:
        return planner.plan(analysis.plan_budget).step_time_s
    except BudgetError:
        return None


def _profiled(analysis: Any) -> tuple[float | None, dict[str, Any]] | None:
    """In a fork: capture and profile ``analysis``'s chain; its predicted step and the profiles it took."""
    def work() -> tuple[float | None, dict[str, Any]]:
        known = set(analysis.profiles)
        chain = analysis.capture_chain()
        costs = analysis.profile(chain, with_overhead=True)
        return predicted_step_s(analysis, chain, costs), {k: v for k, v in analysis.profiles.items()
                                                          if k not in known}
    return measure_in_child(work)


def choose_layout(analysis: Any) -> tuple[Any, str]:
    """The analysis to plan with (``analysis`` itself or its channels-last twin) and why, for
    ``layout="auto"``. Each layout is profiled in a fork of its own; the profiles come back into the
    analysis returned, so planning it does not profile again."""
    twin = with_layout(analysis, "channels_last")
    given, cl = _profiled(analysis), _profiled(twin)
    if given is None or cl is None:
        return analysis, "channels-last not compared (no fork, or it failed there); the batch as given"
    (t_given, memo_given), (t_cl, memo_cl) = given, cl
    analysis.profiles.update(memo_given)
    twin.profiles.update(memo_cl)
    shown = f"predicted step {_s(t_given)} as given, {_s(t_cl)} channels-last"
    if t_cl is not None and (t_given is None or t_cl < (1 - MARGIN) * t_given):
        return twin, f"channels-last ({shown})"
    return analysis, f"the batch as given ({shown})"


def _s(t: float | None) -> str:
    return "none inside the budget" if t is None else f"{t:.3g} s"


@contextmanager
def explained(layout: str) -> Iterator[None]:
    """A capture failing on channels-last images says so: the usual cause is the model's own ``.view()`` of a
    map, which needs NCHW strides."""
    try:
        yield
    except CaptureError as e:
        if layout != "channels_last":
            raise
        raise CaptureError(f"{e} The images were fed channels-last (PlanConfig(layout='channels_last')); a model "
                           "that reads its maps with .view() needs them NCHW: use layout='keep', or 'auto' (which "
                           "keeps the layout given where channels-last does not run), or .reshape() in the "
                           "model.") from e
