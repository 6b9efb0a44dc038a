"""Opt-in approximations: they change which gradients are computed, and report what that costs.

* :mod:`.elastic`: ElasticTrainer's run-time tensor selection (``prepare(speedup=...)``).
* :mod:`.gradfilter`: Gradient Filtering, convolutions backpropagated on patch-averaged gradients
  (``prepare(grad_filter=...)``).

Everything else in edgetrain is exact; these are not, and their accuracy cost is measured in
``bench/RESULTS_ELASTIC.md`` and ``bench/RESULTS_GRADFILTER.md``.
"""

from __future__ import annotations

from .elastic import ElasticConfig, tensor_importance
from .gradfilter import (
    GradFilter, GradFilterPlan, GradFilterReport, apply_grad_filter, auto_grad_filter, estimate_costs,
    plan_grad_filter, remove_grad_filter,
)

__all__ = [
    "ElasticConfig", "tensor_importance", "GradFilter", "GradFilterPlan", "GradFilterReport",
    "apply_grad_filter", "auto_grad_filter", "estimate_costs", "plan_grad_filter", "remove_grad_filter",
]
