"""Planners: pure functions from a :class:`~edgetrain.graph.CostChain` and a budget to a :class:`~edgetrain.plan.Plan`.

``solve_dp`` is the exact keep/recompute planner; the baselines (``no_saving``, ``recompute_all``,
``chen_sqrt``, ``checkpoint_sequential``) and the POET-style paging planners (``poet``: exact DP,
``poet-milp``: HiGHS MILP) return the same type for side-by-side comparison, and
:class:`PlanTable` precomputes plans over a grid of budgets so a budget change is a lookup.
"""

from __future__ import annotations

from typing import Any, Callable

from ..graph import CostChain
from ..plan import Plan
from .baselines import solve_checkpoint_sequential, solve_chen_sqrt, solve_no_saving, solve_recompute_all
from .dp import min_feasible_bytes, solve_dp
from .poet_milp import solve_poet
from .poet import solve_poet_dp
from ..adaptation.table import PlanTable

__all__ = [
    "PLANNERS", "solve", "solve_dp", "min_feasible_bytes", "solve_no_saving", "solve_recompute_all",
    "solve_chen_sqrt", "solve_checkpoint_sequential", "PlanTable", "solve_poet", "solve_poet_dp",
]

#: Every planner by name; each is ``solver(chain, budget_bytes, **options) -> Plan``.
PLANNERS: dict[str, Callable[..., Plan]] = {
    "dp": solve_dp,
    "no_saving": solve_no_saving,
    "recompute_all": solve_recompute_all,
    "chen_sqrt": solve_chen_sqrt,
    "checkpoint_sequential": solve_checkpoint_sequential,
    # keep / recompute / page, energy or time objective, optional time budget (need ``device=``)
    "poet": solve_poet_dp,
    "poet-milp": solve_poet,
}


def solve(chain: CostChain, budget_bytes: int, solver: str = "dp", **kw: Any) -> Plan:
    """Plan ``chain`` under ``budget_bytes`` with the planner named ``solver``.

    Args:
        chain: the profiled chain.
        budget_bytes: peak bytes the step may use.
        solver: a key of :data:`PLANNERS`.
        **kw: options of that planner (e.g. ``micro_batch_sizes``).

    Returns:
        The planner's :class:`~edgetrain.plan.Plan`.

    Raises:
        ValueError: ``solver`` is not a known planner name.
        BudgetError: nothing fits the budget.
    """
    try:
        fn = PLANNERS[solver]
    except KeyError:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(sorted(PLANNERS))}") from None
    return fn(chain, budget_bytes, **kw)
