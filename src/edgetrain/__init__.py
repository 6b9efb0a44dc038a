"""edgetrain: exact training of PyTorch models under hard memory, time and energy budgets."""

from __future__ import annotations

from .errors import BudgetError, CaptureError, EdgetrainError, InputError, ProfileError
from .graph import CostChain, Linear, StageCost, simulate
from .plan import Plan
from .units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "BudgetError", "CaptureError", "EdgetrainError", "InputError", "ProfileError",
    "CostChain", "Linear", "StageCost", "simulate", "Plan", "format_bytes", "parse_bytes",
]
