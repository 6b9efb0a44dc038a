"""edgetrain's CPU tensor pool: cached tensor memory whose resident size never exceeds a cap.

glibc gives a training process two bad choices. Its heap keeps freed tensor memory and fragments, so
resident memory follows the history of allocations rather than the live tensors; with a low mmap threshold
every tensor is mapped afresh and page-faulted in, which costs a large share of a CPU step. The pool (``_pool.cpp``, a
``c10::Allocator``) keeps freed blocks of 64 KiB or more mapped and reuses them best-fit: a reused block's
tail stays cached as a block of its own, freed neighbours merge, a request larger than every cached block
grows the largest in place (``mremap``: only the new pages fault), and blocks of 2 MiB or more ask for
transparent huge pages (:func:`huge_pages`). It unmaps cached bytes, only as many as needed, whenever live +
cached bytes would pass its cap: by default the highest live bytes seen (since :func:`reset_peak`), so the
pool never holds more than the peak of live tensors, and never more than an optional cap (a step sets it
from its memory budget). Every block keeps :func:`tail_bytes` mapped past its tensor's end, as malloc's
chunks do: vectorised kernels load whole vectors at a tensor's tail. The measured effect is in
``bench/RESULTS_ADAPT.md`` ("Allocator share", ``python bench/bench_adapt.py --sections fragmentation``).

PyTorch has no Python hook for its CPU allocator, so the pool is C++: compiled on first use with the
system's C++ compiler against the installed torch (seconds, once), cached under ``~/.cache/edgetrain/pool``,
loaded with ctypes and installed with ``c10::SetCPUAllocator``. Without a compiler, edgetrain falls back to
the low mmap threshold (logged once). ``EDGETRAIN_ALLOCATOR=tuned`` (mmap threshold only) or ``system``
turn the pool off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import settings
from ..native import build_library

__all__ = ["PoolStats", "available", "block_bytes", "huge_pages", "install", "installed", "stats", "set_cap", "release",
           "reset_peak", "tail_bytes"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_pool.cpp")
SMALL_BYTES = 64 * 1024  # below this, tensors come from PyTorch's default allocator (glibc's small bins)
_LIB: ctypes.CDLL | None = None
_FAILED: str | None = None
_INSTALLED = False


@dataclass(frozen=True)
class PoolStats:
    """Counters of the pool since it was installed (bytes are page-rounded).

    Attributes:
        live_bytes: bytes of blocks handed out and not yet freed.
        cached_bytes: bytes of freed blocks kept mapped for reuse.
        live_peak_bytes: the highest ``live_bytes`` since the last :func:`reset_peak`.
        hits: allocations served from the cache (no page faults).
        misses: allocations that mapped fresh pages (all of them, or the part a cached block grown in
            place lacked).
        evicted_bytes: cached bytes unmapped to stay under the cap.
        split_bytes: tails split off larger cached blocks that were reused (they stay cached).
    """

    live_bytes: int
    cached_bytes: int
    live_peak_bytes: int
    hits: int
    misses: int
    evicted_bytes: int
    split_bytes: int


def _command(torch_dir: Path) -> Callable[[Path], list[str]]:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    import torch

    abi = int(torch.compiled_with_cxx11_abi())
    return lambda out: [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                        f"-I{torch_dir / 'include'}", str(_SOURCE), f"-L{torch_dir / 'lib'}", "-lc10",
                        f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(out)]


def _load() -> ctypes.CDLL | None:
    """Compile (once per torch build and source) and load the pool library; None if impossible."""
    global _LIB, _FAILED
    if _LIB is not None or _FAILED is not None:
        return _LIB
    try:
        if not sys.platform.startswith("linux"):
            raise RuntimeError("the pool is built for Linux only")
        import torch

        torch_dir = Path(torch.__file__).resolve().parent
        target = build_library(_SOURCE, "pool", "libedgetrain_pool", torch.__version__.encode()
                               + str(torch_dir).encode(), _command(torch_dir), "edgetrain's CPU tensor pool")
        lib = ctypes.CDLL(str(target))
        lib.et_pool_install.argtypes = [ctypes.c_int64, ctypes.c_int]
        lib.et_pool_install.restype = ctypes.c_int
        lib.et_pool_set_cap.argtypes = [ctypes.c_int64]
        lib.et_pool_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        lib.et_pool_block_bytes.argtypes = [ctypes.c_void_p]
        lib.et_pool_block_bytes.restype = ctypes.c_int64
        lib.et_pool_tail_bytes.restype = ctypes.c_int64
        _LIB = lib
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _FAILED = str(e)
        log.warning("edgetrain's CPU tensor pool is unavailable (%s); using glibc with a low mmap threshold, "
                    "which keeps budgets but page-faults every new tensor (slower steps)", e)
    return _LIB


def available() -> bool:
    """Whether the pool can be used here (compiles it on first call)."""
    return _load() is not None


def install() -> bool:
    """Make the pool PyTorch's CPU allocator for the rest of the process (idempotent).

    Tensors allocated before keep their own allocator; nothing is copied.

    Returns:
        True if the pool is in force, False if it is unavailable or turned off by ``EDGETRAIN_ALLOCATOR``.
    """
    global _INSTALLED
    if _INSTALLED:
        return True
    if settings.allocator() != "pool":
        return False
    lib = _load()
    if lib is None:
        return False
    lib.et_pool_install(SMALL_BYTES, int(huge_pages()))
    _INSTALLED = True
    return True


def huge_pages() -> bool:
    """Whether the pool asks for transparent huge pages on blocks of 2 MiB or more (``madvise``).

    A page fault costs more than zeroing its 4 KiB, and a plan that recomputes maps its large blocks again
    and again: huge pages cut the faults by about half at the same peak. ``EDGETRAIN_HUGE_PAGES=0`` turns it off; the kernel ignores it where THP is disabled.
    """
    return settings.huge_pages()


def installed() -> bool:
    """Whether the pool is PyTorch's CPU allocator in this process."""
    return _INSTALLED


#: one array type for every stats() call: ``ctypes.c_int64 * 7`` makes a new type, a reference cycle, each time
#: (a few KiB a step that only the collector's rare full passes freed)
_Stats = ctypes.c_int64 * 7


def stats() -> PoolStats:
    """The pool's counters (all zero when it is not installed)."""
    buf = _Stats()
    if _LIB is not None:
        _LIB.et_pool_stats(buf)
    return PoolStats(*(int(v) for v in buf))


def block_bytes(tensor: Any) -> int:
    """The mapped bytes of the pool's block under ``tensor``'s storage (0 where the pool did not allocate it):
    its size rounded up to pages after :func:`tail_bytes` more."""
    if _LIB is None:
        return 0
    return int(_LIB.et_pool_block_bytes(tensor.untyped_storage().data_ptr()))


def tail_bytes() -> int:
    """Bytes every block keeps mapped past its tensor's end (0 when the pool is not loaded): vectorised kernels
    load whole vectors at a tensor's tail, TorchInductor's CPU code among them (a max-pool over 8 channels read 32
    bytes past its 64 KiB buffer under AVX-512), and a block ending at a page with nothing mapped after it crashed."""
    return 0 if _LIB is None else int(_LIB.et_pool_tail_bytes())


def set_cap(cap_bytes: int | None) -> None:
    """Bound live + cached pool bytes by ``cap_bytes`` as well as by the highest live bytes seen.

    Live bytes are never refused: a cap below them only empties the cache. None removes the cap.
    """
    if _LIB is not None:
        _LIB.et_pool_set_cap(-1 if cap_bytes is None else max(0, int(cap_bytes)))


def release() -> None:
    """Unmap every cached block (resident memory drops to the live tensors)."""
    if _LIB is not None:
        _LIB.et_pool_release()


def reset_peak() -> None:
    """Restart ``live_peak_bytes`` from the live bytes now (the cache shrinks to stay under it)."""
    if _LIB is not None:
        _LIB.et_pool_reset_peak()
