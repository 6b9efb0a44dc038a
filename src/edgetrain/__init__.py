"""edgetrain: exact training of PyTorch models under hard memory, time and energy budgets."""

from __future__ import annotations

from .profile import memory  # noqa: F401  (records the budget baseline, tunes malloc)
from .errors import BudgetError, CaptureError, ConfigError, EdgetrainError, InputError, ProfileError
from .graph import CostChain, Linear, StageCost, simulate
from .plan import Plan
from .units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "BudgetError", "CaptureError", "ConfigError", "EdgetrainError", "InputError", "ProfileError",
    "CostChain", "Linear", "StageCost", "simulate", "Plan", "format_bytes", "parse_bytes",
]

from .api import TrainStep, prepare  # noqa: E402
from .profile.memory import measure_peak  # noqa: E402
from .offline import plan  # noqa: E402
from .approx import ElasticConfig, GradFilter  # noqa: E402
from .verify import VerifyReport, verify  # noqa: E402

from .trainer import Trainer, TrainerConfig  # noqa: E402

__all__ += ["TrainStep", "prepare", "measure_peak", "plan", "GradFilter", "ElasticConfig", "Trainer",
            "TrainerConfig", "verify", "VerifyReport"]

from . import models, planners  # noqa: E402,F401  (imported now so their import is not charged to a budget)

memory.warm_torch_imports()
memory.record_baseline()
