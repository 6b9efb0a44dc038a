"""The Trainer: a fit loop with evaluation, schedules, clipping, callbacks and crash-safe resume over ``prepare``."""

from __future__ import annotations

from .data import shuffle_seed
from .callbacks import Callback, CallbackProtocol, CSVLogger, TensorBoardLogger
from .config import TrainerConfig
from .trainer import Trainer

__all__ = ["Trainer", "TrainerConfig", "Callback", "CallbackProtocol", "CSVLogger", "TensorBoardLogger",
           "shuffle_seed"]
