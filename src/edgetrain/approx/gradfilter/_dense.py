"""The small-map backward of gradient filtering: pooling, GEMMs on the coarse maps, unpooling.

Coarse maps of a few dozen positions (the last layers of a CNN) leave convolution kernels with little to
vectorise, so here every step is a matrix product on contiguous or plainly strided operands (MKL reads
transposed and batch-strided matrices in place, so no step copies an operand), or one of the native
kernels of :mod:`._native`:

* pooling and unpooling run natively (one pass each) where the kernels are available; otherwise pooling
  is a product with the patch-mean matrix ``M`` (``[L, H W]``) and unpooling a product with its
  transpose. For a conv whose tap matrix is ``s`` times the identity (1x1 stride-1 on whole patches) the
  output gradient is pooled with scale ``s`` (patch *sums*), which folds that scale in for free;
* the tap matrix ``T`` (:func:`tap_matrix`, built from the ``A`` tables of
  :func:`~edgetrain.approx.gradfilter._impl.coarse_geometry`) gathers, per kernel tap, the patch means
  each tap reads.

Three shapes of conv, each with the operand layouts that make its GEMMs single calls:

* 1x1 convs (:func:`_pointwise_backward`): the pooled maps are stored ``G[O, K]`` and ``Z[K, C]`` with
  ``K = (n, I)``, where ``Z = T X`` is what each coarse output reads (the forward saves ``Z``, which has
  a quarter of ``X``'s positions on a stride-2 shortcut; ``X`` itself when ``T`` is ``s`` times the
  identity), so ``dW = G Z`` is one GEMM and ``dX = unpool(T^T (G^T W))``.
* Other dense convs (:func:`_taps_backward`): ``Z[K, C kH kW]`` holds the patch means every tap reads
  (``K = (I, n)``), ``dW = G^T Z``, ``dZ = G W`` and ``dX = sum_I dZ[I] T[I]``.
* Depthwise convs: natively (:func:`_depthwise_native`) the pooled maps are stored channels-innermost and
  both gradients are sums over the coarse kernel taps, vectorised over blocks of channels; otherwise
  (:func:`_depthwise_backward`) per channel ``R[c] = G[c] X[c]^T``, ``dW[c] = T . R[c]`` and
  ``dX[c] = (W[c] . T)^T G[c]``. Both unpool into the input gradient.

Memory: the full-size input gradient is allocated first and, until the last step writes it, holds the
pooled ``dL/dy`` (and the depthwise ``R`` and folded kernels) as scratch, so the backward takes no more
fresh memory than exact backward does; a caching allocator (edgetrain's pool) then serves it without
page faults. What remains is bound by memory traffic on these shapes: the full-size ``dL/dy`` is read
once (pooling) and the full-size ``dL/dx`` written once, as in exact backward.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ...batch import is_channels_last
from . import _native as native

if TYPE_CHECKING:
    from ._axis import _Axis


@functools.lru_cache(maxsize=256)
def patch_matrix(h: int, w: int, radius: int, dtype: torch.dtype, device: torch.device,
                 scale: float = 1.0) -> torch.Tensor:
    """``M[(U, V), (u, v)] = scale / (n_U n_V)`` when ``(u, v)`` is in patch ``(U, V)``, else 0.

    Args:
        h: map height.
        w: map width.
        radius: patch side.
        dtype: dtype of the result.
        device: device of the result.
        scale: factor on every entry (``r^2`` gives patch sums on whole patches).

    Returns:
        ``[ceil(h/r) ceil(w/r), h w]``.
    """
    hc, wc = -(-h // radius), -(-w // radius)
    m_h = torch.zeros(hc, h, dtype=torch.float64)
    m_h[torch.arange(h) // radius, torch.arange(h)] = 1.0
    m_w = torch.zeros(wc, w, dtype=torch.float64)
    m_w[torch.arange(w) // radius, torch.arange(w)] = 1.0
    m_h /= m_h.sum(1, keepdim=True)
    m_w /= m_w.sum(1, keepdim=True)
    return (torch.kron(m_h, m_w) * scale).to(dtype=dtype, device=device)


@functools.lru_cache(maxsize=256)
def patch_counts(h: int, w: int, radius: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Real positions ``n_U n_V`` in each patch of an ``h x w`` map.

    Args:
        h: map height.
        w: map width.
        radius: patch side.
        dtype: dtype of the result.
        device: device of the result.

    Returns:
        ``[ceil(h/r), ceil(w/r)]``.
    """
    count_h = [min(radius, h - radius * i) for i in range(-(-h // radius))]
    count_w = [min(radius, w - radius * j) for j in range(-(-w // radius))]
    return torch.outer(torch.tensor(count_h, dtype=torch.float64),
                       torch.tensor(count_w, dtype=torch.float64)).to(dtype=dtype, device=device)


@functools.lru_cache(maxsize=1024)
def tap_matrix(ah: _Axis, aw: _Axis, kh: int, kw: int, dtype: torch.dtype, device: torch.device,
               order: str = "tap,i,u") -> torch.Tensor:
    """``T[(p, q, I, J), (U, V)]``: how often tap ``(p, q)`` at coarse output ``(I, J)`` reads ``X[U, V]``.

    ``T[p, q, I, J, U, V] = A_h(I)[p, U - s*I] * A_w(J)[q, V - s*J]`` (``A`` per patch row, so partial
    edge patches are exact); reads of the zero padding have no column.

    Args:
        ah: coarse geometry of the height axis.
        aw: coarse geometry of the width axis.
        kh: kernel height.
        kw: kernel width.
        dtype: dtype of the result.
        device: device of the result.
        order: memory order of the result: ``"tap,i,u"`` (a ``[kH kW L_out, L_in]`` matrix),
            ``"i,u,tap"`` or ``"i,tap,u"`` (``[L_out, ., .]`` stacks of per-position matrices).

    Returns:
        The contiguous matrix or stack.
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


@functools.lru_cache(maxsize=1024)
def identity_scale(ah: _Axis, aw: _Axis, kh: int, kw: int) -> float | None:
    """``s`` when the tap matrix is ``s`` times the identity (1x1 stride-1 convs on whole patches).

    Args:
        ah: coarse geometry of the height axis.
        aw: coarse geometry of the width axis.
        kh: kernel height.
        kw: kernel width.

    Returns:
        ``s``, or None for any other tap matrix.
    """
    one_tap = kh == kw == 1 and len(ah.blocks) == len(aw.blocks) == 1 and ah.k_c == aw.k_c == 1
    if not (one_tap and ah.left == aw.left == 0 and ah.stride == aw.stride == 1
            and ah.n_in_c == ah.n_out_c and aw.n_in_c == aw.n_out_c):
        return None
    return float(ah.tables[0][0][0] * aw.tables[0][0][0])


def pool_map(x: torch.Tensor, radius: int, layout: str, scale: float = 1.0,
             scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Patch means of a small map: one native pass, or one (batched) GEMM with :func:`patch_matrix`.

    Args:
        x: ``[N, C, H, W]``, stored NCHW or channels-last (anything else is made contiguous).
        radius: patch side.
        layout: ``"sample"`` (``[N, L, C]``: sample, patch, channel), ``"channel"`` (``[N, C, L]``),
            ``"major"`` (``[C, N, L]``) or ``"spatial"`` (``[L, N, C]``).
        scale: factor on every mean.
        scratch: memory to write the result into (a contiguous tensor of at least ``N C L`` elements),
            else None.

    Returns:
        The pooled map, contiguous in the order named.
    """
    n, c, h, w = x.shape
    lc = -(-h // radius) * -(-w // radius)
    shape = {"sample": (n, lc, c), "channel": (n, c, lc), "spatial": (lc, n, c), "major": (c, n, lc)}[layout]
    out = None if scratch is None else scratch.view(-1)[:n * c * lc].view(shape)
    if layout != "spatial" and native.available(x):
        out = torch.empty(shape, dtype=x.dtype) if out is None else out
        strides = {"sample": (lc * c, 1, c), "channel": (c * lc, lc, 1), "major": (lc, n * lc, 1)}[layout]
        native.pool_into(x, radius, out, strides, scale)  # strides of (n, c, l) in out
        return out
    if layout == "major":
        pooled = pool_map(x, radius, "channel", scale)
        return pooled.transpose(0, 1).contiguous() if out is None else out.copy_(pooled.transpose(0, 1))
    m = patch_matrix(h, w, radius, x.dtype, x.device, scale)  # [L, HW]
    hw = h * w
    if is_channels_last(x):
        flat = x.permute(0, 2, 3, 1).reshape(n, hw, c)  # a view: memory order N, H, W, C
        if layout == "sample":
            return torch.bmm(m.expand(n, lc, hw), flat, out=out)
        if layout == "spatial":  # the transposing copy is of the small pooled map
            return torch.bmm(m.expand(n, lc, hw), flat).transpose(0, 1).contiguous()
        return torch.bmm(flat.transpose(1, 2), m.T.expand(n, hw, lc))
    flat = x.contiguous().view(n * c, hw)
    if layout == "sample":
        return torch.bmm(m.expand(n, lc, hw), flat.view(n, c, hw).transpose(1, 2), out=out)
    if layout == "spatial":
        return torch.mm(m, flat.T, out=None if out is None else out.view(lc, n * c)).view(lc, n, c)
    return torch.mm(flat, m.T, out=None if out is None else out.view(n * c, lc)).view(n, c, lc)


def _scratch(gx: torch.Tensor | None, numel: int, offset: int = 0) -> torch.Tensor | None:
    """Part of ``dx``'s memory as scratch until ``dx`` is written (None if it is too small or absent)."""
    if gx is None or offset + numel > gx.numel():
        return None
    return gx.as_strided((numel,), (1,), gx.storage_offset() + offset)


def dense_backward(gy: torch.Tensor, x_pooled: torch.Tensor | None, weight: torch.Tensor | None,
                   x_shape: tuple[int, ...], w_shape: tuple[int, ...], ah: _Axis, aw: _Axis, groups: int,
                   radius: int, needs: tuple[bool, bool, bool], x_channels_last: bool, layout: str,
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dW, dbias)`` of a dense or depthwise conv on a small map (see the module docstring).

    Args:
        gy: ``dL/dy``, ``[N, O, H_o, W_o]`` (NCHW or channels-last).
        x_pooled: the input pooled by :func:`pool_map` in ``layout`` (None when ``dW`` is not needed); for
            1x1 convs whose tap matrix is not ``s I``, ``T X`` (``[N, L_out, C]``).
        weight: the weight (None when ``dx`` is not needed).
        x_shape: input shape.
        w_shape: weight shape.
        ah: coarse geometry of the height axis.
        aw: coarse geometry of the width axis.
        groups: 1 or the channel count (depthwise).
        radius: patch side.
        needs: whether ``dx``, ``dW`` and ``dbias`` are needed.
        x_channels_last: whether the input was stored channels-last (``dx`` is stored the same way).
        layout: the layout :func:`saved_layout` chose in the forward.

    Returns:
        The three gradients, None where not needed.
    """
    gx = None
    if needs[0]:  # the full-size result first, so the small intermediates cannot take its cached block
        gx = torch.empty(x_shape, dtype=gy.dtype, device=gy.device,
                         memory_format=torch.channels_last if x_channels_last else torch.contiguous_format)
    if groups > 1:
        native_ok = native.available(gy) and (x_pooled is None or layout == "sample")
        backward = _depthwise_native if native_ok else _depthwise_backward
    elif w_shape[2] == w_shape[3] == 1:
        backward = _pointwise_backward
    else:
        backward = _taps_backward
    gw, gb = backward(gy, x_pooled, weight, gx, w_shape, ah, aw, radius, needs)
    return gx, gw, gb


def saved_layout(x: torch.Tensor, w_shape: tuple[int, ...], groups: int) -> str:
    """The :func:`pool_map` layout :func:`dense_backward` reads the pooled input in.

    Args:
        x: the input.
        w_shape: weight shape.
        groups: 1 or the channel count (depthwise).

    Returns:
        ``"sample"`` for dense 1x1 convs and, where the native kernels run, depthwise convs; else
        ``"channel"``.
    """
    if groups == 1:
        return "sample" if w_shape[2] == w_shape[3] == 1 else "channel"
    return "sample" if native.available(x) else "channel"


def _pointwise_backward(gy, x_pooled, weight, gx, w_shape, ah, aw, radius, needs):
    """1x1 convs: ``dW = G Z`` with ``Z = T X`` and ``dX = unpool(T^T (G^T W))``, ``K = (n, I)``."""
    _, need_w, need_b = needs
    n, o = gy.shape[:2]
    c = w_shape[1]
    l_out = ah.n_out_c * aw.n_out_c
    scale = identity_scale(ah, aw, 1, 1)
    g = pool_map(gy, radius, "major", scale or 1.0, _scratch(gx, n * l_out * o)).view(o, n * l_out)  # [O, K]
    gb = gw = None
    if need_b:  # sum of dL/dy = sum over patches of n_I * G[I] (G holds patch sums when scaled)
        count = patch_counts(gy.shape[2], gy.shape[3], radius, gy.dtype, gy.device).view(l_out)
        gb = g.sum(1) if scale else g.view(o, n, l_out).sum(1) @ count
    if need_w:  # the forward saved Z = T X, what each coarse output reads (X itself when T = s I)
        gw = (g @ x_pooled.reshape(-1, c)).view(w_shape)
    if gx is not None:
        d = (g.T @ weight.view(o, c)).view(n, l_out, c)  # G^T W
        if not scale:  # back to the coarse input grid
            d = torch.matmul(tap_matrix(ah, aw, 1, 1, gy.dtype, gy.device).T, d)  # [N, L_in, C]
        unpool_map(d.transpose(1, 2), radius, gx)
    return gw, gb


def _taps_backward(gy, x_pooled, weight, gx, w_shape, ah, aw, radius, needs):
    """Dense convs with several taps: ``Z = X T^T`` per coarse output, ``dW = G^T Z``, ``dZ = G W``."""
    _, need_w, need_b = needs
    n = gy.shape[0]
    o, c, kh, kw = w_shape
    taps, l_out = kh * kw, ah.n_out_c * aw.n_out_c
    g = pool_map(gy, radius, "spatial", scratch=_scratch(gx, l_out * n * o)).view(l_out * n, o)  # [K, O]
    gb = None
    if need_b:  # sum of dL/dy = sum over patches of n_I * G[I]: exact, read from the small map
        count = patch_counts(gy.shape[2], gy.shape[3], radius, gy.dtype, gy.device).view(l_out)
        gb = count.repeat_interleave(n) @ g
    z = gw = None
    if need_w:  # Z[I] = X T[I]^T: [N C, L_in] x [L_in, kH kW] for each coarse output position I
        t_w = tap_matrix(ah, aw, kh, kw, gy.dtype, gy.device, "i,u,tap")
        z = torch.bmm(x_pooled.view(n * c, -1).expand(l_out, -1, -1), t_w).view(l_out * n, c * taps)
        gw = (g.T @ z).view(w_shape)
    if gx is not None:  # [K, C kH kW], order I, N, C, taps; written into Z's buffer when there is one
        gz = torch.mm(g, weight.reshape(o, c * taps), out=z).view(l_out, n * c, taps)
        t_x = tap_matrix(ah, aw, kh, kw, gy.dtype, gy.device, "i,tap,u")
        gxc = torch.mm(gz[0], t_x[0])  # dX = sum_I dZ[I] T[I]: a few small GEMMs, no copy of dZ
        for big_i in range(1, l_out):
            gxc.addmm_(gz[big_i], t_x[big_i])
        unpool_map(gxc.view(n, c, -1), radius, gx)
    return gw, gb


def _depthwise_backward(gy, x_pooled, weight, gx, w_shape, ah, aw, radius, needs):
    """Per channel ``R[c] = G[c] X[c]^T``, ``dW[c] = T . R[c]``, ``dX[c] = (W[c] . T)^T G[c]``."""
    _, need_w, need_b = needs
    c, _, kh, kw = w_shape
    taps, l_out, l_in = kh * kw, ah.n_out_c * aw.n_out_c, ah.n_in_c * aw.n_in_c
    n = gy.shape[0]
    g = pool_map(gy, radius, "channel", scratch=_scratch(gx, n * c * l_out))  # [N, C, L_out]
    gb = gw = None
    if need_b:  # sum of dL/dy = sum over patches of n_I * G[I]: exact, read from the small map
        gb = g.sum(0) @ patch_counts(gy.shape[2], gy.shape[3], radius, gy.dtype, gy.device).view(l_out)
    tap = tap_matrix(ah, aw, kh, kw, gy.dtype, gy.device).view(taps, l_out * l_in)
    buf = _scratch(gx, c * l_out * l_in, g.numel())  # R, then the folded kernels: in dx's memory too
    if need_w:
        r = torch.bmm(g.permute(1, 2, 0), x_pooled.permute(1, 0, 2),
                      out=None if buf is None else buf.view(c, l_out, l_in))  # [C, L_out, L_in]
        buf = r.view(-1)
        gw = (r.view(c, l_out * l_in) @ tap.T).view(w_shape)
    if gx is not None:
        k = torch.mm(weight.reshape(c, taps), tap, out=None if buf is None else buf.view(c, -1))
        gxc = torch.bmm(g.permute(1, 0, 2), k.view(c, l_out, l_in))  # [C, N, L_in]
        unpool_map(gxc.transpose(0, 1), radius, gx)
    return gw, gb


def _depthwise_native(gy, x_pooled, weight, gx, w_shape, ah, aw, radius, needs):
    """Depthwise convs with the native kernels: pool, sums over coarse taps by blocks of channels, unpool."""
    _, need_w, need_b = needs
    c, _, kh, kw = w_shape
    n = gy.shape[0]
    l_out, l_in = ah.n_out_c * aw.n_out_c, ah.n_in_c * aw.n_in_c
    entries = native.depthwise_entries(ah, aw, kh, kw)
    w = weight if gx is not None else None
    fused = native.plane_rows(gy) and (gx is None or native.plane_rows(gx))
    if fused or not (need_w or gx is not None):  # one pass: pool, sums, unpool
        gb = gy.sum((0, 2, 3)) if need_b else None  # exact; the fused pass keeps no pooled copy to sum
        if not (need_w or gx is not None):
            return None, gb
        gw = native.depthwise_fused(gy, x_pooled if need_w else None, w, entries, gx, radius)
        return (gw.view(w_shape) if need_w else None), gb
    g = pool_map(gy, radius, "sample", scratch=_scratch(gx, n * l_out * c))  # [N, L_out, C]
    gb = None
    if need_b:  # sum of dL/dy = sum over patches of n_I * G[I]: exact, read from the small map
        gb = patch_counts(gy.shape[2], gy.shape[3], radius, gy.dtype, gy.device).view(l_out) @ g.sum(0)
    gw, dxc = native.depthwise_sums(g, x_pooled if need_w else None, w, entries, l_in)
    if gx is not None:
        unpool_map(dxc.transpose(1, 2), radius, gx)
    return (gw.view(w_shape) if need_w else None), gb


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    """``[N, H W, C]`` view of a channels-last ``[N, C, H, W]`` tensor."""
    n, c, h, w = t.shape
    return t.permute(0, 2, 3, 1).view(n, h * w, c)


def unpool_map(t: torch.Tensor, radius: int, out: torch.Tensor) -> None:
    """Adjoint of patch-mean pooling, ``out[u] = t[U] / n_U``, by one GEMM that writes ``out``.

    Args:
        t: ``[N, C, L]`` (any strides).
        radius: patch side.
        out: ``[N, C, H, W]``, stored NCHW or channels-last.
    """
    if native.available(t, out):
        native.unpool(t, radius, out)
        return
    n, c, lc = t.shape
    h, w = out.shape[2:]
    m = patch_matrix(h, w, radius, t.dtype, t.device)  # [L, HW]
    if is_channels_last(out):  # [N, HW, C] = M^T [HW, L] @ t^T [L, C]
        torch.bmm(m.T.expand(n, h * w, lc), t.transpose(1, 2), out=_nhwc(out))
    elif t.stride(0) == c * t.stride(1):  # samples and channels merge into one GEMM dimension
        torch.mm(t.reshape(n * c, lc), m, out=out.view(n * c, h * w))
    else:
        torch.bmm(t, m.expand(n, lc, h * w), out=out.view(n, c, h * w))
