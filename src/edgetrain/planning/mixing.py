"""Whether a model's forward mixes samples across the batch, so that micro-batches could not reproduce it.

Micro-batches each see part of the batch; a forward whose output for a sample depends on the other samples
(mixup or CutMix inside the model, attention across the batch, a statistic over the batch such as BatchNorm
without running statistics, a branch on a batch-wide ``.item()``) computes something else on each part.
:func:`mixes_in_training` compares the first half's output rows, in training mode from the same random
state, with the second half of the samples replaced; :func:`mixes_in_eval` compares, in eval mode, the rows
of either side of a cut run with and without the other side. Each says how an output moved, or ``""``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .._state import (
    host_rng_moved, host_rng_state, modes_kept, module_generators, preserved_model_state, rng_state,
)
from ..batch import tensors_in

__all__ = ["mixes_in_training", "mixes_in_eval", "moved_rows", "take", "modes_kept"]

log = logging.getLogger("edgetrain.planning.loss")


def take(x: Any, idx: torch.Tensor) -> Any:
    """Samples ``idx`` (dim 0) of every tensor in ``x``; other values pass through."""
    if isinstance(x, torch.Tensor):
        return x.index_select(0, idx.to(x.device))
    if isinstance(x, dict):
        return {k: take(v, idx) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(take(v, idx) for v in x)
    return x


def mixes_in_training(model: nn.Module, env: dict[str, Any], idx: torch.Tensor, rtol: float = 1e-4) -> str:
    """How the first half of samples ``idx`` get other output rows in training mode once the second half is
    replaced by other samples of the batch, or ``""`` when they do not (or the check cannot tell).

    Both forwards start from the same generator states (torch's, NumPy's, Python's, the modules' own), so
    dropout and other draws are the same in each; BatchNorm layers run on their running statistics. A
    forward whose number of draws depends on the samples (the generators end elsewhere after the two runs:
    ``nn.RReLU`` draws a slope per negative input) cannot be told apart from one that mixes, and is let
    through (the eval-mode checks stand). Output
    tensors whose dim 0 is not the samples (a loss the model computes itself) are not compared. A training-
    mode forward that fails, or a model not in training mode, skips the check (the eval-mode checks stand).
    """
    n = len(idx)
    if n < 2 or not model.training:
        return ""
    half = n // 2
    other = idx.clone()
    other[half:] = idx[[(j + 1) % n for j in range(half, n)]]  # every replaced row gets another sample
    try:
        with modes_kept(model):
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                    m.eval()

            def rows(sel: torch.Tensor) -> tuple[list[torch.Tensor], list[Any]]:
                with preserved_model_state(model), torch.no_grad():
                    out = model(**{k: take(v, sel) for k, v in env.items()})
                    drawn = [rng_state()["cpu"], *(g.get_state() for g in module_generators(model))]
                    host = host_rng_state()
                return [t[:half] for t in tensors_in(out) if t.dim() > 0 and t.shape[0] == n], [drawn, host]

            (first, after_first), (second, after_second) = rows(idx), rows(other)
    except Exception as e:
        log.info("training-mode check that samples do not mix skipped: %s: %s", type(e).__name__, e)
        return ""
    if any(not torch.equal(a, b) for a, b in zip(after_first[0], after_second[0])) \
            or host_rng_moved(after_first[1], after_second[1]):
        # how many numbers the forward drew depends on the samples (nn.RReLU draws for negative inputs only),
        # so the first half's draws may differ between the two runs: the comparison cannot tell mixing apart
        log.info("training-mode check that samples do not mix skipped: the forward's random draws depend on the "
                 "samples' values")
        return ""
    moved = moved_rows(first, second, rtol)
    if not moved:
        return ""
    log.info("training-mode %s of the first %d samples when the other %d were replaced: the forward mixes "
             "samples", moved, half, n - half)
    return f"in training mode, {moved} for the first {half} samples when the other {n - half} were replaced"


def moved_rows(first: list[torch.Tensor], second: list[torch.Tensor], rtol: float) -> str:
    """How the first output that differs between ``first`` and ``second`` (the same samples' rows from two
    forwards) moved, or ``""`` when none did beyond ``rtol`` (or 16 epsilon of its dtype)."""
    for k, (a, b) in enumerate(zip(first, second)):
        if not (a.is_floating_point() or a.is_complex()):
            if not torch.equal(a, b):
                return f"output {k} changed"
            continue
        scale = max(float(a.abs().max()) if a.numel() else 0.0, float(b.abs().max()) if b.numel() else 0.0)
        rel = float((a.double() - b.double()).abs().max()) / scale if scale > 0 else 0.0
        if rel > max(rtol, 16 * torch.finfo(a.dtype).eps):
            return f"output {k} moved by {rel:.2g} relative"
    return ""


def mixes_in_eval(model: nn.Module, env: dict[str, Any], idx: torch.Tensor, cuts: list[int],
                  rtol: float = 1e-4) -> str:
    """How the model's eval-mode output rows for either side of a cut of samples ``idx`` change once the other
    side is left out (a statistic over the batch such as BatchNorm without running statistics, a branch on a
    batch-wide ``.item()``), or ``""`` when they do not, or the forward fails."""
    def rows(sel: torch.Tensor) -> list[torch.Tensor]:
        with preserved_model_state(model), torch.no_grad():
            torch.manual_seed(torch.initial_seed() % 2**63)
            out = model(**{k: take(v, sel) for k, v in env.items()})
        return [t for t in tensors_in(out) if t.dim() > 0 and t.shape[0] == len(sel)]

    n, moved = len(idx), ""
    try:
        with modes_kept(model):
            model.eval()
            whole = rows(idx)
            for c in cuts:
                for lo, hi in ((0, c), (c, n)):
                    part = rows(idx[lo:hi])
                    if len(part) == len(whole):
                        moved = moved_rows([t[lo:hi] for t in whole], part, rtol)
                    if moved:
                        break
                if moved:
                    break
    except Exception as e:
        log.info("eval-mode check that samples do not mix skipped: %s: %s", type(e).__name__, e)
        return ""
    if not moved:
        return ""
    log.info("eval-mode %s for %d of %d samples when run without the others: the forward mixes samples",
             moved, hi - lo, n)
    return f"in eval mode, {moved} for {hi - lo} of {n} samples when they ran without the others"
