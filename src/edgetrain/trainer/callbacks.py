"""Trainer callbacks: the protocol (step / epoch / eval end), CSV and TensorBoard loggers, the progress bar."""

from __future__ import annotations

import csv
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Protocol, runtime_checkable

from ..errors import ConfigError

__all__ = ["Callback", "CallbackProtocol", "CSVLogger", "TensorBoardLogger", "progress_enabled", "progress_bar"]

log = logging.getLogger(__name__)


@runtime_checkable
class CallbackProtocol(Protocol):
    """What the Trainer calls; an object may define any subset of these methods."""

    def on_step_end(self, trainer: Any, logs: dict[str, float]) -> None: ...

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None: ...

    def on_eval_end(self, trainer: Any, metrics: dict[str, float]) -> None: ...


class Callback:
    """Base class with no-op hooks; subclass and override what you need.

    ``logs`` of ``on_step_end``: ``step`` (optimizer steps done), ``epoch``, ``loss`` (the step's mean loss)
    and ``lr``. ``on_epoch_end``: ``train_loss`` plus the evaluation's metrics. ``on_eval_end``:
    ``val_loss`` and ``val_<name>`` for each user metric. ``on_fit_start`` is told the step training
    resumes from (0 for a fresh run), ``on_fit_end`` when ``fit`` returns.
    """

    def on_fit_start(self, trainer: Any, resumed_step: int) -> None:
        """Training (re)starts at optimizer step ``resumed_step``."""

    def on_step_end(self, trainer: Any, logs: dict[str, float]) -> None:
        """An optimizer step is done."""

    def on_eval_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        """An evaluation is done."""

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        """Epoch ``epoch`` (0-based) is done (after its evaluation and checkpoint)."""

    def on_fit_end(self, trainer: Any) -> None:
        """``fit`` is returning."""


class CSVLogger(Callback):
    """Appends step rows to ``DIR/steps.csv`` and epoch rows to ``DIR/epochs.csv``.

    On resume, rows written after the checkpoint resumed from (steps that are trained again) are dropped,
    so each step appears once.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = Path(log_dir)
        self._fields: dict[str, list[str]] = {}

    def _path(self, kind: str) -> Path:
        return self.log_dir / f"{kind}.csv"

    def on_fit_start(self, trainer: Any, resumed_step: int) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for kind in ("steps", "epochs"):
            path = self._path(kind)
            if not path.exists():
                continue
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
                header = list(rows[0].keys()) if rows else []
            kept = [r for r in rows if int(float(r.get("step") or 0)) <= resumed_step]
            if len(kept) != len(rows):
                with open(path, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=header)
                    w.writeheader()
                    w.writerows(kept)
            if header:
                self._fields[kind] = header

    def _write(self, kind: str, row: dict[str, Any]) -> None:
        path = self._path(kind)
        fields = self._fields.get(kind)
        new = fields is None or not path.exists()
        if fields is None:
            fields = self._fields[kind] = list(row.keys())
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow(row)

    def on_step_end(self, trainer: Any, logs: dict[str, float]) -> None:
        self._write("steps", logs)

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        self._write("epochs", {"epoch": epoch, **logs})


class TensorBoardLogger(Callback):
    """Writes the step loss and learning rate and every epoch value as TensorBoard scalars to ``log_dir``.

    Raises:
        ConfigError: the ``tensorboard`` package is not installed (``pip install 'edgetrain[tensorboard]'``).
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as e:
            raise ConfigError("TensorBoard logging needs the tensorboard package: "
                              "pip install 'edgetrain[tensorboard]'") from e
        self.log_dir = str(log_dir)
        self._writer: Any = None

    def on_fit_start(self, trainer: Any, resumed_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events of steps after the checkpoint that will be trained again
        self._writer = SummaryWriter(self.log_dir, purge_step=resumed_step + 1 if resumed_step else None)

    def on_step_end(self, trainer: Any, logs: dict[str, float]) -> None:
        step = int(logs["step"])
        self._writer.add_scalar("train/loss", logs["loss"], step)
        self._writer.add_scalar("train/lr", logs["lr"], step)

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        for k, v in logs.items():
            if k != "step":
                self._writer.add_scalar(f"epoch/{k}", v, int(logs["step"]))
        self._writer.flush()

    def on_fit_end(self, trainer: Any) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def progress_enabled(setting: bool | None) -> bool:
    """Whether to draw a progress bar: ``setting`` if given, else only on a terminal outside CI."""
    if setting is not None:
        return setting
    return sys.stderr.isatty() and not os.environ.get("CI")


def progress_bar(iterable: Iterable[Any], total: int | None, desc: str, enabled: bool, initial: int = 0) -> Any:
    """A tqdm bar over ``iterable`` (or the iterable itself when disabled or tqdm is missing)."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        log.info("tqdm is not installed (pip install 'edgetrain[cli]'): no progress bar")
        return iterable
    return tqdm(iterable, total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, leave=False)
