"""Lean BatchNorm: a training-mode BatchNorm (and the ReLU / ReLU6 after it) whose backward holds two tensors, not four.

Autograd runs ``conv -> BatchNorm -> ReLU6 -> conv`` backward as separate nodes. On the largest layer of a
step that sets the peak: while ReLU6's backward runs, the BatchNorm input ``x`` (saved by BatchNorm), the
activation's output ``y`` (saved by the activation and the next convolution), the incoming gradient ``g_y``
and the gradient it makes ``g_z`` are alive at once; then BatchNorm's backward holds ``x``, ``g_z`` and the
``g_x`` it makes. Four and then three tensors of the layer's size, where the maths needs two.

:func:`lean_batch_norm` runs the BatchNorm module itself (its own forward: running statistics, momentum,
``num_batches_tracked`` and forward hooks behave as written) and the activation inside one autograd
function that saves ``x`` and the activation's gradient mask packed to one bit per element. Its backward
is the BatchNorm backward formula of PyTorch's CPU kernel, fed the masked gradient on the fly:

    sum  = sum(g),  dotp = sum((x - mean) * g)          (per channel, over batch and space; float64)
    g_x  = (g - sum / N - (x - mean) * dotp * invstd^2 / N) * invstd * weight
    g_weight = dotp * invstd,  g_bias = sum

in one native call, channel by channel (``_lean_bn.c``; a PyTorch formulation over slices of the batch
where it cannot run), with no temporary of the layer's size. When
the graph shows that nothing but this BatchNorm holds ``x`` (a convolution or linear layer made it and
this is its one reader: ``owned``), ``g_x`` is written over ``x`` in place: the backward then holds ``x``
and ``g_y`` and nothing of their size more. The mean and inverse standard deviation are the ones the
kernel computed in forward (read from its ``native_batch_norm`` call), so the values equal PyTorch's up to
float rounding in the sums' order, as for the lean convolution.

The activation runs in place on the BatchNorm's own output (out of place where a selective checkpoint or
the profiler keeps that output). ``x`` is saved by a small call ahead of the BatchNorm, the mask and the
statistics stay with the BatchNorm's node: a recomputed stage that ends here stops its replay once ``x``
is back, without making the layer's output again.

An eval-mode layer (frozen statistics) takes the same path with the running statistics as constants.
Anything else (a dtype other than float32/float64, a non-contiguous input, no gradient wanted) runs the
module and activation as written.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import TorchDispatchMode

from .. import settings
from ..native import load_c_library
from .composite import frames

__all__ = ["lean_batch_norm", "SLICE_BYTES"]

log = logging.getLogger(__name__)

#: Bytes of ``x`` one slice of the PyTorch formulation's two passes covers (temporaries stay in cache).
SLICE_BYTES = 1 << 20

_BN_OPS = frozenset({torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default,
                     torch.ops.aten._batch_norm_with_update.default})
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_ACT_CODE = {"relu": 1, "hardtanh": 2}

_SOURCE = Path(__file__).with_name("_lean_bn.c")
_LIB: ctypes.CDLL | None = None
_FAILED: str | None = None


def _native(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The compiled passes (``_lean_bn.c``) when they can run on these tensors (float32, CPU), else None.

    Compiled on first use like gradient filtering's kernels; ``EDGETRAIN_NATIVE=0`` or no C compiler
    leaves the PyTorch formulation below, which computes the same values more slowly."""
    global _LIB, _FAILED
    if not settings.native_enabled() or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    if _LIB is None and _FAILED is None:
        lib, _FAILED = load_c_library(_SOURCE, "libedgetrain_lean_bn", "lean BatchNorm's passes")
        if lib is None:
            _FAILED = _FAILED or "unknown"
            log.warning("lean BatchNorm's native passes are unavailable (%s); using the PyTorch formulation, "
                        "which gives the same gradients more slowly", _FAILED[-300:])
            return None
        i64, ptr, f32, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        lib.et_bn_act.argtypes = [ptr, ptr, ptr, i64, cint, f32, f32, cint]
        lib.et_bn_backward.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, cint, ptr, ptr, ptr, cint]
        for f in (lib.et_bn_act, lib.et_bn_backward):
            f.restype = cint
        _LIB = lib
    return _LIB


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _Statistics(TorchDispatchMode):
    """Reads the batch mean and inverse standard deviation a BatchNorm forward's kernel returns."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: tuple[torch.Tensor, torch.Tensor] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _BN_OPS:
            self.stats = (out[1], out[2])
        return out


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as one bit per element (uint8, little-endian within each byte, zero-padded)."""
    flat = mask.reshape(-1)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8).view(torch.uint8) * _BITS).sum(1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` of the bool tensor :func:`_pack` packed."""
    first, last = start // 8, -(-stop // 8)
    bits = packed[first:last].unsqueeze(1).bitwise_and(_BITS).ne_(0).reshape(-1)
    return bits[start - first * 8: stop - first * 8]


def _activation(z: torch.Tensor, act: str, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The activation's output and its packed gradient mask (None: no activation, every element passes)."""
    if act == "none":
        return z, None
    # z is this call's own tensor unless a selective checkpoint (or the profiler) keeps the BatchNorm's
    # output: then the activation must not overwrite it
    own = not frames()
    lib = _native(z) if z.is_contiguous() else None
    if lib is not None:
        y = z if own else torch.empty_like(z)
        bits = torch.empty(-(-z.numel() // 8), dtype=torch.uint8)
        lib.et_bn_act(z.data_ptr(), y.data_ptr(), bits.data_ptr(), z.numel(), _ACT_CODE[act], lo, hi,
                      torch.get_num_threads())
        return y, bits
    own = not frames()
    if act == "relu":
        y = torch.relu_(z) if own else torch.relu(z)
        return y, _pack(y > 0)  # threshold_backward(g, y, 0): g where y > 0
    y = F.hardtanh_(z, lo, hi) if own else F.hardtanh(z, lo, hi)
    return y, _pack((y > lo) & (y < hi))  # hardtanh_backward: g strictly inside the bounds


class _SaveInput(torch.autograd.Function):
    """Saves the BatchNorm input ahead of the BatchNorm (module docstring: the replay stops here)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g


class _LeanBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, act, lo, hi, owned):  # type: ignore[override]
        grab = _Statistics()
        with grab:
            z = module(x)
        if grab.stats is not None and grab.stats[0].numel():  # normalised with the batch's statistics
            mean, invstd = grab.stats
            ctx.batch_stats = True
        else:  # eval mode: the running statistics, as the kernel uses them
            mean = module.running_mean.detach().clone()
            invstd = (module.running_var.detach() + module.eps).rsqrt()
            ctx.batch_stats = False
        y, mask = _activation(z, act, lo, hi)
        del z
        # The input is saved by the _SaveInput call before this one when it needs a gradient; the mask
        # and statistics (1/32 of the input and less) stay with this node, so that a recomputed stage
        # ending here stops once the input is back, without making this layer's output again.
        source = x.grad_fn if isinstance(x.grad_fn, _SaveInput._backward_cls) else None
        if source is None:
            ctx.save_for_backward(x)
        ctx.source = source
        ctx.mask, ctx.mean, ctx.invstd, ctx.weight = mask, mean, invstd, weight
        ctx.owned = owned
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g_y):  # type: ignore[override]
        (x,) = ctx.source.saved_tensors if ctx.source is not None else ctx.saved_tensors
        mask, mean, invstd, weight = ctx.mask, ctx.mean, ctx.invstd, ctx.weight
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g_y = g_y.contiguous()
        lib = _native(x, g_y, mean, invstd)
        if lib is not None and (weight is None or weight.dtype == torch.float32):
            channels = x.shape[1]
            spatial = x[0, 0].numel() if x.shape[0] else 0
            g_x = (x if ctx.owned else torch.empty_like(x)) if need_x else None
            g_w = x.new_empty(channels) if need_w else None
            g_b = x.new_empty(channels) if need_b else None
            lib.et_bn_backward(x.data_ptr(), g_y.data_ptr(), _ptr(mask), x.shape[0], channels, spatial,
                               mean.data_ptr(), invstd.data_ptr(), _ptr(weight), int(ctx.batch_stats),
                               _ptr(g_x), _ptr(g_w), _ptr(g_b), torch.get_num_threads())
            if g_x is not None:
                torch.autograd.graph.increment_version(g_x)  # a write autograd must see (a raw pointer's is not)
                g_x = g_x.detach()
            return g_x, g_w, g_b, None, None, None, None, None
        n_rows = x.shape[0]
        per_row = x[0].numel() if n_rows else 0
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = (1, channels) + (1,) * (x.dim() - 2)
        rows = max(1, SLICE_BYTES // max(1, per_row * x.element_size()))
        mean_b = mean.view(shape).to(x.dtype)

        def masked(start: int, stop: int) -> torch.Tensor:
            g = g_y[start:stop]
            if mask is None:
                return g
            keep = _unpack(mask, start * per_row, stop * per_row).view(g.shape)
            return g * keep

        total = torch.zeros(channels, dtype=torch.float64)
        dotp = torch.zeros(channels, dtype=torch.float64)
        for start in range(0, n_rows, rows):
            stop = min(n_rows, start + rows)
            g = masked(start, stop)
            total += g.sum(dims, dtype=torch.float64)
            dotp += ((x[start:stop] - mean_b) * g).sum(dims, dtype=torch.float64)
        count = x.numel() // channels
        inv = invstd.to(torch.float64)
        g_w = (dotp * inv).to(x.dtype) if need_w else None
        g_b = total.to(x.dtype) if need_b else None
        g_x = None
        if need_x:
            if ctx.batch_stats:
                k = (dotp * inv * inv / count).to(x.dtype).view(shape)
                g_mean = (total / count).to(x.dtype).view(shape)
            else:  # the statistics are constants: g_x = g * invstd * weight
                k = g_mean = x.new_zeros(shape)
            scale = (inv if weight is None else inv * weight.to(torch.float64)).to(x.dtype).view(shape)
            g_x = x if ctx.owned else torch.empty_like(x)
            for start in range(0, n_rows, rows):
                stop = min(n_rows, start + rows)
                t = (x[start:stop] - mean_b).mul_(k)
                out = masked(start, stop).sub(g_mean).sub_(t).mul_(scale)
                g_x[start:stop] = out
                del t, out
            g_x = g_x.detach()
        return g_x, g_w, g_b, None, None, None, None, None


def lean_batch_norm(x: torch.Tensor, module: nn.Module, act: str = "none", lo: float = 0.0, hi: float = 0.0,
                    owned: bool = False) -> torch.Tensor:
    """``act(module(x))`` for a BatchNorm ``module``, with the backward of the module docstring.

    Args:
        x: the BatchNorm input ``[N, C, ...]``.
        module: an ``nn.BatchNorm1d/2d/3d``; called as is (its forward hooks fire).
        act: ``"none"``, ``"relu"`` or ``"hardtanh"`` (ReLU6 is ``hardtanh`` with bounds ``(0, 6)``).
        lo, hi: the hardtanh bounds.
        owned: nothing but this call holds ``x`` for backward, so its gradient may be written over it.

    Returns:
        The activation's output, equal to ``act(module(x))``.
    """
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or any(
        p is not None and p.requires_grad for p in (module.weight, module.bias)))
    if (wants_grad and x.dtype in (torch.float32, torch.float64) and x.is_contiguous()
            and x.dim() >= 2 and x.shape[0] > 0):
        if x.requires_grad:
            x = _SaveInput.apply(x)
        return _LeanBatchNormFn.apply(x, module.weight, module.bias, module, act, float(lo), float(hi),
                                      bool(owned))
    z = module(x)
    if act == "none":
        return z
    y = torch.relu(z) if act == "relu" else F.hardtanh(z, lo, hi)
    # the activation saved y for its backward; a reader that owns its input must not overwrite that
    return y.clone() if wants_grad else y
