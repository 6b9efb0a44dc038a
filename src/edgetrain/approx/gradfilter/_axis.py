"""The coarse geometry of one spatial axis of a filtered convolution (see :mod:`._impl`), as plain data.

Apart from :mod:`._impl`, which computes it, so that the dense and native kernels can name the type
without importing the module that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["_Axis"]


@dataclass(frozen=True)
class _Axis:
    """The coarse geometry of one spatial axis (see :mod:`._impl`)."""

    n_in_c: int                          # H' = ceil(H / r)
    n_out_c: int                         # H_o' = ceil(H_o / r)
    stride: int                          # coarse stride (= the conv's stride)
    k_c: int                             # K' coarse taps
    left: int                            # zero padding before the coarse input (= -m_min)
    length: int                          # padded coarse input length
    blocks: tuple[tuple[int, int, int], ...]  # (first patch row, stop, index into tables)
    tables: tuple[tuple[tuple[int, ...], ...], ...]  # A[p][m] per block kind
    counts: tuple[int, ...]              # n_U: real positions per input patch
