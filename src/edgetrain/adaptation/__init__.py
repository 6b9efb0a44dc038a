"""Budget adaptation while training: the memory budget may change between (and inside) steps.

:class:`BudgetController` (one per :class:`~edgetrain.api.TrainStep`) looks the new plan up in a
:class:`PlanTable` (plans precomputed over a grid of budgets, so a change is a lookup, not a solve) and
polls a budget source; :func:`system_budget_source` is the built-in source (cgroup limit and available
memory).
"""

from __future__ import annotations

from .controller import BudgetController
from .sources import available_bytes, cgroup_limit_bytes, system_budget_source
from .table import PlanTable, budget_grid

__all__ = ["BudgetController", "PlanTable", "budget_grid", "system_budget_source", "cgroup_limit_bytes",
           "available_bytes"]
