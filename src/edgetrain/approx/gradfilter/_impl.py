"""Filtered Conv2d: exact forward, backward on r x r patch-averaged maps (the maths of gradient filtering).

Notation (one spatial axis; the 2-D operator is the product of the two axes' operators). A Conv2d with
kernel ``k``, stride ``s``, dilation ``d`` and left (top) padding ``P`` maps an input of length ``H``
to an output of length ``H_o`` by ``y[i] = sum_p W[p] x[s*i + d*p - P]`` (``x`` is 0 outside
``[0, H)``). Cut both maps into patches of ``r`` positions, ``I = floor(i / r)``, ``U = floor(u / r)``,
``H_o' = ceil(H_o / r)`` and ``H' = ceil(H / r)`` patches; a last patch may be partial (ceil mode), and
every average below divides by the number of *real* positions in the patch (``n_I``, ``n_U``).

* ``X[U] = mean_{u in U} x[u]`` is the only activation saved (``H' x W'`` per channel: ``r^2`` fewer).
* ``G[I] = mean_{i in I} gy[i]`` is the filtered output gradient (patch average of ``dL/dy``).
* The approximation: ``x~ = P_in x`` and ``gy~ = P_out gy``, where ``P`` replaces every value by its
  patch mean (``P = up o mean``, an orthogonal projection). The backward returns the *exact* gradients
  of the surrogate layer ``y_s = P_out conv_W(P_in x)``::

      dW[p]   = sum_i gy~[i] * x~[s*i + d*p - P]
      dx      = P_in conv_W^T(gy~)            (i.e. dx[u] = (1 / n_U) sum_{u' in U} conv_W^T(gy~)[u'])
      dbias   = sum_i gy[i]                   (exact: P_out keeps sums)

  while the forward output is the exact ``conv_W(x)``. With ``r = 1`` both projections are the
  identity, so this *is* exact backprop.

Computing it on the ``H' x W'`` grids. Write a fine output position as ``i = r*I + a`` (``0 <= a < r``).
It reads ``u = s*r*I + t`` with ``t = s*a + d*p - P``, which lies in patch ``U = s*I + m`` with
``m = floor(t / r)`` (``s*r*I`` is a multiple of ``r``). Hence::

      dW[p] = sum_m A[p, m] sum_I G[I] X[s*I + m]        A[p, m] = #{a : floor((s*a + d*p - P) / r) = m}

a *coarse* correlation with stride ``s``, dilation 1 and ``K' = m_max - m_min + 1`` taps, then a tiny
contraction with the count matrix ``A`` (``k x K'``). The input gradient is the matching transposed
coarse convolution with the folded kernel ``W'[m] = sum_p A[p, m] W[p]``, divided by ``n_U`` and
replicated over each patch. In 2-D, ``A_h[p, m] * A_w[q, n]`` weights tap ``(p, q)``. For a 3x3
convolution ``K' = 3`` for every stride and radius (e.g. ``r = 2, s = 1, P = 1``:
``W' = [W0, W0 + 2 W1 + W2, W2]`` per axis), so both gradients cost ``r^2`` fewer multiply-adds.

Stride ``s`` is exact here. The published code sums the input over ``(s*r)^2`` positions per output
patch where ``r^2`` per-position averages are meant, so its weight gradient is ``s^2`` too large on
stride-``s`` layers; here the input keeps its own ``r``-grid and ``s`` stays the coarse stride.
Partial patches (a map not divisible by ``r``): a fine output beyond ``H_o`` gets no gradient and a
read of a position in ``[H, r*H')`` (inside the last input patch but past the map) reads 0. Both only
change ``A`` for the last one or two patch rows/columns, which therefore get their own ``A``; the
result is exactly the formula above, with no cropping.

Implementation. Coarse maps of at most ``_DENSE_MAX_COARSE`` positions (the last layers of a CNN)
run the whole backward as GEMMs and native kernels (:mod:`._dense`): pooling and unpooling
are single passes in C (:mod:`._native`; without a C compiler, products with a small
patch-mean matrix), a tap matrix ``T`` (``kH kW H_o' W_o' x H' W'``, built from the ``A`` tables)
gathers, per kernel tap, the patch means each tap reads, and 1x1, other dense and depthwise convs each
get the operand layouts that make ``dW`` and ``dx`` single (batched) GEMMs or, for depthwise, vectorised
sums over channels. The input gradient keeps the input's memory format. Larger maps pool and unpool
natively too (else ``avg_pool2d`` and an expanded copy) and run the coarse convolutions through
``aten.convolution_backward``, one call per block of equal ``A``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.modules.utils import _pair

from ...batch import is_channels_last
from . import _native as native
from ._axis import _Axis
from ._dense import dense_backward, identity_scale, patch_counts, pool_map, saved_layout, tap_matrix

__all__ = ["filtered_conv2d", "coarse_geometry", "saved_numel"]


@functools.lru_cache(maxsize=4096)
def _axis(n_in: int, n_out: int, k: int, s: int, d: int, pad: int, r: int) -> _Axis:
    n_in_c, n_out_c = -(-n_in // r), -(-n_out // r)
    m_lo = (-pad) // r
    m_hi = (s * (r - 1) + d * (k - 1) - pad) // r
    k_c = m_hi - m_lo + 1
    rows: list[tuple[tuple[int, ...], ...]] = []
    for big_i in range(n_out_c):
        table = [[0] * k_c for _ in range(k)]
        for a in range(min(r, n_out - r * big_i)):  # real output positions of this patch only
            for p in range(k):
                u = s * (r * big_i + a) + d * p - pad
                if n_in <= u < r * n_in_c:  # past the map inside a partial last patch: reads 0
                    continue
                table[p][u // r - s * big_i - m_lo] += 1  # u < 0 or u >= r*H' hit the zero padding
        rows.append(tuple(tuple(row) for row in table))
    kinds: list[tuple[tuple[int, ...], ...]] = []
    blocks: list[tuple[int, int, int]] = []
    for big_i, row in enumerate(rows):
        if blocks and kinds[blocks[-1][2]] == row:
            start, _, kind = blocks[-1]
            blocks[-1] = (start, big_i + 1, kind)
            continue
        if row not in kinds:
            kinds.append(row)
        blocks.append((big_i, big_i + 1, kinds.index(row)))
    length = max(s * (n_out_c - 1) + k_c, -m_lo + n_in_c)
    counts = tuple(min(r, n_in - r * u) for u in range(n_in_c))
    return _Axis(n_in_c, n_out_c, s, k_c, -m_lo, length, tuple(blocks), tuple(kinds), counts)


def coarse_geometry(x_shape: tuple[int, ...], w_shape: tuple[int, ...], y_shape: tuple[int, ...],
                    stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                    radius: int) -> tuple[_Axis, _Axis]:
    """The (height, width) coarse geometry of a conv: patch counts, ``K'`` taps and ``A`` tables."""
    return tuple(_axis(x_shape[2 + j], y_shape[2 + j], w_shape[2 + j], stride[j], dilation[j],
                       padding[j], radius) for j in (0, 1))  # type: ignore[return-value]


# Small maps pool, unpool and gather kernel taps with GEMMs against small dense matrices: on tensors
# with tiny planes, avg_pool2d and strided copies are an order of magnitude slower.
_DENSE_MAX_COARSE = 64


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[N, C, H W]`` view of a ``[N, C, H, W]`` tensor stored NCHW or channels-last."""
    n, c, h, w = t.shape
    if t.stride(2) != t.stride(3) * w:
        raise ValueError("rows of this tensor are not evenly spaced")
    return t.as_strided((n, c, h * w), (t.stride(0), t.stride(1), t.stride(3)))


def _mean_pool(t: torch.Tensor, radius: int) -> torch.Tensor:
    """Patch means ``[N, C, ceil(H/r), ceil(W/r)]`` of a large map (same memory format); ``t`` at ``r = 1``."""
    if radius == 1:
        return t
    if native.available(t) and t.stride(2) == t.stride(3) * t.shape[3]:
        n, c, h, w = t.shape
        out = torch.empty((n, c, -(-h // radius), -(-w // radius)), dtype=t.dtype, memory_format=(
            torch.channels_last if is_channels_last(t) else torch.contiguous_format))
        native.pool(t, radius, _flat(out))
        return out
    return F.avg_pool2d(t, radius, radius, ceil_mode=True)  # ceil mode divides by the real positions


def _mean_unpool(t: torch.Tensor, h: int, w: int, radius: int, channels_last: bool) -> torch.Tensor:
    """Adjoint of :func:`_mean_pool`: ``out[u] = t[U] / n_U`` over the real ``h x w`` positions."""
    if radius == 1:
        return t.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    n, c, hc, wc = t.shape
    if native.available(t):
        if t.stride(2) != t.stride(3) * wc:
            t = t.contiguous()
        out = torch.empty((n, c, h, w), dtype=t.dtype, memory_format=(
            torch.channels_last if channels_last else torch.contiguous_format))
        native.unpool(_flat(t), radius, out)
        return out
    t = t.contiguous() / patch_counts(h, w, radius, t.dtype, t.device)
    up = t[:, :, :, None, :, None].expand(-1, -1, -1, radius, -1, radius)
    up = up.reshape(n, c, hc * radius, wc * radius)
    return up if up.shape[2:] == (h, w) else up[:, :, :h, :w].contiguous()


class _FilteredConv2dFn(torch.autograd.Function):
    """Exact conv2d forward; saves only the patch-averaged input; filtered backward on coarse maps."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, radius):  # type: ignore[override]
        y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        need_w = ctx.needs_input_grad[1]
        geometry = (tuple(x.shape), tuple(weight.shape), tuple(y.shape), stride, padding, dilation,
                    groups, radius)
        dense = _uses_taps(geometry)
        x_pooled, layout = None, None
        if need_w:  # only what backward needs: the pooled input for dW, the weight (a parameter) for dx
            if dense:
                layout = saved_layout(x, tuple(weight.shape), groups)
                x_pooled = pool_map(x, radius, layout)
                axes = _saved_taps(geometry)
                if axes is not None:  # 1x1: keep what each coarse output reads, Z = T X
                    x_pooled = torch.matmul(tap_matrix(*axes, 1, 1, x.dtype, x.device), x_pooled)
            else:
                x_pooled = _mean_pool(x, radius)
        ctx.save_for_backward(x_pooled, weight if ctx.needs_input_grad[0] else None)
        ctx.geometry = geometry
        ctx.dense = dense
        ctx.layout = layout
        ctx.x_channels_last = is_channels_last(x)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):  # type: ignore[override]
        x_pooled, weight = ctx.saved_tensors
        x_shape, w_shape, y_shape, stride, padding, dilation, groups, radius = ctx.geometry
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ah, aw = coarse_geometry(x_shape, w_shape, y_shape, stride, padding, dilation, radius)
        if ctx.dense:
            gx, gw, gb = dense_backward(gy, x_pooled, weight, x_shape, w_shape, ah, aw, groups, radius,
                                        (need_x, need_w, need_b), ctx.x_channels_last, ctx.layout)
            return gx, gw, gb, None, None, None, None, None
        g = _mean_pool(gy, radius)
        gb = None
        if need_b:  # sum of dL/dy = sum over patches of n_I * G[I]: exact, read from the small map
            count = patch_counts(y_shape[2], y_shape[3], radius, g.dtype, g.device)
            gb = torch.einsum("noij,ij->o", g, count)
        if not (need_x or need_w):
            return None, None, gb, None, None, None, None, None
        gxc, gw = _coarse_backward(g, x_pooled, weight, x_shape, w_shape, ah, aw, groups, need_x,
                                   need_w)
        gx = _mean_unpool(gxc, x_shape[2], x_shape[3], radius, ctx.x_channels_last) if need_x else None
        return gx, gw, gb, None, None, None, None, None


@functools.lru_cache(maxsize=1024)
def _fold_matrix(table_h: tuple[tuple[int, ...], ...], table_w: tuple[tuple[int, ...], ...],
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``kron(A_h, A_w)``: maps a ``kH*kW`` kernel to its ``K'h*K'w`` coarse kernel."""
    a_h = torch.tensor(table_h, dtype=torch.float64)
    a_w = torch.tensor(table_w, dtype=torch.float64)
    return torch.kron(a_h, a_w).to(dtype=dtype, device=device)


def _fold(flat: torch.Tensor, fold: torch.Tensor) -> torch.Tensor:
    """``flat @ fold`` for ``[rows, k]`` by ``[k, k']``; a scalar product when both are 1 (1x1 convs)."""
    return flat * fold[0, 0] if fold.shape == (1, 1) else flat @ fold


def _saved_taps(geometry: tuple) -> tuple[_Axis, _Axis] | None:
    """The coarse axes of a conv that saves ``Z = T X`` (what each coarse output reads) instead of ``X``.

    For a dense 1x1 conv on a small map, ``dW = G^T Z`` needs nothing else of the input, and ``Z`` has
    ``H_o' W_o'`` positions: a quarter of ``X``'s for a stride-2 shortcut. Stride-1 convs on whole
    patches have ``T = s I``; they keep ``X`` (the scale is folded into the pooled gradient instead).
    None for every conv that keeps ``X``.
    """
    x_shape, w_shape, y_shape, stride, padding, dilation, groups, radius = geometry
    if not (_uses_taps(geometry) and groups == 1 and w_shape[2] == w_shape[3] == 1):
        return None
    ah, aw = coarse_geometry(x_shape, w_shape, y_shape, stride, padding, dilation, radius)
    return None if identity_scale(ah, aw, 1, 1) is not None else (ah, aw)


def saved_numel(x_shape: tuple[int, ...], w_shape: tuple[int, ...], y_shape: tuple[int, ...],
                stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int], groups: int,
                radius: int) -> int:
    """Elements a filtered conv saves for its weight gradient: its pooled input, or ``T X`` (1x1 convs).

    Args:
        x_shape: input shape.
        w_shape: weight shape.
        y_shape: output shape.
        stride: the conv's stride pair.
        padding: the conv's numeric padding pair.
        dilation: the conv's dilation pair.
        groups: the conv's groups.
        radius: patch side.

    Returns:
        The element count.
    """
    geometry = (tuple(x_shape), tuple(w_shape), tuple(y_shape), stride, padding, dilation, groups, radius)
    axes = _saved_taps(geometry)
    if axes is not None:
        return x_shape[0] * x_shape[1] * axes[0].n_out_c * axes[1].n_out_c
    return x_shape[0] * x_shape[1] * -(-x_shape[2] // radius) * -(-x_shape[3] // radius)


def _uses_taps(geometry: tuple) -> bool:
    """Small coarse maps take the GEMM path, big ones coarse convolutions (which handle them well)."""
    x_shape, w_shape, y_shape, groups, radius = (geometry[i] for i in (0, 1, 2, 6, 7))
    coarse_in = -(-x_shape[2] // radius) * -(-x_shape[3] // radius)
    coarse_out = -(-y_shape[2] // radius) * -(-y_shape[3] // radius)
    depthwise = w_shape[1] == 1 and w_shape[0] == groups == x_shape[1]
    # radius 1 keeps the input itself (no pooled copy) and runs plain convolutions
    return radius > 1 and (groups == 1 or depthwise) and max(coarse_in, coarse_out) <= _DENSE_MAX_COARSE


def _coarse_backward(g: torch.Tensor, x_pooled: torch.Tensor | None, weight: torch.Tensor | None,
                     x_shape: tuple[int, ...], w_shape: tuple[int, ...], ah: _Axis, aw: _Axis,
                     groups: int, need_x: bool, need_w: bool,
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dL/dX on the H' x W' grid, dW)`` from the coarse convolutions, block by block."""
    n, c = x_shape[0], x_shape[1]
    o, cg, kh, kw = w_shape
    opts = dict(dtype=g.dtype, device=g.device)
    stride = (ah.stride, aw.stride)
    w_flat = weight.reshape(o * cg, kh * kw) if need_x else None
    mask = (need_x, need_w, False)
    if len(ah.blocks) == 1 and len(aw.blocks) == 1:
        # one block: let the convolution pad symmetrically when that gives the right output size
        sym = [a.left if (a.n_in_c + 2 * a.left - a.k_c) // a.stride + 1 == a.n_out_c else None
               for a in (ah, aw)]
        if None not in sym:
            fold = _fold_matrix(ah.tables[0], aw.tables[0], g.dtype, g.device)
            w_c = _fold(w_flat, fold).reshape(o, cg, ah.k_c, aw.k_c) if need_x else \
                torch.zeros((o, cg, ah.k_c, aw.k_c), **opts)
            x_ref = x_pooled if need_w else torch.zeros((n, c, ah.n_in_c, aw.n_in_c), **opts)
            gi, gwc, _ = torch.ops.aten.convolution_backward(
                g, x_ref, w_c, None, stride, tuple(sym), (1, 1), False, (0, 0), groups, mask)
            gw = None
            if need_w:
                gw = _fold(gwc.reshape(o * cg, -1), fold.T).reshape(w_shape)
            return gi, gw
    pad = (aw.left, aw.length - aw.left - aw.n_in_c, ah.left, ah.length - ah.left - ah.n_in_c)
    # coarse input, zero padded so every block's window exists; a placeholder when dW is not needed
    xp = F.pad(x_pooled, pad) if need_w else torch.zeros((n, c, ah.length, aw.length), **opts)
    gxp = torch.zeros((n, c, ah.length, aw.length), **opts) if need_x else None
    gw = torch.zeros((o * cg, kh * kw), **opts) if need_w else None
    for h0, h1, th in ah.blocks:
        rows = slice(ah.stride * h0, ah.stride * (h1 - 1) + ah.k_c)
        for w0, w1, tw in aw.blocks:
            cols = slice(aw.stride * w0, aw.stride * (w1 - 1) + aw.k_c)
            fold = _fold_matrix(ah.tables[th], aw.tables[tw], g.dtype, g.device)
            w_c = _fold(w_flat, fold).reshape(o, cg, ah.k_c, aw.k_c) if need_x else \
                torch.zeros((o, cg, ah.k_c, aw.k_c), **opts)
            gi, gwc, _ = torch.ops.aten.convolution_backward(
                g[:, :, h0:h1, w0:w1], xp[:, :, rows, cols], w_c, None, stride, (0, 0), (1, 1),
                False, (0, 0), groups, mask)
            if need_x:
                gxp[:, :, rows, cols] += gi
            if need_w:
                gw += _fold(gwc.reshape(o * cg, -1), fold.T)
    gxc = gxp[:, :, ah.left:ah.left + ah.n_in_c, aw.left:aw.left + aw.n_in_c] if need_x else None
    return gxc, (gw.reshape(w_shape) if need_w else None)


def _explicit_padding(x: torch.Tensor, weight: torch.Tensor, padding: str | int | tuple[int, int],
                      dilation: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """Turn ``'valid'`` / ``'same'`` into numbers (asymmetric 'same' pads ``x`` explicitly)."""
    if not isinstance(padding, str):
        return x, _pair(padding)
    if padding == "valid":
        return x, (0, 0)
    if padding != "same":
        raise ValueError(f"padding must be an int, a pair, 'valid' or 'same'; got {padding!r}")
    totals = [dilation[j] * (weight.shape[2 + j] - 1) for j in (0, 1)]
    lefts = [t // 2 for t in totals]
    if all(t == 2 * left for t, left in zip(totals, lefts)):
        return x, (lefts[0], lefts[1])
    return F.pad(x, (lefts[1], totals[1] - lefts[1], lefts[0], totals[0] - lefts[0])), (0, 0)


def filtered_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    stride: int | tuple[int, int] = 1, padding: str | int | tuple[int, int] = 0,
                    dilation: int | tuple[int, int] = 1, groups: int = 1, radius: int = 2,
                    ) -> torch.Tensor:
    """``F.conv2d`` whose backward uses gradient filtering with patch size ``radius x radius``.

    The output is exactly ``F.conv2d(x, weight, bias, ...)``. For backward it saves only the
    ``radius x radius`` patch means of ``x`` (ceil mode: partial edge patches average their real
    positions), and returns the exact gradients of ``P_out o conv o P_in`` (``P``: replace each value by
    its patch mean), computed on the pooled maps; see this module's docstring for the formulas.
    ``radius=1`` is exact backprop.

    Args:
        x: input ``[N, C, H, W]``.
        weight: ``[O, C / groups, kH, kW]``.
        bias: ``[O]`` or None.
        stride: as in ``F.conv2d``.
        padding: as in ``F.conv2d`` (ints, a pair, ``'valid'`` or ``'same'``; zeros).
        dilation: as in ``F.conv2d``.
        groups: as in ``F.conv2d`` (depthwise when ``groups == C``).
        radius: patch side ``r >= 1``.

    Returns:
        The convolution output ``[N, O, H_o, W_o]``.

    Raises:
        ValueError: when ``radius`` is not an integer >= 1 or ``padding`` is not understood.
    """
    if isinstance(radius, bool) or not isinstance(radius, int) or radius < 1:
        raise ValueError(f"radius must be an integer >= 1 (patch side in pixels); got {radius!r}")
    stride, dilation = _pair(stride), _pair(dilation)
    x, padding = _explicit_padding(x, weight, padding, dilation)
    wants_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if not (torch.is_grad_enabled() and wants_grad):
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return _FilteredConv2dFn.apply(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation),
                                   groups, radius)
