"""Opt-in approximate adaptations of the computation: gradient filtering and elastic tensor selection."""

from __future__ import annotations

from .elastic import ElasticConfig, ElasticSelector, tensor_importance
from .elastic_select import Selection, SpeedupPlan, plan_for_speedup, select_tensors, solve_units
from .elastic_state import TrainingSnapshot
from .elastic_timing import TensorTiming, measure_timing
from .gradfilter import (
    FilteredConv2d, GradFilter, GradFilterReport, LayerCost, apply_grad_filter, auto_grad_filter,
    estimate_costs, filtered_conv2d, remove_grad_filter,
)
from ._gradfilter_auto import FilterTimings, GradFilterPlan, measure_filter_timings, plan_grad_filter

__all__ = [
    "FilteredConv2d", "GradFilter", "GradFilterReport", "LayerCost", "apply_grad_filter",
    "auto_grad_filter", "estimate_costs", "filtered_conv2d", "remove_grad_filter",
    "FilterTimings", "GradFilterPlan", "measure_filter_timings", "plan_grad_filter",
    "ElasticConfig", "ElasticSelector", "tensor_importance", "Selection", "SpeedupPlan", "plan_for_speedup",
    "select_tensors", "solve_units", "TrainingSnapshot", "TensorTiming", "measure_timing",
]
