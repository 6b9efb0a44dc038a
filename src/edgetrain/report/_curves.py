"""What the cost model predicts for a report: a plan's memory timeline over one step, and budget curves."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import BudgetError
from ..graph import RECOMPUTE, CostChain, micro_batch_sizes
from ..plan import Plan

__all__ = ["planned_timeline", "budget_curves", "energy_curves", "BASELINES", "Curve"]

#: edgetrain's exact planner and the baselines the report compares it with, with their labels
BASELINES: tuple[tuple[str, str], ...] = (
    ("dp", "edgetrain (exact DP)"),
    ("no_saving", "no saving + accumulation"),
    ("recompute_all", "checkpoint every stage"),
    ("chen_sqrt", "Chen sqrt(n)"),
    ("checkpoint_sequential", "checkpoint_sequential"),
)


@dataclass(frozen=True)
class Curve:
    """One planner's predictions over a grid of budgets (NaN where nothing fits)."""

    label: str
    budgets_bytes: tuple[int, ...]
    values: tuple[float, ...]


def _spans(plan: Plan) -> list[tuple[int, int]]:
    spans, start = [], 0
    for t in range(1, plan.num_stages + 1):
        if t == plan.num_stages or plan.groups[t] != plan.groups[start]:
            spans.append((start, t - 1))
            start = t
    return spans


def planned_timeline(costs: CostChain, plan: Plan) -> tuple[list[float], list[int]]:
    """Predicted (seconds, bytes) points of one step of ``plan``: the fixed bytes plus live activations.

    Forward holds each kept stage's saved tensors and output, a recomputed group only its last output;
    backward re-runs a recomputed group first (its saved tensors back), then frees stage by stage. Each
    micro-batch repeats this; the optimizer update follows. Times are the cost model's.
    """
    t, mem = 0.0, 0
    ts, ms = [0.0], [costs.fixed_bytes]

    def point(dt: float, dmem: int) -> None:
        nonlocal t, mem
        t += dt
        mem += dmem
        ts.append(t)
        ms.append(costs.fixed_bytes + max(mem, 0))

    st = costs.stages
    for m in micro_batch_sizes(plan.batch_size, plan.micro_batch_size):
        saved = [math.ceil(s.saved_bytes.at(m)) for s in st]
        out = [math.ceil(s.out_bytes.at(m)) for s in st]
        point(0.0, math.ceil(costs.input_bytes.at(m)))
        held: list[int] = []
        for i, j in _spans(plan):
            if plan.policies[i] == RECOMPUTE:
                for k in range(i, j + 1):
                    point(st[k].fwd_s.at(m), 0)
                point(0.0, out[j])
                held.append(out[j])
            else:
                point(st[i].fwd_s.at(m), saved[i] + out[i])
                held.append(saved[i] + out[i])
        for (i, j), h in zip(reversed(_spans(plan)), reversed(held)):
            if plan.policies[i] == RECOMPUTE:
                rebuilt = sum(saved[k] + out[k] for k in range(i, j + 1)) - out[j]
                point(sum(st[k].fwd_s.at(m) for k in range(i, j + 1)), rebuilt)
                for k in range(j, i - 1, -1):
                    point(st[k].bwd_s.at(m), -(saved[k] + out[k]))
            else:
                point(st[i].bwd_s.at(m), -h)
        point(0.0, -mem)  # the micro-batch's input and leftovers are freed
    point(costs.step_fixed_s, 0)
    return ts, ms


def _grid(costs: CostChain, n_points: int) -> list[int]:
    from ..adaptation.table import budget_grid

    grid = budget_grid(costs, n_points=n_points)
    hi = grid[-1]
    return sorted(set(grid) | {int(hi * 1.15)})


def budget_curves(costs: CostChain, n_points: int = 24,
                  planners: Sequence[tuple[str, str]] = BASELINES) -> list[Curve]:
    """Predicted step time (s) of each planner over budgets from the smallest feasible to beyond no-saving."""
    from ..planners import solve

    grid = _grid(costs, n_points)
    curves = []
    for name, label in planners:
        values = []
        for b in grid:
            try:
                values.append(solve(costs, b, solver=name).step_time_s)
            except BudgetError:
                values.append(float("nan"))
        curves.append(Curve(label, tuple(grid), tuple(values)))
    return curves


def energy_curves(costs: CostChain, device: Any, n_points: int = 16) -> list[Curve]:
    """Predicted energy per step (J) over budgets, with paging and with recomputation only (POET-style DP)."""
    from ..planners import solve_poet_dp

    grid = _grid(costs, n_points)
    curves = []
    for label, paging in (("recompute + paging", True), ("recompute only", False)):
        values = []
        for b in grid:
            try:
                p = solve_poet_dp(costs, b, device=device, objective="energy", paging=paging)
                values.append(float(p.energy_j) if p.energy_j is not None else float("nan"))
            except BudgetError:
                values.append(float("nan"))
        curves.append(Curve(label, tuple(grid), tuple(values)))
    return curves
