"""Dropout masks of a split batch, drawn as one forward over the whole batch draws them.

A step that splits its batch runs the forward once per micro-batch. Left alone, each micro-batch's dropout
draws its own mask, as gradient accumulation does, and the step is not one full-batch step bit for bit. Here,
in a split step of a traced model, every dropout call of the graph (a *site*, numbered by the capture's
rewrite, :func:`.lean_passes.dropout_sites`) draws at the first micro-batch the mask of the
whole batch with the call PyTorch's dropout makes (``bernoulli_(1 - p)`` on a tensor of the whole batch's
shape), so the generator moves as it moves in one forward over the batch. The mask is kept at one bit per
element; each micro-batch, and each replay of a recomputed stage, takes the rows of its samples and computes
``x * noise`` and its gradient ``g * noise`` with the noise torch makes (the mask divided by ``1 - p``).

Which rows of a site's tensor belong to which sample is checked, not assumed (:func:`probe`): in a forked
child, on the first samples of the example (BatchNorm layers on their running statistics), the forward over
them and the forward over micro-batches of them with these draws must give the same outputs and leave the
generator in the same state. A forward with another random op (noise, a feature dropout, attention's own
dropout), a site whose batch is not its first dimension, or outputs not batched on their first dimension fail
the check, and the step draws per micro-batch as before, its plan saying so. So does a split step whose
BatchNorm layers normalise each micro-batch on its own: gradient accumulation, whose masks it keeps.

What it costs: one bit per element of each site's whole-batch tensor, held through the step, and at the first
micro-batch, where lean dropout's kernel does not draw the bits, the whole-batch byte mask and the int32 draw
of MKL's Bernoulli (five bytes per element) for a moment. A plan draws this way only
where both fit its budget beside its predicted peak. Applying a slice is lean dropout's one-pass product where
the slice starts on a whole byte (NumPy unpacks the bits otherwise).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import settings
from ..batch import batch_size_of, slice_batch
from .lean_dropout import available as lean_available, draw_bits, lean_dropout, times_bits
from ..graph import run_micro_batch_sizes

__all__ = ["dropout_site", "dropout_module_site", "Sites", "BatchDraws", "drawing", "probe", "batch_draws",
           "EXACT_DRAWS_NOTE", "PROBE_SAMPLES"]

log = logging.getLogger(__name__)

#: The plan note of a split step whose dropout masks are the whole batch's.
EXACT_DRAWS_NOTE = ("dropout masks are drawn for the whole batch at its first micro-batch and sliced, so the split "
                    "step draws what one full-batch step draws")
#: Samples of the example the check runs on.
PROBE_SAMPLES = 4
# bytes per element of a whole-batch draw while it is made: the byte mask and MKL's int32 draw
_DRAW_BYTES = 5
_SEED = 20261208

_ACTIVE: Any = None  # the BatchDraws of the split step running now, or a _Recorder while checking


def dropout_site(x: torch.Tensor, p: float = 0.5, training: bool = True, site: int = -1) -> torch.Tensor:
    """``torch.dropout(x, p, training)`` (through :func:`~edgetrain.capture.lean_dropout.lean_dropout`), or, in
    a split step drawing the whole batch's masks, this micro-batch's rows of the whole batch's mask."""
    draws = _ACTIVE
    if draws is None or not training or not 0 < p < 1 or x.numel() == 0:
        return lean_dropout(x, p, training)
    return draws.dropout(x, float(p), site)


def dropout_module_site(x: torch.Tensor, module: nn.Module, site: int = -1) -> torch.Tensor:
    """An ``nn.Dropout`` module's call as :func:`dropout_site` (reads its ``p`` and ``training`` now)."""
    return dropout_site(x, module.p, module.training, site)


@dataclass(frozen=True)
class Sites:
    """What the check found: per dropout site, the rows of its tensor per sample (0: a tensor that does not
    grow with the batch, drawn once per step as one forward draws it) and the elements of a row (of the
    whole tensor for rows 0)."""

    rows: dict[int, int]
    elements: dict[int, int]

    def whole(self, site: int, n: int) -> int:
        """Elements of ``site``'s mask for a batch of ``n``."""
        rows = self.rows[site]
        return self.elements[site] * (rows * n if rows else 1)

    def extra_bytes(self, n: int) -> int:
        """Bytes the whole batch's masks add to a step of ``n`` samples: the bits of every site held through
        the step, and the largest draw while it is made (nothing where lean dropout's kernel draws the bits)."""
        sizes = [self.whole(s, n) for s in self.rows]
        drawing = 0 if lean_available() else _DRAW_BYTES * max(sizes, default=0)
        return sum(-(-s // 8) for s in sizes) + drawing


class _Mask:
    """One site's whole-batch mask at one bit per element (little-endian in each byte), drawn as
    ``torch.dropout`` draws its noise: by lean dropout's kernel where it runs (the same draws, straight into the
    bits), else by ``bernoulli_`` on a byte tensor of the whole shape."""

    __slots__ = ("bits", "p")

    def __init__(self, shape: tuple[int, ...], p: float) -> None:
        bits = draw_bits(math.prod(shape), p)
        if bits is None:
            drawn = torch.empty(shape, dtype=torch.uint8).bernoulli_(1 - p)
            bits = torch.from_numpy(np.packbits(drawn.numpy().reshape(-1), bitorder="little"))
        self.bits = bits
        self.p = p

    def times(self, first: int, x: torch.Tensor) -> torch.Tensor:
        """``x * noise`` for the noise of elements ``first ..`` (as many as ``x`` has, in its shape): the mask
        divided by ``1 - p`` as torch divides it, multiplied as torch multiplies."""
        if first % 8 == 0:
            y = times_bits(x, self.bits[first // 8:], self.p)
            if y is not None:
                return y
        count = x.numel()
        byte = first // 8
        bits = np.unpackbits(self.bits[byte:(first + count + 7) // 8].numpy(), bitorder="little")
        cut = bits[first - 8 * byte:first - 8 * byte + count]
        return x * torch.from_numpy(cut).view(x.shape).to(x.dtype).div_(1 - self.p)


class _Masked(torch.autograd.Function):
    """``x * noise`` with autograd's ``g * noise`` backward; the noise comes from the bits, nothing is saved."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: _Mask, first: int) -> torch.Tensor:  # type: ignore[override]
        ctx.mask, ctx.first = mask, first
        return mask.times(first, x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return ctx.mask.times(ctx.first, g.contiguous()), None, None


class BatchDraws:
    """The dropout masks of one split step of ``n`` samples (see the module docstring)."""

    def __init__(self, sites: Sites, n: int) -> None:
        self.sites = sites
        self.n = n
        self.start, self.size = 0, n
        self._masks: dict[int, _Mask] = {}

    def micro_batch(self, start: int, size: int) -> None:
        """The samples ``start .. start + size`` run next."""
        self.start, self.size = start, size

    def dropout(self, x: torch.Tensor, p: float, site: int) -> torch.Tensor:
        rows = self.sites.rows.get(site)
        if rows is None or x.device.type != "cpu" or (rows and (x.dim() == 0 or x.shape[0] != rows * self.size)):
            raise RuntimeError(f"edgetrain: a dropout of the split step (site {site}) ran on a {x.device.type} tensor "
                               f"of shape {tuple(x.shape)}, not the one its check at prepare saw, so the whole "
                               "batch's mask cannot be drawn for it; prepare the step again")
        shape = (rows * self.n, *x.shape[1:]) if rows else tuple(x.shape)
        mask = self._masks.get(site)
        if mask is None:
            if self.start:
                raise RuntimeError(f"edgetrain: dropout site {site} did not run in the first micro-batch, where the "
                                   "whole batch's masks are drawn; prepare the step again")
            mask = self._masks[site] = _Mask(shape, p)
        first = rows * self.start * (x.numel() // x.shape[0]) if rows else 0
        return _Masked.apply(x, mask, first)


class _Recorder:
    """Records the shape of each site's tensor in one forward; dropout as written."""

    def __init__(self) -> None:
        self.seen: dict[int, list[tuple[tuple[int, ...], bool]]] = {}

    def dropout(self, x: torch.Tensor, p: float, site: int) -> torch.Tensor:
        self.seen.setdefault(site, []).append((tuple(x.shape), x.is_contiguous() and x.device.type == "cpu"))
        return lean_dropout(x, p, True)


class _AsWritten:
    """Dropout as written: nothing to slice."""

    def micro_batch(self, start: int, size: int) -> None:
        pass


@contextlib.contextmanager
def drawing(draws: BatchDraws | None) -> Iterator[Any]:
    """Dropout sites draw through ``draws`` inside the block (None: as written); yields what to tell of each
    micro-batch (``micro_batch(start, size)``)."""
    global _ACTIVE
    if draws is None:
        yield _AsWritten()
        return
    _ACTIVE = draws
    try:
        yield draws
    finally:
        _ACTIVE = None


def probe(chain: Any, env: dict[str, Any]) -> Sites | str:
    """The sites of ``chain`` if drawing the whole batch's masks makes a split forward one full-batch forward,
    else why not (checked once per chain, in a forked child, on the first samples of ``env``)."""
    found = getattr(chain, "draw_sites", None)
    if found is None:
        from ..forking import answer_in_fork

        found = answer_in_fork(lambda: _probe(chain, env))
        if found is None:
            found = "it could not be checked here (no forked process)"
        chain.draw_sites = found
        if isinstance(found, str):
            log.info("dropout draws per micro-batch in a split step: %s", found)
    return found


def _probe(chain: Any, env: dict[str, Any]) -> Sites | str:
    try:
        return _check(chain, env)
    except Exception as e:  # noqa: BLE001 - any failure: draw per micro-batch, and say why
        return f"its check raised {type(e).__name__}: {e}"


def _check(chain: Any, env: dict[str, Any]) -> Sites | str:
    global _ACTIVE
    n = min(batch_size_of(env), PROBE_SAMPLES)
    if n < 2:
        return "the example has one sample"
    m = n // 2
    part = {k: slice_batch(v, 0, n) for k, v in env.items()}
    for mod in chain.model.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            mod.eval()  # per-sample maths, so that outputs can be compared; the child is thrown away
    with torch.no_grad():
        try:
            torch.manual_seed(_SEED)
            _ACTIVE = whole = _Recorder()
            full = chain.run(dict(part))
            after = torch.get_rng_state()
            _ACTIVE = first = _Recorder()
            chain.run({k: slice_batch(v, 0, m) for k, v in part.items()})
            sites = _sites(whole.seen, first.seen, n, m)
            if isinstance(sites, str):
                return sites
            torch.manual_seed(_SEED)
            _ACTIVE = draws = BatchDraws(sites, n)
            outs, start = [], 0
            for size in run_micro_batch_sizes(n, m):
                draws.micro_batch(start, size)
                outs.append(chain.run({k: slice_batch(v, start, start + size) for k, v in part.items()}))
                start += size
        finally:
            _ACTIVE = None
    if not torch.equal(after, torch.get_rng_state()):
        return "the forward draws random numbers other than its dropout calls' (noise, a feature dropout)"
    why = _differ(full, outs)
    return why if why else sites


def _sites(whole: dict[int, list[Any]], first: dict[int, list[Any]], n: int, m: int) -> Sites | str:
    if set(whole) != set(first):
        return "its dropout calls differ between batch sizes"
    rows: dict[int, int] = {}
    elements: dict[int, int] = {}
    for site, calls in whole.items():
        if len(calls) != 1 or len(first[site]) != 1:
            return f"a dropout call runs {len(calls)} times in one forward"
        (full, ok_full), (part, ok_part) = calls[0], first[site][0]
        if not (ok_full and ok_part):
            return "a dropout's input is not a contiguous CPU tensor"
        if full == part:
            rows[site], elements[site] = 0, math.prod(full)
        elif full[1:] == part[1:] and full and full[0] % n == 0 and full[0] // n * m == part[0]:
            rows[site], elements[site] = full[0] // n, math.prod(full[1:])
        else:
            return f"a dropout's input is {full} for {n} samples and {part} for {m}: not batched on its first dimension"
    return Sites(rows, elements)


def _differ(full: Any, outs: list[Any]) -> str:
    """Why the micro-batches' outputs are not the whole batch's (rounding aside), or ``""``."""
    leaves, spec = pytree.tree_flatten(full)
    parts = [pytree.tree_flatten(o) for o in outs]
    if any(s != spec for _, s in parts):
        return "the model's outputs are structured differently for a part of the batch"
    for i, leaf in enumerate(leaves):
        pieces = [p[0][i] for p in parts]
        if not isinstance(leaf, torch.Tensor):
            if any(piece != leaf for piece in pieces):
                return "the model returns a value that depends on the batch"
            continue
        if leaf.dim() == 0 or any(not isinstance(t, torch.Tensor) or t.dim() == 0 for t in pieces):
            return "the model returns a value over the whole batch"
        joined = torch.cat(pieces)
        if joined.shape != leaf.shape:
            return "the model's outputs are not batched on their first dimension"
        if not leaf.is_floating_point():
            if not torch.equal(joined, leaf):
                return "the micro-batches' outputs differ from the whole batch's"
            continue
        scale = max(1.0, float(leaf.abs().max())) if leaf.numel() else 1.0
        if leaf.numel() and float((joined - leaf).abs().max()) > 1e-4 * scale:
            return "the micro-batches' outputs differ from the whole batch's (draws or maths depend on the split)"
    return ""


def batch_draws(chain: Any, example: dict[str, Any] | None, n: int, peak_bytes: int,
                room: int | None) -> BatchDraws | str:
    """The draws of a split step of ``n`` samples whose plan predicts ``peak_bytes`` under ``room`` bytes
    (None: no budget), or why it draws per micro-batch."""
    if not settings.whole_batch_draws_enabled():
        return "EDGETRAIN_WHOLE_BATCH_DRAWS=0"
    if example is None or chain is None or getattr(chain, "method", None) != "fx":
        return "the model does not run as a traced graph"
    sites = probe(chain, example)
    if isinstance(sites, str):
        return sites
    extra = sites.extra_bytes(n)
    if room is not None and peak_bytes + extra > room:
        return f"the whole batch's masks ({extra / 2**20:.1f} MiB) do not fit the budget beside the plan"
    return BatchDraws(sites, n)
