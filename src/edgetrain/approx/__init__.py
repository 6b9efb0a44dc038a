"""Opt-in approximate adaptations of the computation: gradient filtering and elastic tensor selection."""

from __future__ import annotations

from .elastic.selector import ElasticConfig, ElasticSelector, tensor_importance
from .elastic.select import Selection, SpeedupPlan, plan_for_speedup, select_tensors, solve_units
from .elastic.state import TrainingSnapshot
from .elastic.timing import TensorTiming, measure_timing
from .gradfilter.core import (
    FilteredConv2d, GradFilter, GradFilterReport, LayerCost, apply_grad_filter, auto_grad_filter,
    estimate_costs, filtered_conv2d, remove_grad_filter,
)
from .gradfilter.auto import FilterTimings, GradFilterPlan, measure_filter_timings, plan_grad_filter

__all__ = [
    "FilteredConv2d", "GradFilter", "GradFilterReport", "LayerCost", "apply_grad_filter",
    "auto_grad_filter", "estimate_costs", "filtered_conv2d", "remove_grad_filter",
    "FilterTimings", "GradFilterPlan", "measure_filter_timings", "plan_grad_filter",
    "ElasticConfig", "ElasticSelector", "tensor_importance", "Selection", "SpeedupPlan", "plan_for_speedup",
    "select_tensors", "solve_units", "TrainingSnapshot", "TensorTiming", "measure_timing",
]
