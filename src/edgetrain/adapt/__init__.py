"""Opt-in approximate adaptations of the computation: gradient filtering (and elastic selection)."""

from __future__ import annotations

from .gradfilter import (
    FilteredConv2d, GradFilter, GradFilterReport, LayerCost, apply_grad_filter, auto_grad_filter,
    estimate_costs, filtered_conv2d, remove_grad_filter,
)

__all__ = [
    "FilteredConv2d", "GradFilter", "GradFilterReport", "LayerCost", "apply_grad_filter",
    "auto_grad_filter", "estimate_costs", "filtered_conv2d", "remove_grad_filter",
]
