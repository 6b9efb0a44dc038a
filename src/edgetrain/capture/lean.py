"""Lean convolution: the same values and gradients as ``nn.Conv2d``, computed over slices of the batch.

oneDNN's convolution backward on CPU copies its operands into blocked layouts before it computes, and
those copies are as large as the layer's input and output gradient. On the layer that sets a step's peak
they *are* the peak: in a MobileNetV2 step with every stage recomputed, the peak falls in the backward of
an early depthwise convolution, whose ``convolution_backward`` call holds more than twice its input
gradient (its only result) above what is live before it. Because a convolution treats every sample independently, its input gradient can be
computed slice by slice of the batch and its weight gradient summed over the slices: the same maths
(the weight gradient is a sum over samples either way; only the order of that sum changes, about 1e-6
relative in float32), with the blocked copies of one slice alive at a time. Slicing also tends to be faster, not slower:
oneDNN's weight gradient of a large 1x1 problem is slow in one call.

:mod:`edgetrain.capture.rewrite` replaces, in the traced model graph, every call of a plain ``nn.Conv2d`` by
:func:`lean_conv2d` on the module's own parameters (the user's model is not changed). The forward runs
over the same slices (the forward's blocked copy of the input is one slice big too), always the same way
for a given batch size, so recomputation replays it bit for bit; against one ``F.conv2d`` call the values
differ by float rounding only. A layer whose input plus output fits :data:`CHUNK_BYTES` takes PyTorch's
own path with no overhead at all. Set ``EDGETRAIN_CONV_CHUNK_BYTES=0`` to turn the rewrite off, or to
another byte count to change the slice size.

:func:`lean_hardtanh` (ReLU6 and Hardtanh) saves its output for backward instead of its input; see there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .. import settings
from ..batch import is_channels_last

__all__ = ["CHUNK_BYTES", "lean_conv2d", "lean_hardtanh", "chunk_bytes", "memory_format_of"]

#: Default bytes of (input + output gradient) a backward slice covers. Much smaller slices lose speed on
#: deep, small maps (oneDNN's per-call overhead); at 8 MiB the slices of the large early maps stay big
#: enough to be as fast as one call or faster.
CHUNK_BYTES = settings.DEFAULT_CONV_CHUNK_BYTES

#: the slice size in force (``EDGETRAIN_CONV_CHUNK_BYTES``; 0 disables the lean path)
chunk_bytes = settings.conv_chunk_bytes


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    """``torch.channels_last`` for a 4-D tensor stored channels-last (and not also contiguous), else
    ``torch.contiguous_format``."""
    return torch.channels_last if is_channels_last(t) else torch.contiguous_format


class _LeanConv2dFn(torch.autograd.Function):
    """``F.conv2d`` whose backward runs ``convolution_backward`` over slices of ``rows`` samples."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, rows, owned):  # type: ignore[override]
        ctx.save_for_backward(x, weight)  # what PyTorch's own convolution saves
        ctx.conv = (stride, padding, dilation, groups, rows)
        ctx.owned = owned
        return _sliced_forward(x, weight, bias, stride, padding, dilation, groups, rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups, rows = ctx.conv
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        mask = (need_x, need_w, False)
        gb = gy.sum((0, 2, 3)) if need_b else None
        gx = gw = None
        if need_x or need_w:
            # an owned input is read by nothing after its slice's gradients: each slice of the input
            # gradient goes where that slice of the input was
            gx = (x.detach() if ctx.owned else torch.empty_like(x)) if need_x else None
            for start in range(0, x.shape[0], rows):
                part = slice(start, start + rows)
                gi, gwi, _ = torch.ops.aten.convolution_backward(
                    gy[part], x[part], weight, None, stride, padding, dilation, False, (0, 0), groups, mask)
                if need_x:
                    gx[part] = gi
                if need_w:
                    gw = gwi if gw is None else gw.add_(gwi)
                del gi, gwi
        return gx, gw, gb, None, None, None, None, None, None


def _sliced_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                    groups: int, rows: int) -> torch.Tensor:
    """``F.conv2d`` computed ``rows`` samples at a time into one output (the forward's blocked copy of
    the input is then one slice big too). One convolution to a selective checkpoint (its output kept
    whole, its slices never re-run in a replay: :func:`edgetrain.capture.composite.composite`)."""
    from .composite import composite

    return composite("conv", lambda: _slices(x, weight, bias, stride, padding, dilation, groups, rows))


def _slices(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, int],
            padding: tuple[int, int], dilation: tuple[int, int], groups: int, rows: int) -> torch.Tensor:
    first = F.conv2d(x[:rows], weight, bias, stride, padding, dilation, groups)
    # in the layout the convolution chose (channels-last for a channels-last input): a contiguous output would
    # turn every later layer back to NCHW, and cost a copy per layer
    out = torch.empty((x.shape[0],) + tuple(first.shape[1:]), dtype=first.dtype, device=first.device,
                      memory_format=memory_format_of(first))
    out[:rows] = first
    del first
    for start in range(rows, x.shape[0], rows):
        out[start:start + rows] = F.conv2d(x[start:start + rows], weight, bias, stride, padding, dilation,
                                           groups)
    return out


def lean_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                groups: int, limit: int | None = None, owned: bool = False) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding, dilation, groups)`` with a batch-sliced backward.

    Args:
        x: input ``[N, C, H, W]``.
        weight: ``[O, C / groups, kH, kW]``.
        bias: ``[O]`` or None.
        stride, padding, dilation: pairs of ints (zero padding).
        groups: as in ``F.conv2d``.
        limit: bytes of input plus output a slice may cover (None: :func:`chunk_bytes`, read from the
            environment; a graph rewrite passes it once instead of reading it on every call).
        owned: nothing but this convolution holds ``x`` for backward (the graph rewrite proves it), so
            its gradient is written over ``x`` slice by slice instead of into a new tensor.

    Returns:
        The convolution output, ``F.conv2d``'s up to float rounding. The forward and backward run over
        the fewest equal slices of the batch whose input plus output (gradient) is at most ``limit``
        each (at least one sample per slice); a layer that fits one slice is plain
        ``F.conv2d``.
    """
    limit = chunk_bytes() if limit is None else limit
    wants_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if limit <= 0 or x.dim() != 4:
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    n = x.shape[0]
    out_hw = [(x.shape[2 + j] + 2 * padding[j] - dilation[j] * (weight.shape[2 + j] - 1) - 1) // stride[j] + 1
              for j in (0, 1)]
    per_sample = (x[0].numel() + weight.shape[0] * out_hw[0] * out_hw[1]) * x.element_size()
    slices = -(-n * per_sample // limit)
    rows = -(-n // slices)  # balanced: 2 slices of 16, not 31 and 1
    if rows >= n:
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    if not (wants_grad and torch.is_grad_enabled()):
        return _sliced_forward(x, weight, bias, stride, padding, dilation, groups, rows)
    return _LeanConv2dFn.apply(x, weight, bias, stride, padding, dilation, groups, rows, bool(owned))


class _HardtanhFn(torch.autograd.Function):
    """``hardtanh`` that saves its output, not its input (what PyTorch's in-place ``hardtanh_`` does)."""

    @staticmethod
    def forward(ctx, x, min_val, max_val):  # type: ignore[override]
        y = F.hardtanh(x, min_val, max_val)
        ctx.save_for_backward(y)
        ctx.bounds = (min_val, max_val)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return torch.ops.aten.hardtanh_backward(gy, y, *ctx.bounds), None, None


def lean_hardtanh(x: torch.Tensor, min_val: float = -1.0, max_val: float = 1.0) -> torch.Tensor:
    """``F.hardtanh(x, min_val, max_val)`` (ReLU6 is ``(0, 6)``) whose backward reads the output.

    ``y = clamp(x, min, max)`` lies strictly between the bounds exactly where ``x`` does, so the gradient
    mask from ``y`` is the one PyTorch computes from ``x`` (bit for bit). Saving ``y`` instead of ``x`` lets
    the input go as soon as nothing else needs it: after a BatchNorm, whose backward reads its own input,
    the BatchNorm output is then never stored (the memory torchvision's ``ReLU6(inplace=True)`` saves,
    without overwriting a tensor the runtime may keep).

    Args:
        x: any tensor.
        min_val, max_val: the bounds (``min_val < max_val``).

    Returns:
        ``F.hardtanh(x, min_val, max_val)``.
    """
    if not (x.requires_grad and torch.is_grad_enabled()):
        return F.hardtanh(x, min_val, max_val)
    return _HardtanhFn.apply(x, float(min_val), float(max_val))
