"""A validation run's figures (:class:`Measured`) and the arithmetic of budget margins around them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..plan import Plan

__all__ = ["MIN_MARGIN_BYTES", "RETRY_SLACK", "STALE_BYTES", "later_growth", "Measured", "RunOver", "budget_for",
           "predicted_activations", "safety_margin_bytes", "plan_key", "recomputes"]


@dataclass(frozen=True)
class Measured:
    """One validation run, in bytes above the import baseline.

    ``process_rss``: the resident memory of the process that will train, once the run was done (None when
    unknown). A run in a fork leaves this process as it was; one in this process leaves its residue here.
    The run's figures hold for a step started from that state; :meth:`Planner.plan_validated` runs the
    plan again when the process has grown since.
    """

    rss_before: int
    peak: int
    rss_after: int
    process_rss: int | None = None
    # the optimizer updates' peak, where measured apart (real steps): ``peak`` is then the forward and
    # backward passes' alone, so an update's transients are not mistaken for activations the cost model missed
    update_peak: int | None = None


class RunOver(Exception):
    """A plan validated in another process (the single-threaded analysing child) measured over the budget in
    this one, which runs more intra-op threads; raised instead of planning on here (``strict`` validation), so
    that the caller can plan again in a child with the difference held back.

    Attributes:
        measured: the run's peak here, as :meth:`Planner.plan_validated` compares it with the plan budget.
        planned: the same plan's measured peak in the other process.
        limit: the plan budget (the budget less its safety margin) it was compared with.
    """

    def __init__(self, measured: int, planned: int, limit: int) -> None:
        super().__init__(f"the plan measured {measured} bytes here against {planned} where it was validated "
                         f"(limit {limit})")
        self.measured = measured
        self.planned = planned
        self.limit = limit


def predicted_activations(plan: Plan, fixed: int) -> int:
    """Bytes the cost model predicts a plan's activations take at its peak (above the fixed bytes)."""
    return int(plan.metadata.get("activation_peak_bytes", plan.peak_bytes - fixed))


#: the least a positive safety margin holds back (see ``prepare(safety_margin=)``)
MIN_MARGIN_BYTES = 2**20

#: what the smallest feasible budget a BudgetError names keeps above the measured need, for a retry in a
#: fresh process (whose runs measure a little differently)
RETRY_SLACK = 1.05

#: growth of the process since a plan's validation run beyond which the run no longer speaks for a step
STALE_BYTES = 256 * 2**10


#: what a process's steps add over their first hundreds, beyond a validation run's peak, at most: glibc's and
#: Python's heaps grow a little (plain PyTorch's too); a transformer planned at 54.1 MiB measured 54.3 MiB by
#: step 100 and 54.4 MiB by step 1,000, and 0.3-0.4 MiB over its plan in 2 of 6 six-step runs; with 0.5 MiB held,
#: one fresh process of 112 (MobileNetV2, 136 MiB) still measured 16 KiB over its plan
LATER_GROWTH_BYTES = 2**20


def later_growth(run_peak: int) -> int:
    """Bytes a plan's peak holds above its validation run's ``run_peak`` for the steps after it:
    :data:`LATER_GROWTH_BYTES`, or 1% of the run's peak where that is less (a small model's heaps grow less)."""
    return min(LATER_GROWTH_BYTES, max(0, run_peak) // 100)


def safety_margin_bytes(budget: int, share: float) -> int:
    """Bytes of ``budget`` held back: ``share`` of it, at least :data:`MIN_MARGIN_BYTES` (never over half)."""
    if share <= 0:
        return 0
    return min(budget // 2, max(int(budget * share), MIN_MARGIN_BYTES))


def budget_for(need: int, share: float) -> int:
    """The smallest budget whose margin (:func:`safety_margin_bytes`) leaves ``need`` bytes to plan with."""
    if share <= 0:
        return need
    return max(math.ceil(need / (1 - share)), need + MIN_MARGIN_BYTES) if need > MIN_MARGIN_BYTES else 2 * need


def plan_key(plan: Plan) -> tuple[int, tuple[str, ...]]:
    """A plan's identity for the runs validation keeps: its micro-batch size and policies."""
    return plan.micro_batch_size, tuple(plan.policies)


def recomputes(plan: Plan) -> bool:
    """Whether a plan runs checkpointing (or paging) code: that code's own pages stay resident after its
    first run, so validation measures the fixed bytes of such plans apart from those of plans that keep
    every stage."""
    return any(p != "keep" for p in plan.policies)
