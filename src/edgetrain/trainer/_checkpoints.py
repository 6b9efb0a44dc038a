"""The Trainer's checkpoint directory: numbered atomic checkpoints, the last K kept, the newest good one loaded.

Each file ``step-000000042.pt`` holds everything a resumed run needs to continue bit for bit: model,
optimizer and scheduler state, the step / epoch / batch-in-epoch position, every RNG state, the plan in
force and the Trainer's own state (early stopping, history). Files are written with
:func:`edgetrain.checkpoint.atomic_save` (temp file, fsync, rename) and read with ``weights_only=True``.
A file that is unreadable, foreign or written for another model is reported (logged as an error) and the
next older one is tried.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import CheckpointError, atomic_save, read_payload

__all__ = ["TrainerState", "CheckpointDir", "TRAINER_FORMAT"]

log = logging.getLogger(__name__)

TRAINER_FORMAT = "edgetrain-trainer-checkpoint-1"
_NAME = re.compile(r"^step-(\d{9})\.pt$")


@dataclass
class TrainerState:
    """Where training is: ``epoch`` (0-based, the epoch in progress), batches of it done, steps done."""

    epoch: int = 0
    batch_in_epoch: int = 0
    global_step: int = 0


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


class CheckpointDir:
    """Writes, prunes and loads the checkpoints of one training run in ``directory``."""

    def __init__(self, directory: str | Path, keep: int) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def files(self) -> list[Path]:
        """Checkpoint files, newest (highest step) first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found, reverse=True)]

    def save(self, state: TrainerState, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             rng: dict[str, Any], plan_json: str, trainer_json: str) -> Path:
        """Write one checkpoint atomically and delete all but the newest ``keep``."""
        payload = {"format": TRAINER_FORMAT, "epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch,
                   "global_step": state.global_step, "model_class": type(model).__name__,
                   "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                   "scheduler": scheduler.state_dict() if scheduler is not None else None,
                   "rng": rng, "plan": plan_json, "trainer": trainer_json}
        path = atomic_save(payload, self.directory / f"step-{state.global_step:09d}.pt")
        for old in self.files()[self.keep:]:
            old.unlink(missing_ok=True)
        log.debug("checkpoint %s written", path)
        return path

    def _check(self, path: Path, payload: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: Any) -> None:
        if not isinstance(payload, dict) or payload.get("format") != TRAINER_FORMAT:
            raise CheckpointError(f"{path} is not an edgetrain Trainer checkpoint")
        theirs = {k: tuple(v.shape) for k, v in payload["model"].items()}
        ours = _shapes(model)
        if theirs != ours:
            diff = sorted(set(theirs) ^ set(ours)) or [k for k in ours if ours[k] != theirs[k]]
            raise CheckpointError(f"checkpoint {path} was written for a different model "
                                  f"({payload.get('model_class')}; state_dict keys or shapes differ, e.g. "
                                  f"{diff[0]!r}); resume with the model it was written for")
        groups = payload["optimizer"].get("param_groups", [])
        own = optimizer.state_dict()["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in own]:
            raise CheckpointError(f"checkpoint {path} was written for a different optimizer (parameter groups "
                                  "differ)")
        if (payload["scheduler"] is None) != (scheduler is None):
            raise CheckpointError(f"checkpoint {path} was written {'with' if scheduler is None else 'without'} "
                                  "an LR scheduler; resume with the same setup")

    def load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any) -> dict[str, Any] | None:
        """Restore the newest usable checkpoint into model, optimizer and scheduler; return its payload.

        Stale temporary files of interrupted writes are deleted. Returns None when there is no checkpoint.

        Raises:
            CheckpointError: checkpoints exist but none is usable (each one's reason is logged).
        """
        for tmp in self.directory.glob(".step-*.pt.tmp*") if self.directory.is_dir() else ():
            log.info("removing %s, left by a checkpoint write that was interrupted", tmp.name)
            tmp.unlink(missing_ok=True)
        files = self.files()
        errors = []
        for path in files:
            try:
                payload = read_payload(path)
                self._check(path, payload, model, optimizer, scheduler)
                model.load_state_dict(payload["model"])
                optimizer.load_state_dict(payload["optimizer"])
                if scheduler is not None:
                    scheduler.load_state_dict(payload["scheduler"])
            except CheckpointError as e:
                log.error("%s; falling back to the previous checkpoint", e)
                errors.append(str(e))
                continue
            if errors:
                log.warning("resumed from %s after %d unusable newer checkpoint(s)", path.name, len(errors))
            return payload
        if files:
            raise CheckpointError(f"none of the {len(files)} checkpoints in {self.directory} is usable: "
                                  + "; ".join(errors))
        return None
