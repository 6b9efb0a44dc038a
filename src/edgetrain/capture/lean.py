"""Lean convolution: the same values and gradients as ``nn.Conv2d``, computed over slices of the batch.

oneDNN's convolution backward on CPU copies its operands into blocked layouts before it computes, and
those copies are as large as the layer's input and output gradient. On the layer that sets a step's peak
they *are* the peak: MobileNetV2 at 64x64, batch 148, one training step with every stage recomputed peaks
during the backward of ``features.2``'s depthwise convolution (input 148x96x32x32, 55.5 MiB), whose
``convolution_backward`` call holds 125 MiB above what is live before it (its input gradient, 55.5 MiB, is
the only result). Because a convolution treats every sample independently, its input gradient can be
computed slice by slice of the batch and its weight gradient summed over the slices: the same maths
(the weight gradient is a sum over samples either way; only the order of that sum changes, about 1e-6
relative in float32), with the blocked copies of one slice alive at a time. Measured here (one thread,
edgetrain's pool): that call falls from 125 to 79 MiB above live at 8 slices, and it is faster (51 ->
42 ms); a 1x1 convolution 16->96 at 32x32, batch 32, takes 3.5 ms instead of 7.3 (oneDNN's weight
gradient of a large 1x1 problem is slow in one call).

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

import os

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["CHUNK_BYTES", "lean_conv2d", "lean_hardtanh", "chunk_bytes"]

#: Default bytes of (input + output gradient) a backward slice covers. Below ~4 MiB oneDNN loses speed on
#: deep, small maps (ResNet-18's 256x8x8 layers: 28 ms in one call, 38 ms in slices of 8); at 8 MiB the
#: slices of the large early maps stay big enough to be as fast as one call or faster.
CHUNK_BYTES = 8 * 2**20

def chunk_bytes() -> int:
    """Slice size from ``EDGETRAIN_CONV_CHUNK_BYTES`` (0 disables the lean path), else :data:`CHUNK_BYTES`."""
    raw = os.environ.get("EDGETRAIN_CONV_CHUNK_BYTES", "").strip()
    if not raw:
        return CHUNK_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"EDGETRAIN_CONV_CHUNK_BYTES must be a byte count (0 turns the lean convolution "
                         f"backward off); got {raw!r}") from None
    return max(0, value)


class _LeanConv2dFn(torch.autograd.Function):
    """``F.conv2d`` whose backward runs ``convolution_backward`` over slices of ``rows`` samples."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, rows):  # type: ignore[override]
        ctx.save_for_backward(x, weight)  # what PyTorch's own convolution saves
        ctx.conv = (stride, padding, dilation, groups, rows)
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
            gx = torch.empty_like(x) if need_x else None
            for start in range(0, x.shape[0], rows):
                part = slice(start, start + rows)
                gi, gwi, _ = torch.ops.aten.convolution_backward(
                    gy[part], x[part], weight, None, stride, padding, dilation, False, (0, 0), groups, mask)
                if need_x:
                    gx[part] = gi
                if need_w:
                    gw = gwi if gw is None else gw.add_(gwi)
                del gi, gwi
        return gx, gw, gb, None, None, None, None, None


def _sliced_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                    groups: int, rows: int) -> torch.Tensor:
    """``F.conv2d`` computed ``rows`` samples at a time into one output (the forward's blocked copy of
    the input is then one slice big too)."""
    first = F.conv2d(x[:rows], weight, bias, stride, padding, dilation, groups)
    out = first.new_empty((x.shape[0],) + tuple(first.shape[1:]))
    out[:rows] = first
    del first
    for start in range(rows, x.shape[0], rows):
        out[start:start + rows] = F.conv2d(x[start:start + rows], weight, bias, stride, padding, dilation,
                                           groups)
    return out


def lean_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                groups: int, limit: int | None = None) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding, dilation, groups)`` with a batch-sliced backward.

    Args:
        x: input ``[N, C, H, W]``.
        weight: ``[O, C / groups, kH, kW]``.
        bias: ``[O]`` or None.
        stride, padding, dilation: pairs of ints (zero padding).
        groups: as in ``F.conv2d``.
        limit: bytes of input plus output a slice may cover (None: :func:`chunk_bytes`, read from the
            environment; a graph rewrite passes it once instead of reading it on every call).

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
    return _LeanConv2dFn.apply(x, weight, bias, stride, padding, dilation, groups, rows)


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
