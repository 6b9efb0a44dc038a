"""Resident-memory measurement (peak RSS) and the glibc allocator settings edgetrain uses.

The memory budget of a step is measured as the process's peak resident set size (``VmHWM``) minus the
resident size right after ``import torch, edgetrain`` (recorded when this module is first imported).
Linux lets a process reset its ``VmHWM`` to the current RSS by writing ``5`` to ``/proc/self/clear_refs``,
which is how a peak is taken over one region of code.

glibc's malloc keeps freed memory in its heaps and raises its mmap threshold dynamically, so after a large
tensor is freed the next ones may be carved from a heap that never shrinks: resident memory then tracks the
*history* of allocations, not the live bytes. :func:`tune_allocator` fixes the mmap threshold (which also
stops the dynamic raise) so that every tensor above it is its own mapping, returned to the OS when freed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys
from dataclasses import dataclass
from typing import Iterator, TypeVar

from .. import settings

__all__ = [
    "rss_bytes", "peak_rss_bytes", "process_peak_rss_bytes", "reset_peak", "can_reset_peak", "baseline_rss_bytes",
    "tune_allocator", "allocator_tuned", "release_heap", "release_cached", "PeakMeter", "measure_peak",
    "available_bytes",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
# mallopt parameter numbers from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
DEFAULT_MMAP_THRESHOLD_BYTES = 64 * 1024


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS, "rb") as f:
            for line in f:
                if line.startswith(field.encode()):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo (bytes), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes() -> int:
    """Current resident set size of this process in bytes (0 where /proc is unavailable)."""
    kib = _status_kib("VmRSS:")
    if kib is not None:
        return kib * 1024
    try:  # macOS and other Unixes: ru_maxrss is the best available approximation.
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(r if sys.platform == "darwin" else r * 1024)
    except Exception:  # pragma: no cover - no way to read memory at all
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set size (``VmHWM``) in bytes since process start or the last :func:`reset_peak`."""
    kib = _status_kib("VmHWM:")
    if kib is not None:
        return kib * 1024
    return rss_bytes()


_PEAK_BEFORE_RESETS = 0   # the highest VmHWM that reset_peak has wiped from the kernel's counter


def process_peak_rss_bytes() -> int:
    """Peak RSS of this process since it started, across :func:`reset_peak` calls.

    edgetrain resets the kernel's peak (``VmHWM``, which ``resource.getrusage(...).ru_maxrss`` reads too)
    to measure its own runs: ``prepare`` does, and so does :func:`measure_peak`. After that, those two
    report the peak since the last reset only. This returns the lifetime peak: the larger of the current
    ``VmHWM`` and every peak a reset wiped (resets by other code than edgetrain's are not seen).
    """
    return max(_PEAK_BEFORE_RESETS, peak_rss_bytes())


def can_reset_peak() -> bool:
    """Whether :func:`reset_peak` works here (Linux with a writable ``/proc/self/clear_refs``)."""
    return os.access(_CLEAR_REFS, os.W_OK)


def reset_peak() -> bool:
    """Reset the peak RSS to the current RSS. Returns False where the kernel does not allow it.

    With edgetrain's tensor pool installed, its cache is emptied first and its high-water mark restarted,
    so that the region measured from here starts from live tensors only.
    """
    from ..runtime import pool

    global _PEAK_BEFORE_RESETS
    _PEAK_BEFORE_RESETS = max(_PEAK_BEFORE_RESETS, peak_rss_bytes())
    if pool.installed():
        pool.release()
        pool.reset_peak()
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_BASELINE_RSS = rss_bytes()


def baseline_rss_bytes() -> int:
    """RSS recorded when ``import edgetrain`` finished: the zero point of every memory budget."""
    return _BASELINE_RSS


def shift_baseline(delta_bytes: int) -> None:
    """Raise the zero point by ``delta_bytes`` (a forked measurement child takes off what touching its
    parent's pages mapped beyond them; see :func:`edgetrain.profile.fork._settle`)."""
    global _BASELINE_RSS
    _BASELINE_RSS += int(delta_bytes)


def warm_torch_imports() -> None:
    """Load the parts of torch that every training job loads anyway, so they are import cost.

    Constructing any ``torch.optim`` optimizer imports ``torch._dynamo`` (tens of MiB of resident code and
    data); stepping one loads the foreach kernels. Without this, that one-off growth would be charged
    to the first budgeted step.
    """
    import torch

    p = torch.zeros(2, requires_grad=True)
    p.grad = torch.ones(2)
    for opt in (torch.optim.SGD([p], lr=0.0, momentum=0.9), torch.optim.Adam([p], lr=0.0)):
        opt.step()


def record_baseline(release: bool = False) -> int:
    """Record the current RSS as the budget's zero point (``import edgetrain`` calls this last).

    ``release=True`` first hands back the free heap (:func:`release_heap`): after loading data, the loader's
    freed memory sits in the heap, and counted in the zero point it is room the steps reuse unseen, while
    ``prepare``'s analysis counts their growth in full (``edgetrain demo`` after loading MNIST: 65 MiB of free
    heap, a step measured at 91 MiB against the 139 MiB its plan was validated at; released first, 149 against
    148)."""
    global _BASELINE_RSS
    if release:
        release_heap()
    _BASELINE_RSS = rss_bytes()
    return _BASELINE_RSS


_TUNED: int | None = None


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL | None:
    """glibc with ``mallopt`` / ``malloc_trim`` typed, or None (other libc, other OS)."""
    global _LIBC
    if _LIBC is None and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            libc.mallopt.restype = ctypes.c_int
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
            libc.malloc_trim.restype = ctypes.c_int
        except (OSError, AttributeError):
            log.info("glibc mallopt not available; allocator left as it is")
            return None
        _LIBC = libc
    return _LIBC


def tune_allocator(mmap_threshold_bytes: int = DEFAULT_MMAP_THRESHOLD_BYTES) -> bool:
    """Make glibc return freed tensor memory to the OS at once (a process-wide setting).

    Fixes ``M_MMAP_THRESHOLD`` (allocations at or above it get their own mapping, unmapped on free, and the
    threshold no longer grows), lowers ``M_TRIM_THRESHOLD`` so the heap top is trimmed, and serves every
    thread from one heap (:func:`one_arena`). Equivalent to starting the process with
    ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_ARENA_MAX=1``.

    One heap: with more than one intra-op thread, glibc gives each OpenMP worker thread that allocates an
    arena of its own, and what each keeps free is held apart from the others. ``edgetrain train data=mnist
    memory_budget=80MiB`` at two threads measured 82.0-83.2 MiB where its plan was validated at 74.4-77.4
    (the analysing child runs one heap); with one heap, 75.6-76.2.

    Args:
        mmap_threshold_bytes: allocations of at least this many bytes are served by mmap.

    Returns:
        True if the setting took effect (glibc found), False otherwise (other libc, other OS).
    """
    global _TUNED
    if _TUNED == mmap_threshold_bytes:
        return True
    libc = _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_bytes)))
    ok = bool(libc.mallopt(_M_TRIM_THRESHOLD, int(mmap_threshold_bytes) * 2)) and ok
    one_arena()  # arenas threads already hold stay theirs: import edgetrain before the first parallel op
    if ok:
        _TUNED = mmap_threshold_bytes
        log.debug("glibc mmap threshold fixed at %d bytes", mmap_threshold_bytes)
    return ok


def one_arena() -> None:
    """Serve every thread's allocations from one glibc heap (``M_ARENA_MAX=1``). For a forked child that runs
    its work on a new thread: glibc would give that thread an arena of its own, where the parent's main
    thread allocates from the main heap, and the child's readings would not be the parent's."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_ARENA_MAX, 1)


def release_heap() -> None:
    """Hand back to the OS what the process holds free: unreachable Python cycles (``gc.collect``) and
    the free pages of glibc's heaps (``malloc_trim(0)``). ``prepare`` calls it last, so that the heap its
    own bookkeeping left free (page lists for forks, children's answers) is not carried into every step."""
    import gc

    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def release_cached() -> None:
    """:func:`release_heap`, and the tensor pool's cached blocks unmapped: everything a run in this process left
    free, so that the process holds its live memory only."""
    from ..runtime import pool

    pool.release()
    release_heap()


@contextlib.contextmanager
def objects_frozen() -> Iterator[None]:
    """Collect garbage once, then leave every Python object alive now out of later collections
    (``gc.freeze``) until the block ends; nested uses are one.

    Forked children collect garbage before they measure (:func:`release_heap`). A full collection visits
    every tracked object: 150-190 ms with torch imported, more with ``transformers`` or a dataset of Python
    objects, and in a fork it writes each object's header and so copies every page of objects. Collected and
    frozen here first, the children collect only what was made since, and their readings start from the
    same heap. The block's end unfreezes: what died meanwhile is collected as usual. A process that froze
    objects itself (a server's pre-fork ``gc.freeze()``) is left as it is: unfreezing would undo its freeze."""
    import gc

    if not hasattr(gc, "freeze") or gc.get_freeze_count():  # frozen already: an outer block, or the process
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def allocator_tuned() -> bool:
    """Whether :func:`tune_allocator` (or ``MALLOC_MMAP_THRESHOLD_``) is in force in this process."""
    return _TUNED is not None or "MALLOC_MMAP_THRESHOLD_" in os.environ


@dataclass
class PeakMeter:
    """Peak RSS over a region, relative to the RSS at its start (and to the import baseline)."""

    start_rss_bytes: int = 0
    peak_bytes: int = 0
    baseline_bytes: int = 0
    exact: bool = True

    @property
    def delta_bytes(self) -> int:
        """Peak minus RSS at the region's start."""
        return max(0, self.peak_bytes - self.start_rss_bytes)

    @property
    def above_baseline_bytes(self) -> int:
        """Peak minus the RSS recorded at ``import edgetrain`` (what a memory budget bounds)."""
        return max(0, self.peak_bytes - self.baseline_bytes)


@contextlib.contextmanager
def measure_peak() -> Iterator[PeakMeter]:
    """Measure peak RSS over a ``with`` block.

    Example::

        with edgetrain.profile.memory.measure_peak() as m:
            loss = step(x, y)
        print(m.above_baseline_bytes)

    Where the peak cannot be reset (not Linux), ``exact`` is False and the peak is the process's lifetime peak.
    """
    meter = PeakMeter(baseline_bytes=_BASELINE_RSS)
    meter.exact = reset_peak()
    meter.start_rss_bytes = rss_bytes()
    try:
        yield meter
    finally:
        meter.peak_bytes = peak_rss_bytes()


def _tune_at_import() -> None:
    """Tune the allocator when edgetrain is imported, unless ``EDGETRAIN_ALLOCATOR=system``: the low mmap
    threshold, and (``pool``, the default) the tensor pool as PyTorch's CPU allocator.

    Done at import because memory glibc has already retained cannot be given back later: a process that
    trains plainly first and prepares afterwards would carry that retention into every budget. The pool
    comes with it, not at ``prepare``: with the threshold alone, every tensor of 64 KiB or more is mapped
    afresh and page-faulted in, and plain PyTorch code that runs before ``prepare`` (an evaluation, a
    baseline, a model that is only verified) paid that. Plain training steps of a Hugging Face ResNet and of
    MobileNetV2 (batch 32 at 64x64, one thread) took 1.2-1.9x as long after ``import edgetrain`` as
    without it; with the pool, 0.8-1.2x, and their peaks 54-85 MiB lower (bench/RESULTS.md, 2026-12-06).
    The pool is compiled on the first import on a machine (seconds, cached); without a compiler the threshold
    alone stays (a warning says so).
    """
    if settings.allocator() != "system":
        tune_allocator()
        from ..runtime import pool

        pool.install()  # False (and nothing done) under EDGETRAIN_ALLOCATOR=tuned


_tune_at_import()
