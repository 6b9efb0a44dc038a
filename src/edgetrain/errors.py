"""The exceptions edgetrain raises: each says what was wrong and what to do."""

from __future__ import annotations

__all__ = ["EdgetrainError", "BudgetError", "CaptureError", "ProfileError", "InputError", "ConfigError"]


class EdgetrainError(Exception):
    """Base class of every error raised by edgetrain."""


class BudgetError(EdgetrainError, ValueError):
    """No plan fits the requested memory (or time) budget.

    Attributes:
        budget_bytes: the budget that was asked for.
        min_feasible_bytes: the smallest budget for which a plan exists (None when unknown).
    """

    def __init__(self, message: str, *, budget_bytes: int | None = None,
                 min_feasible_bytes: int | None = None) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes


class CaptureError(EdgetrainError, ValueError):
    """The model could not be cut into a chain of stages or run on the example batch."""


class ProfileError(EdgetrainError, RuntimeError):
    """Measuring the model's costs on this machine failed."""


class InputError(EdgetrainError, ValueError):
    """A batch handed to a step does not match what the step was prepared for."""


class ConfigError(EdgetrainError, ValueError):
    """A configuration (Trainer options, a CLI config file, a model or data spec) is invalid or incomplete."""
