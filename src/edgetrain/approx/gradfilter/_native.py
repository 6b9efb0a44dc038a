"""Native kernels for gradient filtering's memory-bound steps (pooling, unpooling, the depthwise sums).

What is left of a filtered backward once its multiply-adds are ``r^2`` fewer is reading the full-size
``dL/dy`` once to pool it and writing the full-size ``dL/dx`` once. PyTorch has no operator that does either
at memory speed on small planes: ``avg_pool2d`` is far from memory speed there, strided copies are slower
still, and the GEMM with a patch-mean matrix that :mod:`._dense` uses does 16x more arithmetic
than the sums (r = 2). ``_native.c`` does them in one pass each, with SIMD vectors (plane loops
specialised for common widths), and the depthwise backward as vectorised sums over the coarse kernel taps
for blocks of 64 channels; for NCHW gradients that backward is one pass (pool, sums, unpool) per block,
with the pooled maps in L1-sized buffers (the speed-ups are measured in ``bench/RESULTS_GRADFILTER.md``).

The library is compiled on first use with the system's C compiler (``$CC``, else ``gcc``, ``cc`` or
``clang``; GCC 12 or newer, or Clang) with ``-O3 -march=native`` and OpenMP where they work, cached like
the tensor pool (:mod:`edgetrain.native`), and loaded with ctypes. Without a compiler, or with
``EDGETRAIN_NATIVE=0``, every caller falls back to the PyTorch formulation, which gives the same results
(tested), more slowly; the first fallback is logged once.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ... import settings
from ...native import NativeLibrary

if TYPE_CHECKING:
    from ._axis import _Axis

__all__ = ["available", "pool", "pool_into", "unpool", "depthwise_sums", "depthwise_fused", "depthwise_entries", "plane_rows"]


_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_NATIVE = NativeLibrary(
    Path(__file__).with_name("_native.c"), "libedgetrain_gradfilter", "gradient filtering's native kernels",
    {"et_pool": [_PTR, _PTR] + [_I64] * 5 + [_F32] + [_I64] * 7 + [_INT],
     "et_unpool": [_PTR, _PTR] + [_I64] * 5 + [_F32] + [_I64] * 7 + [_INT],
     "et_dw_core": [_PTR] * 6 + [_I64] * 6 + [_PTR] * 6 + [_INT],
     "et_dw_fused": [_PTR] * 6 + [_I64] * 15 + [_PTR] * 6 + [_INT]},
    "using the PyTorch formulation, which gives the same gradients more slowly")


def available(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels can run on these tensors (float32 on the CPU) in this process.

    ``EDGETRAIN_NATIVE=0`` turns them off; the first call compiles the library.

    Args:
        *tensors: the tensors a kernel would read or write.

    Returns:
        True when the kernels are usable for them.
    """
    if _NATIVE.failed is not None or not settings.native_enabled():
        return False
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    return _NATIVE.get() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise MemoryError(f"{what}: the native kernel could not allocate its small work buffers")


def pool(x: torch.Tensor, radius: int, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``out[n, c, l] = scale * mean of x[n, c]`` over patch ``l`` (ceil mode), in one pass.

    Args:
        x: ``[N, C, H, W]``, any strides.
        radius: patch side.
        out: ``[N, C, L]`` with ``L = ceil(H/r) ceil(W/r)``, any (non-overlapping) strides; written whole.
        scale: factor on every mean.

    Returns:
        ``out``.
    """
    return pool_into(x, radius, out, out.stride(), scale)


def pool_into(x: torch.Tensor, radius: int, out: torch.Tensor, strides: tuple[int, int, int],
              scale: float = 1.0) -> torch.Tensor:
    """:func:`pool` into ``out``'s memory, addressed by the ``(n, c, l)`` strides given.

    Args:
        x: ``[N, C, H, W]``, any strides.
        radius: patch side.
        out: the tensor whose memory is written (every element its strides address).
        strides: element strides of sample, channel and patch in ``out``.
        scale: factor on every mean.

    Returns:
        ``out``.
    """
    n, c, h, w = x.shape
    _check(_NATIVE.lib.et_pool(x.data_ptr(), out.data_ptr(), n, c, h, w, radius, scale, *x.stride(), *strides,
                               torch.get_num_threads()), "pooling")
    return out


def unpool(t: torch.Tensor, radius: int, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Adjoint of :func:`pool`: ``out[n, c, h, w] = scale * t[n, c, l] / n_l`` for ``(h, w)`` in patch ``l``.

    Args:
        t: ``[N, C, L]``, any strides.
        radius: patch side.
        out: ``[N, C, H, W]``, any (non-overlapping) strides; written whole.
        scale: factor on every value.

    Returns:
        ``out``.
    """
    n, c, h, w = out.shape
    _check(_NATIVE.lib.et_unpool(t.data_ptr(), out.data_ptr(), n, c, h, w, radius, scale, *t.stride(),
                                 *out.stride(), torch.get_num_threads()), "unpooling")
    return out


@functools.lru_cache(maxsize=256)
def depthwise_entries(ah: _Axis, aw: _Axis, kh: int, kw: int) -> tuple[torch.Tensor, ...]:
    """The coarse taps of a depthwise conv as entries ``(slot, out, in)`` and each slot's fold row.

    A slot is one coarse kernel tap ``(m_h, m_w)`` of one kind of patch row and column (the ``A`` tables
    differ only for partial edge patches). ``fold[slot, (p, q)] = A_h[p, m_h] A_w[q, m_w]`` turns the
    slots' sums into the ``kH x kW`` weight gradient, and the weights into coarse kernels.

    Args:
        ah: the height axis's coarse geometry (:func:`~._impl.coarse_geometry`).
        aw: the width axis's.
        kh: kernel rows.
        kw: kernel columns.

    Returns:
        ``(fold [S, kH kW] float32, wo, wi, woff, xs, xo, xoff)``: the entries sorted by slot (output and
        input positions, slot offsets) and by input position (slots, output positions, position offsets).
    """
    def kinds(a: _Axis) -> list[int]:
        out = [0] * a.n_out_c
        for first, stop, kind in a.blocks:
            out[first:stop] = [kind] * (stop - first)
        return out

    kinds_h, kinds_w = kinds(ah), kinds(aw)
    slots: dict[tuple[int, int, int, int], int] = {}
    entries = []
    for i in range(ah.n_out_c):
        for mi in range(ah.k_c):
            u = ah.stride * i + mi - ah.left
            if not 0 <= u < ah.n_in_c:
                continue
            for j in range(aw.n_out_c):
                for mj in range(aw.k_c):
                    v = aw.stride * j + mj - aw.left
                    if 0 <= v < aw.n_in_c:
                        slot = slots.setdefault((kinds_h[i], kinds_w[j], mi, mj), len(slots))
                        entries.append((slot, i * aw.n_out_c + j, u * aw.n_in_c + v))
    fold = torch.zeros(len(slots), kh * kw, dtype=torch.float64)
    for (kind_h, kind_w, mi, mj), slot in slots.items():
        col_h = torch.tensor([row[mi] for row in ah.tables[kind_h]], dtype=torch.float64)
        col_w = torch.tensor([row[mj] for row in aw.tables[kind_w]], dtype=torch.float64)
        fold[slot] = torch.outer(col_h, col_w).flatten()
    e = torch.tensor(entries, dtype=torch.int64).view(-1, 3)
    by_slot = e[torch.argsort(e[:, 0] * (e[:, 2].max() + 1) + e[:, 2], stable=True)]
    by_in = e[torch.argsort(e[:, 2] * (e[:, 0].max() + 1) + e[:, 0], stable=True)]
    n_in = ah.n_in_c * aw.n_in_c
    woff = torch.zeros(len(slots) + 1, dtype=torch.int64)
    woff[1:] = torch.bincount(e[:, 0], minlength=len(slots)).cumsum(0)
    xoff = torch.zeros(n_in + 1, dtype=torch.int64)
    xoff[1:] = torch.bincount(e[:, 2], minlength=n_in).cumsum(0)
    return (fold.float(), by_slot[:, 1].contiguous(), by_slot[:, 2].contiguous(), woff,
            by_in[:, 0].contiguous(), by_in[:, 1].contiguous(), xoff)


def depthwise_sums(g: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor | None,
                   entries: tuple[torch.Tensor, ...], n_in: int,
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The depthwise backward on pooled maps, channels innermost.

    Args:
        g: pooled ``dL/dy``, ``[N, L_out, C]`` contiguous.
        x: pooled input, ``[N, L_in, C]`` contiguous (None when ``dW`` is not needed).
        weight: the weight, ``[C, 1, kH, kW]`` (None when ``dx`` is not needed).
        entries: :func:`depthwise_entries` of the conv.
        n_in: ``L_in``.

    Returns:
        ``(dW [C, kH kW] or None, coarse dL/dX [N, L_in, C] or None)``.
    """
    n, l_out, c = g.shape
    dxc = torch.empty(n, n_in, c) if weight is not None else None
    return _depthwise_call(_NATIVE.lib.et_dw_core, g, x, weight, entries, dxc, (n, c, l_out, n_in)), dxc


def plane_rows(t: torch.Tensor) -> bool:
    """Whether each ``[H, W]`` plane of ``t`` has contiguous rows (NCHW-like, not channels-last).

    Channels-last gradients take the three-call path: pooling and unpooling whole channel rows streams
    better than a fused pass over blocks of 64 channels.
    """
    return t.stride(3) == 1 and t.stride(1) != 1 and min(t.stride()) >= 0


def depthwise_fused(gy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor | None,
                    entries: tuple[torch.Tensor, ...], gx: torch.Tensor | None, radius: int,
                    ) -> torch.Tensor | None:
    """:func:`pool`, :func:`depthwise_sums` and :func:`unpool` in one pass over blocks of channels.

    Args:
        gy: ``dL/dy``, ``[N, C, H_o, W_o]`` with :func:`plane_rows`.
        x: pooled input, ``[N, L_in, C]`` contiguous (None when ``dW`` is not needed).
        weight: the weight, ``[C, 1, kH, kW]`` (None when ``dx`` is not needed).
        entries: :func:`depthwise_entries` of the conv.
        gx: the input gradient to write, ``[N, C, H, W]`` with :func:`plane_rows` (None when not needed).
        radius: patch side.

    Returns:
        ``dW`` as ``[C, kH kW]``, or None when ``x`` is None.
    """
    n, c, ho, wo = gy.shape
    h, w = (gx.shape[2:] if gx is not None else (0, 0))
    gx_strides = gx.stride()[:3] if gx is not None else (0, 0, 0)
    return _depthwise_call(_NATIVE.lib.et_dw_fused, gy, x, weight, entries, gx,
                           (n, c, ho, wo, h, w, radius, *gy.stride()[:3], *gx_strides))


def _depthwise_call(kernel, first: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor | None,
                    entries: tuple[torch.Tensor, ...], out: torch.Tensor | None, sizes: tuple[int, ...],
                    ) -> torch.Tensor | None:
    """Call ``et_dw_core`` or ``et_dw_fused``: their shared operands around the ``sizes`` that differ."""
    fold = entries[0]
    slots, taps = fold.shape
    c = sizes[1]
    gw = torch.empty(c, taps) if x is not None else None
    w = None if weight is None else weight.reshape(c, taps).contiguous()
    _check(kernel(first.data_ptr(), _ptr(x), _ptr(w), fold.data_ptr(), _ptr(gw), _ptr(out), *sizes, slots, taps,
                  *(t.data_ptr() for t in entries[1:]), torch.get_num_threads()), "depthwise backward")
    return gw
