"""`PlanTable`: plans precomputed over a grid of budgets, so a budget change mid-training is a lookup."""

from __future__ import annotations

import bisect
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import BudgetError
from ..graph import KEEP, CostChain, simulate
from ..plan import Plan
from ..units import format_bytes
from ..planners._common import TIME_RTOL
from ..planners.dp import min_feasible_bytes, solve_dp

__all__ = ["PlanTable", "budget_grid"]

logger = logging.getLogger(__name__)


def budget_grid(chain: CostChain, n_points: int = 64, *,
                micro_batch_sizes: Sequence[int] | None = None) -> list[int]:
    """Budgets from the smallest feasible one to the no-saving peak at micro-batch ``B``.

    The grid is geometric in the *activation* bytes (budget minus the chain's fixed bytes): consecutive
    points differ by a constant factor ``r = (hi / lo) ** (1 / (n_points - 1))`` of activation memory,
    so a budget between two points loses at most a fraction ``1 - 1/r`` of its activation memory to the
    grid, uniformly from tight to loose budgets (where a linear grid would waste its points on the
    loose end, where plans stop changing).

    Args:
        chain: the profiled chain.
        n_points: number of grid points (>= 1; duplicates after rounding are dropped).
        micro_batch_sizes: sizes allowed, as for :func:`edgetrain.planners.solve_dp`.

    Returns:
        Distinct budgets in bytes, ascending; the first is :func:`min_feasible_bytes`.
    """
    if n_points < 1:
        raise ValueError(f"n_points must be >= 1, got {n_points}")
    lo = min_feasible_bytes(chain, micro_batch_sizes=micro_batch_sizes)
    hi = simulate(chain, chain.batch_size, (KEEP,) * chain.n).peak_bytes
    act_lo, act_hi = lo - chain.fixed_bytes, hi - chain.fixed_bytes
    if n_points == 1 or act_hi <= act_lo:
        return [lo]
    if act_lo <= 0:
        acts = np.linspace(0, act_hi, n_points)
    else:
        acts = np.geomspace(act_lo, act_hi, n_points)
    grid = {lo, hi} | {chain.fixed_bytes + int(a) for a in acts[1:-1]}
    return sorted(b for b in grid if lo <= b <= hi)


@dataclass(frozen=True)
class PlanTable:
    """Best plans at a grid of budgets; :meth:`plan_for` answers any budget by binary search.

    Attributes:
        budgets: grid budgets in bytes, ascending.
        plans: the plan for each grid budget (its predicted peak fits that budget; a larger budget
            never gets a slower plan: where the solver returned a slower one, the faster plan of a
            smaller budget is reused).
        solver: name of the planner that filled the table.
        build_time_s: seconds spent building.
    """

    budgets: tuple[int, ...]
    plans: tuple[Plan, ...]
    solver: str = "dp"
    build_time_s: float = 0.0

    @staticmethod
    def build(chain: CostChain, budgets: Sequence[int] | None = None, *, n_points: int = 64,
              solver: Callable[..., Plan] = solve_dp, **solver_kw: Any) -> "PlanTable":
        """Solve ``chain`` at every budget of a grid.

        Args:
            chain: the profiled chain.
            budgets: the grid; ``None`` uses :func:`budget_grid` with ``n_points``.
            n_points: grid size when ``budgets`` is ``None``.
            solver: a planner ``solver(chain, budget_bytes, **solver_kw) -> Plan``.
            **solver_kw: options passed to the solver (e.g. ``micro_batch_sizes``, ``max_buckets``).

        Returns:
            The table. Grid budgets the solver cannot fit are left out.

        Raises:
            BudgetError: the solver fits none of the budgets.
        """
        start = time.perf_counter()
        if budgets is None:
            budgets = budget_grid(chain, n_points, micro_batch_sizes=solver_kw.get("micro_batch_sizes"))
        kept_budgets: list[int] = []
        plans: list[Plan] = []
        last_error: BudgetError | None = None
        for b in sorted({int(b) for b in budgets}):
            try:
                plan = solver(chain, b, **solver_kw)
            except BudgetError as err:
                last_error = err
                continue
            if plans and plans[-1].step_time_s < plan.step_time_s * (1 - TIME_RTOL):
                plan = plans[-1].replace(budget_bytes=b)
            kept_budgets.append(b)
            plans.append(plan)
        if not plans:
            if last_error is not None:
                raise last_error
            raise ValueError("PlanTable.build needs at least one budget")
        elapsed = time.perf_counter() - start
        name = plans[0].solver
        logger.info("plan table (%s): %d budgets %s..%s built in %.2f s", name, len(plans),
                    format_bytes(kept_budgets[0]), format_bytes(kept_budgets[-1]), elapsed)
        return PlanTable(tuple(kept_budgets), tuple(plans), name, elapsed)

    def plan_for(self, budget_bytes: int) -> Plan:
        """The plan of the largest grid budget ``<=`` ``budget_bytes`` (a binary search).

        Raises:
            BudgetError: ``budget_bytes`` is below the smallest grid budget.
        """
        i = bisect.bisect_right(self.budgets, budget_bytes) - 1
        if i < 0:
            raise BudgetError(
                f"no plan in the table fits {format_bytes(budget_bytes)}; the smallest budget it holds is "
                f"{format_bytes(self.budgets[0])} ({self.budgets[0]} bytes). Raise the budget to at least that.",
                budget_bytes=int(budget_bytes), min_feasible_bytes=self.budgets[0])
        return self.plans[i]

    def __len__(self) -> int:
        return len(self.budgets)

    def to_json(self) -> str:
        """Serialise to JSON (round-trips through :meth:`from_json`)."""
        d: dict[str, Any] = {"budgets": list(self.budgets), "solver": self.solver,
                             "build_time_s": self.build_time_s,
                             "plans": [json.loads(p.to_json()) for p in self.plans]}
        return json.dumps(d)

    @staticmethod
    def from_json(text: str) -> "PlanTable":
        d = json.loads(text)
        plans = tuple(Plan.from_json(json.dumps(p)) for p in d["plans"])
        return PlanTable(tuple(int(b) for b in d["budgets"]), plans, d.get("solver", "dp"),
                         float(d.get("build_time_s", 0.0)))
