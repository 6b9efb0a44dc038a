"""`TrainerConfig`: the typed options of :class:`edgetrain.Trainer` (checkpoints, clipping, stopping, logging)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import ConfigError

__all__ = ["TrainerConfig"]


@dataclass(frozen=True)
class TrainerConfig:
    """Options of a :class:`~edgetrain.trainer.Trainer`.

    Attributes:
        checkpoint_dir: directory of the crash-safe checkpoints (None: no checkpoints, no resume).
        checkpoint_every_steps: also write a checkpoint every this many optimizer steps (0: only at the
            end of each epoch).
        keep_checkpoints: how many of the newest checkpoints to keep (older ones are deleted).
        grad_clip_norm: clip the global gradient norm to this before each optimizer step (None: no clipping).
        grad_clip_value: clip every gradient element to [-v, v] before each optimizer step (None: no clipping).
        scheduler_interval: step the LR scheduler after every optimizer ``"step"`` or every ``"epoch"``
            (``ReduceLROnPlateau`` always steps at epoch ends, on the monitored value).
        early_stopping_patience: stop after this many evaluations without improvement of ``monitor``
            (None: never stop early).
        monitor: the value early stopping and ``ReduceLROnPlateau`` watch, e.g. ``"val_loss"``,
            ``"val_accuracy"`` or ``"train_loss"``.
        monitor_mode: ``"min"`` or ``"max"``: whether a smaller or a larger ``monitor`` is better.
        min_delta: the least change of ``monitor`` that counts as an improvement.
        eval_every_epochs: evaluate on the validation data every this many epochs (and after the last).
        seed: seed of the per-epoch shuffling (a DataLoader's ``RandomSampler`` is reseeded at each epoch
            from it, so a resumed run sees the same order).
        progress: show a tqdm progress bar; None: only when stderr is a terminal and ``CI`` is not set.
        log_dir: write ``steps.csv`` and ``epochs.csv`` here (None: no CSV log).
        tensorboard: also write TensorBoard event files to ``log_dir`` (needs the ``tensorboard`` extra).
    """

    checkpoint_dir: str | None = None
    checkpoint_every_steps: int = 0
    keep_checkpoints: int = 3
    grad_clip_norm: float | None = None
    grad_clip_value: float | None = None
    scheduler_interval: str = "epoch"
    early_stopping_patience: int | None = None
    monitor: str = "val_loss"
    monitor_mode: str = "min"
    min_delta: float = 0.0
    eval_every_epochs: int = 1
    seed: int = 0
    progress: bool | None = None
    log_dir: str | None = None
    tensorboard: bool = False

    def __post_init__(self) -> None:
        if self.checkpoint_every_steps < 0:
            raise ConfigError(f"checkpoint_every_steps must be >= 0, got {self.checkpoint_every_steps}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        for name in ("grad_clip_norm", "grad_clip_value"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ConfigError(f"{name} must be > 0 or None, got {v}")
        if self.scheduler_interval not in ("step", "epoch"):
            raise ConfigError(f"scheduler_interval must be 'step' or 'epoch', got {self.scheduler_interval!r}")
        if self.monitor_mode not in ("min", "max"):
            raise ConfigError(f"monitor_mode must be 'min' or 'max', got {self.monitor_mode!r}")
        if self.early_stopping_patience is not None and self.early_stopping_patience < 1:
            raise ConfigError(f"early_stopping_patience must be >= 1 or None, got {self.early_stopping_patience}")
        if self.eval_every_epochs < 1:
            raise ConfigError(f"eval_every_epochs must be >= 1, got {self.eval_every_epochs}")
        if self.tensorboard and self.log_dir is None:
            raise ConfigError("tensorboard=True needs a log_dir to write the event files to")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return tuple(f.name for f in fields(cls))
