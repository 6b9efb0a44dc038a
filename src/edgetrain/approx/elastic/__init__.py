"""ElasticTrainer: at run time, train only the parameter tensors that matter most, to fit a speed-up.

:class:`ElasticConfig` is what users pass (``prepare(speedup=ElasticConfig(...))``); :class:`ElasticSelector`
does the work: it measures per-tensor backward times on the real model (:mod:`.timing`, :mod:`.measure`),
evaluates importance, picks tensors with an exact knapsack (:mod:`.select`), corrects its time model
from the steps' own times (:mod:`.feedback`), and tells the memory planner which prefix is frozen
(:mod:`.memory`).
"""

from __future__ import annotations

from .select import Selection, SpeedupPlan, plan_for_speedup, select_tensors
from .selector import ElasticConfig, ElasticSelector, tensor_importance
from .state import TrainingSnapshot
from .timing import TensorTiming, measure_timing

__all__ = [
    "ElasticConfig", "ElasticSelector", "tensor_importance", "Selection", "SpeedupPlan", "plan_for_speedup",
    "select_tensors", "TrainingSnapshot", "TensorTiming", "measure_timing",
]
