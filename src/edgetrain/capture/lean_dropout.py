"""Lean dropout: PyTorch's CPU dropout, same masks and values bit for bit, in one pass and a one-bit mask.

On a CPU without MKL's Bernoulli (AMD, ARM, or any build without MKL), ``torch.dropout`` in training makes a
float noise tensor, fills it with ``bernoulli_(1 - p)`` one element at a time through the generic
distribution kernel (two MT19937 draws per element behind a lock and a tensor iterator), divides it by
``1 - p``, multiplies, and saves the float noise for backward. On a transformer step that is a third of the
time (``bench/RESULTS.md``) and four bytes per element of every dropout's input kept until backward.

:func:`lean_dropout` does the same draws in C (``_lean_dropout.c``): it reads torch's CPU generator state,
advances the same MT19937 the same way, turns each pair of draws into the same 53-bit uniform, compares it
with the same keep probability, writes ``x * noise`` with the noise value torch's own division makes, and
puts the advanced state back, so everything drawn afterwards is what plain PyTorch would draw. It keeps one
bit per element for backward (``g * noise``, the same multiplication as autograd's ``MulBackward0``).
Recomputation replays it like any random op: the checkpoint restores the generator state before the
replay, and the replay draws again.

**Exact, or not used.** At first use a self-check runs ``torch.dropout`` and this kernel from the same
generator states on tensors that cross the generator's 624-word refills, comparing outputs, gradients and
the generator state afterwards bit for bit (:func:`available`); any difference (an Intel CPU where torch
takes MKL's Bernoulli, another torch version) leaves dropout as written. So do non-float32, non-contiguous
or non-CPU inputs, and ``p`` of 0 or 1.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import settings
from ..forking import answer_in_fork
from ..native import NativeLibrary

__all__ = ["lean_dropout", "lean_dropout_module", "available", "DROPOUT_FUNCTIONS", "dropout_module_out_of_place",
           "draw_bits", "times_bits"]

log = logging.getLogger(__name__)

_I64, _PTR, _F32, _F64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_double
_NATIVE = NativeLibrary(Path(__file__).with_name("_lean_dropout.c"), "libedgetrain_lean_dropout",
                        "lean dropout's passes", {"et_dropout": [_PTR, _PTR, _PTR, _I64, _PTR, _F64, _F32],
                                                  "et_dropout_backward": [_PTR, _PTR, _PTR, _I64, _F32]},
                        "lean dropout is off; dropout runs as written")
_STATUS: str | None = None  # "ok", or why lean dropout is off


def _library() -> ctypes.CDLL | None:
    return _NATIVE.get()


@functools.lru_cache(maxsize=64)
def _scale(p: float) -> float:
    """The value a kept element's noise has in ``torch.dropout``: ``1`` divided by ``1 - p`` as torch divides."""
    return torch.ones(1).div_(1 - p).item()


def _draw(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``y = x * noise`` and the packed mask, advancing torch's CPU generator as ``torch.dropout`` does."""
    lib = _NATIVE.lib
    assert lib is not None
    state = torch.get_rng_state()  # a copy of the default CPU generator's state
    scale = _scale(p)
    y = torch.empty_like(x)
    bits = torch.empty(-(-x.numel() // 8), dtype=torch.uint8)
    if lib.et_dropout(x.data_ptr(), y.data_ptr(), bits.data_ptr(), x.numel(), state.data_ptr(), 1 - p, scale):
        raise RuntimeError("lean dropout: the CPU generator's state is not one torch makes (was it set by hand?); "
                           "set EDGETRAIN_LEAN_DROPOUT=0 to run dropout as written")
    torch.set_rng_state(state)
    return y, bits, scale


def draw_bits(count: int, p: float) -> torch.Tensor | None:
    """The keep-mask ``torch.dropout`` draws for ``count`` elements, one bit each (little-endian in each byte),
    the CPU generator advanced as that draw advances it; None where lean dropout does not run here. The kernel
    draws in chunks of 4,096 elements on its stack: nothing but the bits is allocated."""
    if not 0 < p < 1 or not available():
        return None
    lib = _NATIVE.lib
    assert lib is not None
    state = torch.get_rng_state()
    bits = torch.empty(-(-count // 8), dtype=torch.uint8)
    if lib.et_dropout(None, None, bits.data_ptr(), count, state.data_ptr(), 1 - p, _scale(p)):
        raise RuntimeError("lean dropout: the CPU generator's state is not one torch makes (was it set by hand?); "
                           "set EDGETRAIN_LEAN_DROPOUT=0 to run dropout as written")
    torch.set_rng_state(state)
    return bits


def times_bits(x: torch.Tensor, bits: torch.Tensor, p: float) -> torch.Tensor | None:
    """``x * noise`` for the noise of ``torch.dropout`` whose mask is the first ``x.numel()`` bits of ``bits``
    (the product autograd's ``MulBackward0`` makes of a gradient too), or None where the kernel does not apply
    (not a contiguous float32 CPU tensor, lean dropout off)."""
    if x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu" or not available():
        return None
    y = torch.empty_like(x)
    _NATIVE.lib.et_dropout_backward(x.data_ptr(), bits.data_ptr(), y.data_ptr(), x.numel(), _scale(p))
    return y


class _LeanDropoutFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):  # type: ignore[override]
        y, bits, scale = _draw(x, p)
        # the mask stays with the node (1/32 of the input): a recomputed stage's replay draws it again
        ctx.bits, ctx.scale = bits, scale
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.contiguous()
        gx = torch.empty_like(g)
        _NATIVE.lib.et_dropout_backward(g.data_ptr(), ctx.bits.data_ptr(), gx.data_ptr(), g.numel(), ctx.scale)
        return gx, None


def _reference_and_ours(x: torch.Tensor, p: float, g: torch.Tensor) -> bool:
    torch.manual_seed(int(x.numel() * 7919 + p * 1000))
    for _ in range(x.numel() % 5):  # start at different places in the generator's 624 words
        torch.rand(1)
    start = torch.get_rng_state()
    xr = x.clone().requires_grad_()
    yr = torch.dropout(xr, p, True)
    yr.backward(g)
    after = torch.get_rng_state()
    torch.set_rng_state(start)
    xo = x.clone().requires_grad_()
    yo = _LeanDropoutFn.apply(xo, p)
    yo.backward(g)
    return (torch.equal(yr, yo) and torch.equal(xr.grad, xo.grad)
            and torch.equal(after, torch.get_rng_state()))


def _check() -> str:
    """``"ok"`` when the kernel builds and draws and computes as ``torch.dropout`` does, else why not."""
    if _library() is None:
        return "its native passes cannot be built"
    gen = torch.Generator().manual_seed(20261203)
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        for n, p in ((1, 0.1), (7, 0.5), (8, 0.25), (9, 0.1), (1000, 0.37), (5000, 0.1), (3001, 0.9)):
            x = torch.randn(n, generator=gen) * 3
            x[0] = -0.0
            if not _reference_and_ours(x, p, torch.randn(n, generator=gen)):
                return (f"its draws differ from torch {torch.__version__}'s dropout on this CPU "
                        "(torch may use MKL's Bernoulli here)")
    return "ok"


def available() -> bool:
    """Whether lean dropout runs here: its kernel built and bit-exact against ``torch.dropout`` (checked once)."""
    global _STATUS
    if not settings.lean_dropout_enabled() or not settings.native_enabled():
        return False
    if _STATUS is None:
        # in a forked child where one runs as this process would: the check's torch code and heap stayed
        # resident here (2 MiB), in every step and every budget's fixed bytes
        status = answer_in_fork(_check)
        if status == "ok" and _library() is None:  # built by the child: loaded here from the cache
            status = "its native passes cannot be built"
        _STATUS = status or _check()
        if _STATUS != "ok":
            log.info("lean dropout is off: %s; dropout runs as written", _STATUS)
    return _STATUS == "ok"


def lean_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True) -> torch.Tensor:
    """``torch.dropout(x, p, training)``, the same values and generator stream, faster and with a 1-bit mask.

    Args:
        x: the input.
        p: the probability of zeroing an element.
        training: dropout applies only in training; otherwise ``x`` comes back as is.

    Returns:
        What ``torch.dropout`` returns; its gradient is autograd's, bit for bit.
    """
    if not training or p == 0 or x.numel() == 0:
        return torch.dropout(x, p, training)
    if (0 < p < 1 and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
            and not torch.is_inference_mode_enabled() and available()):
        if x.requires_grad and torch.is_grad_enabled():
            return _LeanDropoutFn.apply(x, float(p))
        return _draw(x, float(p))[0]
    return torch.dropout(x, p, training)


def lean_dropout_module(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """An ``nn.Dropout`` module's call through :func:`lean_dropout` (reads its ``p`` and ``training`` now)."""
    return lean_dropout(x, module.p, module.training)


# Dropout modules and their out-of-place functional forms (same mask draw from the same generator).
DROPOUT_FUNCTIONS: dict[type[nn.Module], Callable[..., torch.Tensor]] = {
    nn.Dropout: F.dropout, nn.Dropout1d: F.dropout1d, nn.Dropout2d: F.dropout2d, nn.Dropout3d: F.dropout3d,
    nn.AlphaDropout: F.alpha_dropout, nn.FeatureAlphaDropout: F.feature_alpha_dropout,
}


def dropout_module_out_of_place(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """An in-place dropout module's call made out-of-place (reads its ``p`` and ``training`` now)."""
    return DROPOUT_FUNCTIONS[type(module)](x, module.p, module.training, False)
