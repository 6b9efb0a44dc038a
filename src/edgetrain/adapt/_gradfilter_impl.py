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
use GEMMs: pooling and unpooling are products with a small patch-mean matrix that read NCHW or
channels-last tensors in place, and a tap matrix ``T`` (``kH kW H_o' W_o' x H' W'``, built from the
``A`` tables) gathers, per kernel tap, the patch means each tap reads, so ``dW`` and ``dx`` are single
GEMMs on contiguous operands in the weight's own layout (see :func:`_dense_backward`; per channel for
depthwise convs). The input gradient keeps the input's memory format. Larger maps run the coarse
convolutions through ``aten.convolution_backward``, one call per block of equal ``A``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.modules.utils import _pair

__all__ = ["filtered_conv2d", "coarse_geometry"]


@dataclass(frozen=True)
class _Axis:
    """The coarse geometry of one spatial axis (see the module docstring)."""

    n_in_c: int                          # H' = ceil(H / r)
    n_out_c: int                         # H_o' = ceil(H_o / r)
    stride: int                          # coarse stride (= the conv's stride)
    k_c: int                             # K' coarse taps
    left: int                            # zero padding before the coarse input (= -m_min)
    length: int                          # padded coarse input length
    blocks: tuple[tuple[int, int, int], ...]  # (first patch row, stop, index into tables)
    tables: tuple[tuple[tuple[int, ...], ...], ...]  # A[p][m] per block kind
    counts: tuple[int, ...]              # n_U: real positions per input patch


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


@functools.lru_cache(maxsize=256)
def _patch_matrix(h: int, w: int, radius: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``M[(U, V), (u, v)] = 1 / (n_U n_V)`` when ``(u, v)`` is in patch ``(U, V)``, else 0."""
    hc, wc = -(-h // radius), -(-w // radius)
    m_h = torch.zeros(hc, h, dtype=torch.float64)
    m_h[torch.arange(h) // radius, torch.arange(h)] = 1.0
    m_w = torch.zeros(wc, w, dtype=torch.float64)
    m_w[torch.arange(w) // radius, torch.arange(w)] = 1.0
    m_h /= m_h.sum(1, keepdim=True)
    m_w /= m_w.sum(1, keepdim=True)
    return torch.kron(m_h, m_w).to(dtype=dtype, device=device)


@functools.lru_cache(maxsize=256)
def _patch_counts(h: int, w: int, radius: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[ceil(h/r), ceil(w/r)]``: real positions ``n_U n_V`` in each patch."""
    count_h = [min(radius, h - radius * i) for i in range(-(-h // radius))]
    count_w = [min(radius, w - radius * j) for j in range(-(-w // radius))]
    return torch.outer(torch.tensor(count_h, dtype=torch.float64),
                       torch.tensor(count_w, dtype=torch.float64)).to(dtype=dtype, device=device)


def _is_channels_last(t: torch.Tensor) -> bool:
    """Stored N, H, W, C (and not also plain contiguous, as maps with a 1x1 plane are)."""
    return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def _mean_pool(t: torch.Tensor, radius: int) -> torch.Tensor:
    """Patch means ``[N, C, ceil(H/r), ceil(W/r)]`` of a large map; ``t`` itself when ``radius == 1``."""
    if radius == 1:
        return t
    return F.avg_pool2d(t, radius, radius, ceil_mode=True)  # ceil mode divides by the real positions


def _mean_unpool(t: torch.Tensor, h: int, w: int, radius: int) -> torch.Tensor:
    """Adjoint of :func:`_mean_pool`: ``out[u] = t[U] / n_U`` over the real ``h x w`` positions."""
    t = t.contiguous()
    if radius == 1:
        return t
    n, c, hc, wc = t.shape
    t = t / _patch_counts(h, w, radius, t.dtype, t.device)
    up = t[:, :, :, None, :, None].expand(-1, -1, -1, radius, -1, radius)
    up = up.reshape(n, c, hc * radius, wc * radius)
    return up if up.shape[2:] == (h, w) else up[:, :, :h, :w].contiguous()


def _pool_dense(t: torch.Tensor, radius: int, spatial_major: bool) -> torch.Tensor:
    """Patch means of a small map by one GEMM with :func:`_patch_matrix`, read in place.

    Returns ``[L, N, C]`` (``spatial_major``: memory order patch, sample, channel) or ``[N, C, L]``,
    contiguous, ``L = H' W'``; ``t`` may be stored NCHW or channels-last (else it is made contiguous).
    """
    n, c, h, w = t.shape
    m = _patch_matrix(h, w, radius, t.dtype, t.device)  # [L, HW]
    lc, hw = m.shape
    if _is_channels_last(t):
        flat = t.permute(0, 2, 3, 1).reshape(n, hw, c)  # a view: memory order N, H, W, C
        if spatial_major:  # the transposing copy is of the small pooled map
            return torch.bmm(m.expand(n, lc, hw), flat).transpose(0, 1).contiguous()
        return torch.bmm(flat.transpose(1, 2), m.T.expand(n, hw, lc))
    flat = t.contiguous().view(n * c, hw)
    if spatial_major:
        return (m @ flat.T).view(lc, n, c)
    return (flat @ m.T).view(n, c, lc)


def _unpool_dense(t: torch.Tensor, h: int, w: int, radius: int, channels_last: bool) -> torch.Tensor:
    """Adjoint of :func:`_pool_dense` from ``t = [N, C, L]`` (any strides): ``[N, C, h, w]``.

    One GEMM writes the full-size map, stored channels-last when ``channels_last`` (to match an input
    stored that way), else contiguous.
    """
    n, c, lc = t.shape
    m = _patch_matrix(h, w, radius, t.dtype, t.device)  # [L, HW]
    hw = h * w
    if channels_last:  # [N, HW, C] = M^T [HW, L] @ t^T [L, C]
        out = torch.bmm(m.T.expand(n, hw, lc), t.transpose(1, 2))
        return out.view(n, h, w, c).permute(0, 3, 1, 2)
    if t.stride(0) == c * t.stride(1):  # samples and channels merge into one GEMM dimension
        return (t.reshape(n * c, lc) @ m).view(n, c, h, w)
    return torch.bmm(t, m.expand(n, lc, hw)).view(n, c, h, w)


class _FilteredConv2dFn(torch.autograd.Function):
    """Exact conv2d forward; saves only the patch-averaged input; filtered backward on coarse maps."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, radius):  # type: ignore[override]
        y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        need_w = ctx.needs_input_grad[1]
        geometry = (tuple(x.shape), tuple(weight.shape), tuple(y.shape), stride, padding, dilation,
                    groups, radius)
        dense = _uses_taps(geometry)
        x_pooled = None
        if need_w:  # only what backward needs: the pooled input for dW, the weight (a parameter) for dx
            if dense:
                ah, aw = coarse_geometry(*geometry[:6], radius)
                one_tap = groups == 1 and _identity_scale(ah, aw, *weight.shape[2:]) is not None
                x_pooled = _pool_dense(x, radius, spatial_major=one_tap)
            else:
                x_pooled = _mean_pool(x, radius)
        ctx.save_for_backward(x_pooled, weight if ctx.needs_input_grad[0] else None)
        ctx.geometry = geometry
        ctx.dense = dense
        ctx.x_channels_last = _is_channels_last(x)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):  # type: ignore[override]
        x_pooled, weight = ctx.saved_tensors
        x_shape, w_shape, y_shape, stride, padding, dilation, groups, radius = ctx.geometry
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ah, aw = coarse_geometry(x_shape, w_shape, y_shape, stride, padding, dilation, radius)
        if ctx.dense:
            gx, gw, gb = _dense_backward(gy, x_pooled, weight, x_shape, w_shape, ah, aw, groups, radius,
                                         (need_x, need_w, need_b), ctx.x_channels_last)
            return gx, gw, gb, None, None, None, None, None
        g = _mean_pool(gy, radius)
        gb = None
        if need_b:  # sum of dL/dy = sum over patches of n_I * G[I]: exact, read from the small map
            count = _patch_counts(y_shape[2], y_shape[3], radius, g.dtype, g.device)
            gb = torch.einsum("noij,ij->o", g, count)
        if not (need_x or need_w):
            return None, None, gb, None, None, None, None, None
        gxc, gw = _coarse_backward(g, x_pooled, weight, x_shape, w_shape, ah, aw, groups, need_x,
                                   need_w)
        gx = _mean_unpool(gxc, x_shape[2], x_shape[3], radius) if need_x else None
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


def _uses_taps(geometry: tuple) -> bool:
    """Small coarse maps take the GEMM path, big ones coarse convolutions (which handle them well)."""
    x_shape, w_shape, y_shape, groups, radius = (geometry[i] for i in (0, 1, 2, 6, 7))
    coarse_in = -(-x_shape[2] // radius) * -(-x_shape[3] // radius)
    coarse_out = -(-y_shape[2] // radius) * -(-y_shape[3] // radius)
    depthwise = w_shape[1] == 1 and w_shape[0] == groups == x_shape[1]
    # radius 1 keeps the input itself (no pooled copy) and runs plain convolutions
    return radius > 1 and (groups == 1 or depthwise) and max(coarse_in, coarse_out) <= _DENSE_MAX_COARSE


@functools.lru_cache(maxsize=1024)
def _tap_matrix(ah: _Axis, aw: _Axis, kh: int, kw: int, dtype: torch.dtype, device: torch.device,
                order: str = "tap,i,u") -> torch.Tensor:
    """``T[(p, q, I, J), (U, V)]``: how often tap ``(p, q)`` at coarse output ``(I, J)`` reads ``X[U, V]``.

    ``T[p, q, I, J, U, V] = A_h(I)[p, U - s*I] * A_w(J)[q, V - s*J]`` (``A`` per patch row, so partial
    edge patches are exact); reads of the zero padding have no column. ``order`` names the memory
    order of the result: ``"tap,i,u"`` (a ``[kH kW L_out, L_in]`` matrix), ``"i,u,tap"`` or
    ``"i,tap,u"`` (``[L_out, ., .]`` stacks of per-position matrices), each contiguous.
    """
    def axis(a: _Axis, k: int) -> torch.Tensor:
        b = torch.zeros(k, a.n_out_c, a.n_in_c, dtype=torch.float64)
        for first, stop, kind in a.blocks:
            for big_i in range(first, stop):
                for p, row in enumerate(a.tables[kind]):
                    for mi, coef in enumerate(row):
                        u = a.stride * big_i + mi - a.left
                        if coef and 0 <= u < a.n_in_c:
                            b[p, big_i, u] += coef
        return b

    t = torch.einsum("piu,qjv->pqijuv", axis(ah, kh), axis(aw, kw))
    t = t.reshape(kh * kw, ah.n_out_c * aw.n_out_c, ah.n_in_c * aw.n_in_c)
    dims = {"tap,i,u": (0, 1, 2), "i,u,tap": (1, 2, 0), "i,tap,u": (1, 0, 2)}[order]
    t = t.permute(dims).contiguous().to(dtype=dtype, device=device)
    return t.view(-1, t.shape[2]) if order == "tap,i,u" else t


def _dense_backward(gy: torch.Tensor, x_pooled: torch.Tensor | None, weight: torch.Tensor | None,
                    x_shape: tuple[int, ...], w_shape: tuple[int, ...], ah: _Axis, aw: _Axis,
                    groups: int, radius: int, needs: tuple[bool, bool, bool], x_channels_last: bool,
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dW, dbias)`` of a small map with GEMMs (dense or depthwise conv), pooling included.

    Dense: ``G`` (pooled ``dL/dy``) is stored ``[H_o' W_o' N, O]`` (patch-major, so one GEMM pools
    an NCHW gradient) and ``Z[K, C kH kW]``, ``K = H_o' W_o' N``, holds per kernel tap the patch-mean
    input it reads (``Z[I] = X T[I]^T``, one batched GEMM over ``I``). Then ``dW = G^T Z`` and
    ``dZ = G W`` are single GEMMs on contiguous operands in the weight's own layout, and
    ``dX = sum_I dZ[I] T[I]``. 1x1 stride-1 convs on whole patches have ``T = r^2 I``, so ``Z`` is the
    pooled input itself, saved as ``[H' W' N, C]``. Depthwise: contract the batch first,
    ``R[c] = G[c] X[c]^T`` (``H_o'W_o' x H'W'``), then ``dW[c] = T . R[c]`` and
    ``dX[c] = (W[c] . T)^T G[c]``, which never builds the ``kH kW`` times larger ``Z``.
    """
    need_x, need_w, need_b = needs
    n, c, h, w = x_shape
    o, _, kh, kw = w_shape
    taps, l_out, l_in = kh * kw, ah.n_out_c * aw.n_out_c, ah.n_in_c * aw.n_in_c
    count = _patch_counts(gy.shape[2], gy.shape[3], radius, gy.dtype, gy.device).view(l_out)
    gx = gw = gb = None
    if groups > 1:  # depthwise (the caller routes other grouped convs to convolutions)
        g = _pool_dense(gy, radius, spatial_major=False)  # [N, C, L_out]
        if need_b:  # sum of dL/dy = sum over patches of n_I * G[I]: exact, read from the small map
            gb = g.sum(0) @ count
        if not (need_x or need_w):
            return None, None, gb
        tap = _tap_matrix(ah, aw, kh, kw, gy.dtype, gy.device).view(taps, l_out * l_in)
        if need_w:
            r = torch.bmm(g.permute(1, 2, 0), x_pooled.permute(1, 0, 2))  # [C, L_out, L_in]
            gw = (r.view(c, l_out * l_in) @ tap.T).view(w_shape)
        if need_x:
            k = (weight.reshape(c, taps) @ tap).view(c, l_out, l_in)
            gxc = torch.bmm(g.permute(1, 0, 2), k)  # [C, N, L_in]
            gx = _unpool_dense(gxc.transpose(0, 1), h, w, radius, x_channels_last)
        return gx, gw, gb
    g = _pool_dense(gy, radius, spatial_major=True).view(l_out * n, o)  # [K, O]
    if need_b:
        gb = count.repeat_interleave(n) @ g
    if not (need_x or need_w):
        return None, None, gb
    scale = _identity_scale(ah, aw, kh, kw)
    if scale is not None:  # 1x1 stride 1 on whole patches: T = r^2 I, so Z is the pooled input
        g = g * scale
    z = None
    if need_w:
        if scale is not None:
            z = x_pooled.view(l_in * n, c)  # saved as [L_in, N, C]
        else:  # Z[I] = X T[I]^T: [N C, L_in] x [L_in, kH kW] for each coarse output position I
            t_w = _tap_matrix(ah, aw, kh, kw, gy.dtype, gy.device, "i,u,tap")
            z = torch.bmm(x_pooled.view(n * c, l_in).expand(l_out, n * c, l_in), t_w)
            z = z.view(l_out * n, c * taps)
        gw = (g.T @ z).view(w_shape)
    if need_x:
        # [K, C kH kW], memory order I, N, C, taps; written into Z's buffer when Z is ours (no new pages)
        out = z if z is not None and scale is None else None
        gz = torch.mm(g, weight.reshape(o, c * taps), out=out)
        if scale is not None:  # [L_in, N, C] read as [N, C, L_in]
            gxc = gz.view(l_in, n, c).permute(1, 2, 0)
        else:  # dX = sum_I dZ[I] T[I]: a few small GEMMs, no copy of dZ
            t_x = _tap_matrix(ah, aw, kh, kw, gy.dtype, gy.device, "i,tap,u")
            gz = gz.view(l_out, n * c, taps)
            gxc = torch.mm(gz[0], t_x[0])
            for big_i in range(1, l_out):
                gxc.addmm_(gz[big_i], t_x[big_i])
            gxc = gxc.view(n, c, l_in)
        gx = _unpool_dense(gxc, h, w, radius, x_channels_last)
    return gx, gw, gb


@functools.lru_cache(maxsize=1024)
def _identity_scale(ah: _Axis, aw: _Axis, kh: int, kw: int) -> float | None:
    """``c`` when the tap matrix is ``c`` times the identity (1x1 stride-1 convs on whole patches)."""
    one_tap = kh == kw == 1 and len(ah.blocks) == len(aw.blocks) == 1 and ah.k_c == aw.k_c == 1
    if not (one_tap and ah.left == aw.left == 0 and ah.stride == aw.stride == 1
            and ah.n_in_c == ah.n_out_c and aw.n_in_c == aw.n_out_c):
        return None
    return float(ah.tables[0][0][0] * aw.tables[0][0][0])


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
