"""Gradient Filtering: backpropagate convolutions on patch-averaged gradients (opt-in, approximate).

:class:`GradFilter` says which convolutions and what radius; :func:`apply_grad_filter` swaps them in place
(:mod:`.core`); :func:`plan_grad_filter` / :func:`auto_grad_filter` choose layers and radius for a speed-up
or memory target from timings measured on this machine (:mod:`.auto`); :mod:`.trace` costs the layers.
The kernels live in the private modules (:mod:`._impl`, :mod:`._dense`, :mod:`._native` with its C source).
"""

from __future__ import annotations

from .auto import GradFilterPlan, auto_grad_filter, plan_grad_filter
from .core import GradFilter, GradFilterReport, apply_grad_filter, estimate_costs, remove_grad_filter
from .trace import LayerCost

__all__ = [
    "GradFilter", "GradFilterReport", "GradFilterPlan", "LayerCost", "apply_grad_filter", "remove_grad_filter",
    "auto_grad_filter", "plan_grad_filter", "estimate_costs",
]
