"""Atomic training checkpoints: a crash never leaves a half-written file, and training resumes where it was.

A checkpoint holds the model and optimizer state dicts, the step counter, the RNG states and any extra
JSON-able data. It is written to a temporary file in the same directory, flushed and fsync'ed, then
renamed over the old one (``os.replace`` is atomic on POSIX), and the directory is fsync'ed so the rename
survives power loss. A full disk raises :class:`CheckpointError` and leaves the previous checkpoint intact.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._state import rng_state, set_rng_state
from .errors import EdgetrainError

__all__ = ["CheckpointError", "Checkpoint", "save_checkpoint", "load_checkpoint", "atomic_save", "read_payload"]

_FORMAT = "edgetrain-checkpoint-1"


class CheckpointError(EdgetrainError, OSError):
    """A checkpoint could not be written or read."""


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` restored."""

    step: int
    extra: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    step: int, extra: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint atomically.

    Raises:
        CheckpointError: the disk is full or the directory is not writable (the old checkpoint is kept).
    """
    payload = {"format": _FORMAT, "step": int(step), "model": model.state_dict(),
               "optimizer": optimizer.state_dict() if optimizer is not None else None,
               "rng": rng_state(), "extra": dict(extra or {})}
    return atomic_save(payload, path)


def atomic_save(payload: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` ``payload`` to ``path`` atomically: temp file, flush, fsync, rename, fsync the directory.

    Raises:
        CheckpointError: the disk is full or the directory is not writable (the old file is kept).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        hint = "free disk space or choose another directory" if e.errno == errno.ENOSPC else \
            "check that the directory exists and is writable"
        raise CheckpointError(f"could not write checkpoint {path}: {e.strerror or e}; {hint}. "
                              "The previous checkpoint, if any, is unchanged.") from e
    return path


def read_payload(path: str | os.PathLike[str]) -> Any:
    """``torch.load`` a checkpoint file with ``weights_only=True`` (no code in the file is run).

    Raises:
        CheckpointError: the file is missing, truncated or corrupt, or holds objects other than tensors and
            plain containers.
    """
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"no checkpoint at {path}") from e
    except Exception as e:  # truncated or corrupt files raise many different errors inside torch
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {first[:200]}); it is "
                              "corrupt, truncated or not a checkpoint: delete it to start afresh") from e


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *, restore_rng: bool = True) -> Checkpoint:
    """Restore model, optimizer and RNG from a checkpoint written by :func:`save_checkpoint`.

    Raises:
        CheckpointError: the file is missing, truncated, corrupt, or not an edgetrain checkpoint, or it
            does not match the model (the model is left unchanged in every case).
    """
    path = Path(path)
    payload = read_payload(path)
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise CheckpointError(f"{path} is not an edgetrain checkpoint")
    own = model.state_dict()
    theirs = payload["model"]
    if own.keys() != theirs.keys() or any(own[k].shape != theirs[k].shape for k in own):
        raise CheckpointError(f"checkpoint {path} was written for a different model (state_dict keys or "
                              "shapes differ); use the model it was written for")
    model.load_state_dict(theirs)
    if optimizer is not None and payload.get("optimizer") is not None:
        optimizer.load_state_dict(payload["optimizer"])
    if restore_rng and payload.get("rng"):
        set_rng_state(payload["rng"])
    return Checkpoint(step=int(payload["step"]), extra=dict(payload.get("extra", {})))
