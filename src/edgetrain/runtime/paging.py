"""Paging of tensors saved for backward: out to a page file (CPU) or host memory (CUDA), and back.

A :class:`Pager` installs ``torch.autograd.graph.saved_tensors_hooks``. Inside ``pager.stage(k)`` every
tensor autograd saves is *paged* as part of stage ``k``'s pack: its bytes go to the page file on a
background thread (or, for a synchronous stage, before ``stage`` returns) and autograd keeps only a small
handle. ``pager.page_boundary(k, y)`` adds the storage of stage ``k``'s output ``y`` to that pack, so the
next stage's saves of its input (under ``pager.hooks()``) are paged too. Before backward needs a stage,
``prefetch(k)`` (or the automatic prefetch of the next lower stage when a stage is first unpacked) reads
its pack back; an unpack that finds nothing prefetched reads synchronously. Reads are bit-exact: same
dtype, shape and strides (storage offset 0), values copied byte for byte.

Stays resident (never paged): parameters and views of leaf tensors that require grad, tensors below
``min_bytes``, and non-strided / conjugate / negative-bit tensors. A tensor saved several times (same
storage, offset, shape, strides, dtype and version, the first saved tensor object still alive) is
paged once and comes back as one tensor.

Why a page file with ``pwrite``/``preadv`` and not ``mmap``: a write to a memory-mapped file on a full disk
is a ``SIGBUS`` that kills the process, whereas ``pwrite`` raises ``ENOSPC``, which becomes a
:class:`PagingError`; and mapped pages count in the process's resident memory until evicted.

How a runtime drives it for one micro-batch (a plan's ``page`` stages, ``metadata["async_stages"]``)::

    with pager.hooks():
        for k, stage in enumerate(stages):
            with pager.stage(k, asynchronous=k in async_stages) if policy[k] == "page" else nullcontext():
                x = stage(x)
            if policy[k] == "page" and k + 1 < n:
                pager.page_boundary(k, x)          # drop every other reference to x after stage k+1
            x.register_hook(pager.prefetch_hook(k - 1))   # optional: prefetch one stage ahead
    loss_fn(x, y).backward()
    pager.reset()                                  # before the next micro-batch; close() after the step

Files are named ``edgetrain-pages-<pid>-<token>.bin``; they are removed on :meth:`Pager.close`, when the
pager is garbage-collected and at interpreter exit (``weakref.finalize``); files of processes that no
longer exist are removed when the next pager starts in that directory.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from ..errors import EdgetrainError
from ..units import format_bytes
from ._pagefile import (cleanup, open_page_file, page_dir_or_default, read_all, remove_stale_page_files, work,
                        write_all)

__all__ = ["Pager", "PagingError", "PagerStats", "remove_stale_page_files"]

log = logging.getLogger(__name__)
_ALIGN = 64


class PagingError(EdgetrainError, RuntimeError):
    """Paging saved tensors to storage failed (typically the disk is full)."""


@dataclass(frozen=True)
class PagerStats:
    """Counters of one pager.

    Attributes:
        paged_tensors: tensors written out.
        resident_tensors: saved tensors left resident (parameters, tiny, unsupported).
        written_bytes, read_bytes: bytes moved to and from storage.
        held_bytes: bytes of paged tensors the pager holds in memory now (writes in flight, prefetched
            or unpacked packs not yet released by autograd).
        peak_held_bytes: the largest ``held_bytes`` seen.
        write_wait_s, read_wait_s: seconds the training thread waited for writes / reads.
    """

    paged_tensors: int
    resident_tensors: int
    written_bytes: int
    read_bytes: int
    held_bytes: int
    peak_held_bytes: int
    write_wait_s: float
    read_wait_s: float


class _Entry:
    """One paged tensor (or one storage span shared by identical saves)."""

    __slots__ = ("stage", "key", "dtype", "size", "stride", "span", "nbytes", "offset", "device", "source",
                 "host", "loaded", "writing", "reading", "released", "keep_source")

    def __init__(self, stage: int, key: tuple[Any, ...], t: torch.Tensor, flat: torch.Tensor) -> None:
        self.stage, self.key = stage, key
        self.dtype, self.size, self.stride = t.dtype, tuple(t.shape), tuple(t.stride())
        self.span, self.nbytes = flat.numel(), flat.numel() * flat.element_size()
        self.offset, self.device = -1, t.device
        self.source: torch.Tensor | None = flat          # bytes still in memory (write in flight)
        self.host: torch.Tensor | None = None            # CUDA: pinned host copy
        self.loaded: torch.Tensor | None = None          # read back, until autograd releases the handle
        self.writing = self.reading = self.released = self.keep_source = False


class _Handle:
    """What autograd holds instead of a paged tensor."""

    __slots__ = ("entry", "__weakref__")

    def __init__(self, entry: _Entry) -> None:
        self.entry = entry


class Pager:
    """Pages tensors saved for backward (module doc). Use as a context manager, or call :meth:`close`.

    Args:
        page_dir: directory of the page file (default ``<tmp>/edgetrain-pages``); put it on the storage
            you want to page to.
        min_bytes: tensors smaller than this stay resident.
        keep: tensors (e.g. ``model.parameters()``) whose storages are never paged.
        auto_prefetch: when a stage's pack is first unpacked, prefetch the next lower asynchronous stage.

    Raises:
        PagingError: the page file cannot be created.
    """

    def __init__(self, page_dir: str | os.PathLike[str] | None = None, *, min_bytes: int = 65536,
                 keep: Iterable[torch.Tensor] = (), auto_prefetch: bool = True) -> None:
        self.page_dir = page_dir_or_default(page_dir)
        self.min_bytes, self.auto_prefetch = int(min_bytes), auto_prefetch
        self._keep = {t.untyped_storage().data_ptr() for t in keep}
        try:
            self.path, self._fd = open_page_file(self.page_dir)
        except OSError as e:
            raise PagingError(f"cannot create a page file in {self.page_dir}: {e}; pass page_dir= a writable "
                              "directory, or plan with paging=False") from e
        self._cv = threading.Condition()
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._worker = threading.Thread(target=work, args=(self._jobs,), name="edgetrain-pager", daemon=True)
        self._worker.start()
        self._finalizer = weakref.finalize(self, cleanup, self._fd, str(self.path), self._jobs, self._worker)
        self._entries: dict[int, list[_Entry]] = {}
        self._by_key: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], weakref.ref[_Handle]]] = {}
        self._boundaries: dict[int, int] = {}
        self._async: dict[int, bool] = {}
        self._pending: dict[int, int] = {}
        self._stage: int | None = None
        self._end = 0
        self._error: BaseException | None = None
        self._reported = False
        self._stats = dict(paged_tensors=0, resident_tensors=0, written_bytes=0, read_bytes=0, held_bytes=0,
                           peak_held_bytes=0, write_wait_s=0.0, read_wait_s=0.0)
        self._side_stream: Any = None

    # ----- public API ------------------------------------------------------------------------------

    def __enter__(self) -> "Pager":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(raise_errors=exc_type is None)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def stats(self) -> PagerStats:
        with self._cv:
            return PagerStats(**self._stats)

    @contextlib.contextmanager
    def hooks(self) -> Iterator["Pager"]:
        """Install the saved-tensor hooks (around a whole forward, so boundaries get paged)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    @contextlib.contextmanager
    def stage(self, k: int, *, asynchronous: bool = True) -> Iterator["Pager"]:
        """Page every tensor saved inside as part of stage ``k``'s pack.

        Args:
            k: stage index (prefetch order is by decreasing ``k``).
            asynchronous: write on the background thread (the stage returns once earlier stages' writes
                are done, so one pack is in flight); ``False`` returns only once this pack is written and
                is never prefetched.

        Raises:
            PagingError: a write failed (e.g. the disk is full).
        """
        self._check()
        self._async[k] = asynchronous
        prev, self._stage = self._stage, k
        try:
            with self.hooks():
                yield self
        finally:
            self._stage = prev
        self._wait_writes(lambda s: s != k if asynchronous else True)
        self._check()

    def page_boundary(self, k: int, tensor: torch.Tensor) -> None:
        """Page later saves of ``tensor``'s storage (stage ``k``'s output) with stage ``k``'s pack."""
        self._boundaries[tensor.untyped_storage().data_ptr()] = k

    def prefetch(self, k: int) -> None:
        """Start reading stage ``k``'s pack back (no-op for synchronous or already loaded stages)."""
        if not self._async.get(k, False) or self.closed:
            return
        with self._cv:
            todo = [e for e in self._entries.get(k, ()) if not (e.released or e.reading or e.loaded is not None)]
            for e in todo:
                e.reading = True
                e.keep_source = True
        for e in todo:
            if e.device.type == "cuda":
                self._read(e)       # a non-blocking host-to-device copy, ordered on the current stream
            else:
                self._jobs.put((self._read, e))

    def prefetch_hook(self, k: int) -> Callable[[torch.Tensor], None]:
        """A tensor hook (``y.register_hook(...)``) that prefetches stage ``k`` when a gradient arrives."""
        def hook(_grad: torch.Tensor) -> None:
            self.prefetch(k)
        return hook

    def wait(self) -> None:
        """Block until every queued write and read has finished; raise a pending error."""
        self._wait_writes(lambda s: True)
        done = threading.Event()
        self._jobs.put((lambda: done.set(),))
        done.wait()
        self._check()

    def reset(self) -> None:
        """Forget every pack and truncate the page file (between micro-batches, once backward is done).

        Raises:
            PagingError: a transfer failed.
        """
        self.wait()
        with self._cv:
            self._entries.clear()
            self._by_key.clear()
            self._boundaries.clear()
            self._async.clear()
            self._pending.clear()
            self._end = 0
            self._stats["held_bytes"] = 0
        os.ftruncate(self._fd, 0)

    def close(self, raise_errors: bool = True) -> None:
        """Stop the background thread and remove the page file (idempotent).

        Args:
            raise_errors: raise a transfer error that nothing has reported yet.

        Raises:
            PagingError: a write or read failed during this pager's life and was not raised before.
        """
        if self._finalizer.alive:
            self._jobs.put(None)
            self._worker.join(timeout=30.0)
            self._finalizer()
        with self._cv:
            self._entries.clear()
            self._by_key.clear()
        if raise_errors and self._error is not None and not self._reported:
            self._reported = True
            raise self._paging_error()

    # ----- hooks -----------------------------------------------------------------------------------

    def _resident(self, t: torch.Tensor) -> bool:
        if t.layout is not torch.strided or t.is_conj() or t.is_neg() or t.is_quantized or t.is_nested:
            return True
        if t.numel() * t.element_size() < self.min_bytes or isinstance(t, torch.nn.Parameter):
            return True
        if t.requires_grad and t.is_leaf or (t._base is not None and t._base.is_leaf and t._base.requires_grad):
            return True
        return t.device.type not in ("cpu", "cuda") or t.untyped_storage().data_ptr() in self._keep

    def _pack(self, t: torch.Tensor) -> Any:
        self._check()
        k = self._stage
        if k is None:
            k = self._boundaries.get(t.untyped_storage().data_ptr())
        if k is None or self._resident(t):
            with self._cv:
                self._stats["resident_tensors"] += 1
            return t.detach()
        original = weakref.ref(t)   # while this tensor lives, its storage (and so the key) is its own
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
               t._version)
        t = t.detach()
        with self._cv:
            seen = self._by_key.get(key)
            if seen is not None:
                same, h = seen[0](), seen[1]()
                if same is not None and h is not None and not h.entry.released:
                    return h
        span = 0 if t.numel() == 0 else 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        flat = t.as_strided((span,), (1,), t.storage_offset())
        e = _Entry(k, key, t, flat)
        h = _Handle(e)
        weakref.finalize(h, _release, weakref.ref(self), e)
        with self._cv:
            if len(self._by_key) > 4096:
                self._by_key = {k: v for k, v in self._by_key.items() if v[0]() is not None and v[1]() is not None}
            self._by_key[key] = (original, weakref.ref(h))
            self._entries.setdefault(k, []).append(e)
            self._stats["paged_tensors"] += 1
            self._hold(e.nbytes)
            e.offset = self._end
            self._end += -(-e.nbytes // _ALIGN) * _ALIGN
            e.writing = True
            self._pending[k] = self._pending.get(k, 0) + 1
        if t.device.type == "cuda":
            self._copy_to_host(e)
        elif self._async.get(k, True):
            self._jobs.put((self._write, e))
        else:
            self._write(e)
            self._check()
        return h

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        self._check()
        e = packed.entry
        with self._cv:
            data = e.loaded if e.loaded is not None else e.source
        if data is None:
            t0 = time.perf_counter()
            if e.reading:
                with self._cv:
                    self._cv.wait_for(lambda: not e.reading)
                    data = e.loaded
            if data is None:
                self._check()
                self._read(e)
                self._check()
                data = e.loaded
            with self._cv:
                self._stats["read_wait_s"] += time.perf_counter() - t0
        elif e.loaded is None:
            with self._cv:
                e.loaded = data
                self._hold(0)
        if self.auto_prefetch:
            lower = [s for s in self._entries if s < e.stage and self._async.get(s, False)]
            if lower:
                self.prefetch(max(lower))
        assert data is not None
        return data.as_strided(e.size, e.stride, 0)

    # ----- transfers (the worker thread runs _write/_read for CPU entries) -------------------------

    def _hold(self, delta: int) -> None:
        s = self._stats
        s["held_bytes"] += delta
        s["peak_held_bytes"] = max(s["peak_held_bytes"], s["held_bytes"])

    def _write(self, e: _Entry) -> None:
        src = e.source
        try:
            if self._error is None and src is not None and e.nbytes:
                write_all(self._fd, memoryview(src.view(torch.uint8).numpy()), e.offset)
        except (OSError, ValueError) as err:
            self._error = err
        with self._cv:
            self._stats["written_bytes"] += e.nbytes if self._error is None else 0
            e.writing = False
            self._pending[e.stage] -= 1
            if not e.keep_source and e.loaded is None and self._error is None:
                e.source = None
                if not e.released:
                    self._hold(-e.nbytes)
            self._cv.notify_all()

    def _read(self, e: _Entry) -> None:
        with self._cv:
            if e.released or e.loaded is not None:
                e.reading = False
                self._cv.notify_all()
                return
            src = e.source
        if src is not None:
            buf = src
        elif e.host is not None:
            buf = e.host.to(e.device, non_blocking=True)
        else:
            buf = torch.empty(e.span, dtype=e.dtype)
            try:
                if e.nbytes:
                    read_all(self._fd, memoryview(buf.view(torch.uint8).numpy()), e.offset)
            except OSError as err:
                self._error = err
        with self._cv:
            if not e.released and self._error is None:
                if e.source is None:
                    self._hold(e.nbytes)
                    self._stats["read_bytes"] += e.nbytes if src is None and e.host is None else 0
                e.loaded = buf
            e.reading = False
            self._cv.notify_all()

    def _copy_to_host(self, e: _Entry) -> None:
        """CUDA tensors: copy to pinned host memory on a side stream (the 'page file' is host RAM)."""
        src = e.source
        assert src is not None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=src.device)
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(src.device))
        host = torch.empty(e.span, dtype=e.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(src, non_blocking=True)
            src.record_stream(side)
        side.synchronize()   # bounded in-flight: one copy at a time; the device buffer frees below
        with self._cv:
            e.host, e.source, e.writing = host, None, False
            self._pending[e.stage] -= 1
            self._stats["written_bytes"] += e.nbytes
            self._hold(-e.nbytes)

    def _wait_writes(self, which: Callable[[int], bool]) -> None:
        t0 = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: self._error is not None or
                              all(n == 0 for s, n in self._pending.items() if which(s)))
            self._stats["write_wait_s"] += time.perf_counter() - t0

    def _check(self) -> None:
        if self._error is not None:
            self._reported = True
            raise self._paging_error()

    def _paging_error(self) -> PagingError:
        err = self._error
        full = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)
        what = "the disk is full" if full else f"a write or read failed ({err})"
        e = PagingError(
            f"paging saved tensors to {self.page_dir} failed: {what} after {format_bytes(self._end)} were "
            "allocated in the page file. Free space there, pass page_dir= a directory on a larger disk, or "
            "plan with paging=False (keep/recompute only). Do not apply this step's gradients.")
        e.__cause__ = err
        return e


def _release(pager_ref: "weakref.ref[Pager]", e: _Entry) -> None:
    pager = pager_ref()
    if pager is None:
        return
    with pager._cv:
        if e.released:
            return
        e.released = True
        held = e.loaded is not None or e.source is not None
        e.loaded = None
        if not e.writing:
            e.source = None
        e.host = None
        if held:
            pager._hold(-e.nbytes)
        pager._by_key.pop(e.key, None)
