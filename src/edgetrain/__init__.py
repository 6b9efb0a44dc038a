"""edgetrain: exact training of PyTorch models under hard memory, time and energy budgets."""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any

from .config import PagingConfig, PlanConfig
from .errors import BudgetError, CaptureError, ConfigError, EdgetrainError, InputError, ProfileError
from .graph import CostChain, Linear, StageCost, simulate
from .losses import TokenCrossEntropyLoss
from .plan import Plan
from .profile import memory  # noqa: F401  (records the budget baseline, tunes malloc)
from .units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "BudgetError", "CaptureError", "ConfigError", "EdgetrainError", "InputError", "ProfileError",
    "CostChain", "Linear", "StageCost", "simulate", "Plan", "format_bytes", "parse_bytes",
    "PlanConfig", "PagingConfig", "TokenCrossEntropyLoss",
]

from .api import TrainStep, prepare  # noqa: E402
from .approx import ElasticConfig, GradFilter  # noqa: E402
from .offline import plan_for_device  # noqa: E402
from .profile.memory import measure_peak  # noqa: E402
from .trainer import Trainer, TrainerConfig  # noqa: E402
from .verify import VerifyReport, verify  # noqa: E402

__all__ += ["TrainStep", "prepare", "measure_peak", "plan_for_device", "GradFilter", "ElasticConfig", "Trainer",
            "TrainerConfig", "verify", "VerifyReport"]

from . import models, planners  # noqa: E402,F401  (imported now so their import is not charged to a budget)


class _PlanModule(types.ModuleType):
    """``edgetrain.plan`` is the module of :class:`Plan`; calling it is the old name of :func:`plan_for_device`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        warnings.warn("edgetrain.plan(...) is deprecated and will be removed in the next release: call "
                      "edgetrain.plan_for_device(...)", DeprecationWarning, stacklevel=2)
        return plan_for_device(*args, **kwargs)


sys.modules[__name__ + ".plan"].__class__ = _PlanModule

memory.warm_torch_imports()
memory.record_baseline()
