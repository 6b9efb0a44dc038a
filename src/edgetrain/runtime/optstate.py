"""Optimizer state paged out to storage while the forward and backward passes run.

A step needs the optimizer's state (SGD's momentum, Adam's two moments: one or two copies of the
trainable parameters) only inside ``optimizer.step()``; for the rest of the step it is dead weight that
competes with the activations for the budget. :class:`OptimizerStatePager` writes every large state
tensor to a page file before the forward passes (:meth:`page_out`) and reads it back, byte for byte, just
before the update (:meth:`page_in`), so the update's maths is unchanged: same values, dtypes, shapes and
strides. The budget then has to hold the state only beside the gradients during the update, when no
activation is alive, instead of beside the activations (ResNet-18 with SGD momentum: 42.6 MiB more for
activations at the same budget).

While paged out, each state tensor in ``optimizer.state`` is a *meta* tensor of the same shape and dtype:
code that reads it gets an error ("meta tensors have no data"), never stale numbers. The optimizer's own
entry points page the state back in first, through hooks on the optimizer: ``step()`` (so a step the user
runs without edgetrain is exact too) and ``state_dict()`` (so checkpoints hold the real state);
``load_state_dict()`` replaces the state, and the paged copy is forgotten. After an update the state stays
resident until the next :meth:`page_out`, so a checkpoint taken between steps reads nothing back.

Tensors under ``min_bytes`` (Adam's step counters) and tensors that are not dense, contiguous CPU tensors
stay resident. The page file (``edgetrain-pages-<pid>-<token>.bin``, the name :mod:`.paging` uses, so stale
files of dead processes are removed the same way) goes when the pager is closed or garbage-collected and at
interpreter exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..units import format_bytes
from ._pagefile import open_page_file, page_dir_or_default, read_all, write_all
from .paging import PagingError

__all__ = ["OptimizerStatePager", "StatePagerStats", "pageable_state_bytes", "measure_bandwidth"]

log = logging.getLogger(__name__)
_ALIGN = 4096  # page-aligned slots: reads and writes of whole pages


def _pageable(t: Any, min_bytes: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided
            and not t.is_meta and t.is_contiguous() and not t.requires_grad and not t.is_conj()
            and not t.is_neg() and t.numel() * t.element_size() >= min_bytes)


def pageable_state_bytes(optimizer: torch.optim.Optimizer, min_bytes: int = 65536) -> int:
    """Bytes of ``optimizer``'s existing state a :class:`OptimizerStatePager` would page out."""
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if _pageable(v, min_bytes))


@dataclass(frozen=True)
class StatePagerStats:
    """Counters of one :class:`OptimizerStatePager`: tensors and bytes moved, seconds spent (the training
    thread waits for both: writes before the forward, reads before the update)."""

    paged_tensors: int
    paged_bytes: int
    written_bytes: int
    read_bytes: int
    write_s: float
    read_s: float


@dataclass
class _Slot:
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _close(fd: int, path: str) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(path)


def _view(t: torch.Tensor) -> memoryview:
    # raw bytes of a contiguous CPU tensor, whatever its dtype (bfloat16 has no numpy type)
    return memoryview(t.view(-1).view(torch.uint8).numpy())


class OptimizerStatePager:
    """Pages an optimizer's large state tensors out between updates (module doc).

    Args:
        optimizer: the optimizer whose ``state`` is paged; hooks go on it until :meth:`close`.
        directory: where the page file goes (default ``<tmp>/edgetrain-pages``).
        min_bytes: state tensors smaller than this stay resident.

    Raises:
        PagingError: the page file cannot be created.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, directory: str | os.PathLike[str] | None = None, *,
                 min_bytes: int = 65536) -> None:
        self.optimizer = optimizer
        self.min_bytes = int(min_bytes)
        self.directory = page_dir_or_default(directory)
        try:
            self.path, self._fd = open_page_file(self.directory)
        except OSError as e:
            raise PagingError(f"cannot create a page file for the optimizer state in {self.directory}: {e}; "
                              "give a writable directory (PlanConfig(state_dir=...)) or plan with "
                              "PlanConfig(page_optimizer_state=False)") from e
        self._finalizer = weakref.finalize(self, _close, self._fd, str(self.path))
        self._slots: dict[tuple[int, str], _Slot] = {}  # (id of the parameter, state key) -> where it lies
        self._paged: dict[tuple[int, str], _Slot] = {}  # slots whose tensor is out now (meta in the state)
        self._end = 0
        self._clean = False  # the resident state equals the file's copy (paged in, not stepped since)
        self._muted = False  # a fused update pages parameter by parameter: the step hooks leave it alone
        self._stats = dict(paged_tensors=0, paged_bytes=0, written_bytes=0, read_bytes=0, write_s=0.0, read_s=0.0)
        self._hooks = [
            optimizer.register_step_pre_hook(self._before_use),
            optimizer.register_step_post_hook(self._stepped),
            optimizer.register_state_dict_pre_hook(self._before_use),
            optimizer.register_load_state_dict_pre_hook(self._forget),
        ]

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def paged_out(self) -> bool:
        """Whether the state is out on storage now."""
        return bool(self._paged)

    @property
    def stats(self) -> StatePagerStats:
        return StatePagerStats(**self._stats)

    def resident_bytes(self) -> int:
        """Bytes of state tensors this pager would page out that are in memory now."""
        return 0 if self.closed else pageable_state_bytes(self.optimizer, self.min_bytes)

    def _states(self, params: Any = None) -> list[tuple[Any, dict[str, Any]]]:
        """``(parameter, its state)`` of every parameter with state, or of ``params`` only."""
        state = self.optimizer.state
        if params is None:
            return list(state.items())
        return [(p, state[p]) for p in params if p in state]

    def _entries(self, params: Any = None) -> list[tuple[tuple[int, str], dict[str, Any], str, torch.Tensor]]:
        out = []
        for p, st in self._states(params):
            for k, v in st.items():
                if isinstance(k, str) and _pageable(v, self.min_bytes):
                    out.append(((id(p), k), st, k, v))
        return out

    def page_out(self) -> int:
        """Write the resident large state tensors out (unless the file already holds them unchanged) and
        drop them from memory; returns the bytes dropped.

        Every write completes before any tensor is dropped: a failed write (disk full) leaves the state
        resident and whole, and raises :class:`~edgetrain.runtime.paging.PagingError`.
        """
        dropped = self._page_out(self._entries(), self._clean)
        self._clean = True
        return dropped

    def page_out_params(self, params: Any) -> int:
        """:meth:`page_out` for the state of ``params`` only, written whether or not it changed (a fused
        update pages each parameter's state out right after stepping it)."""
        return self._page_out(self._entries(params), False)

    def _page_out(self, entries: list[tuple[tuple[int, str], dict[str, Any], str, torch.Tensor]], clean: bool) -> int:
        self._check_open()
        if not entries:
            return 0
        t0 = time.perf_counter()
        written = 0
        slots = []
        for key, _, _, v in entries:
            nbytes = v.numel() * v.element_size()
            slot = self._slots.get(key)
            if slot is None or slot.nbytes != nbytes:
                slot = _Slot(self._end, nbytes, tuple(v.shape), v.dtype)
                self._end += -(-nbytes // _ALIGN) * _ALIGN
                self._slots[key] = slot
                fresh = True
            else:
                slot.shape, slot.dtype = tuple(v.shape), v.dtype
                fresh = False
            slots.append(slot)
            if fresh or not clean:
                try:
                    write_all(self._fd, _view(v), slot.offset)
                except OSError as e:
                    raise PagingError(f"writing the optimizer state to {self.path} failed: {e}. The state is "
                                      "still in memory and whole; free space there or give another directory "
                                      "(PlanConfig(state_dir=...))") from e
                written += nbytes
        for (key, st, k, v), slot in zip(entries, slots):
            st[k] = torch.empty(slot.shape, dtype=slot.dtype, device="meta")
            self._paged[key] = slot
        dropped = sum(s.nbytes for s in slots)
        self._stats["written_bytes"] += written
        self._stats["write_s"] += time.perf_counter() - t0
        self._stats["paged_tensors"] = len(self._paged)
        self._stats["paged_bytes"] = sum(s.nbytes for s in self._paged.values())
        return dropped

    def page_in(self) -> int:
        """Read the paged-out state back into fresh tensors in ``optimizer.state``; returns the bytes read."""
        read = self._page_in(None)
        self._clean = True
        return read

    def page_in_params(self, params: Any) -> int:
        """:meth:`page_in` for the state of ``params`` only."""
        return self._page_in(params)

    @contextlib.contextmanager
    def muted(self) -> Any:
        """Inside, the optimizer's ``step()`` does not page the whole state back in (a fused update pages
        each parameter's own; :mod:`.fused`)."""
        was, self._muted = self._muted, True
        try:
            yield
        finally:
            self._muted = was

    def _page_in(self, params: Any) -> int:
        if not self._paged or self.closed:
            return 0
        t0 = time.perf_counter()
        read = 0
        for p, st in self._states(params):
            for k in list(st):
                slot = self._paged.get((id(p), k)) if isinstance(k, str) else None
                if slot is None or not (isinstance(st[k], torch.Tensor) and st[k].is_meta):
                    continue
                t = torch.empty(slot.shape, dtype=slot.dtype)
                try:
                    read_all(self._fd, _view(t), slot.offset)
                except OSError as e:
                    raise PagingError(f"reading the optimizer state back from {self.path} failed: {e}") from e
                st[k] = t
                del self._paged[(id(p), k)]
                read += slot.nbytes
        if params is None:
            self._paged.clear()
        self._stats["read_bytes"] += read
        self._stats["read_s"] += time.perf_counter() - t0
        return read

    def _before_use(self, *_: Any) -> None:  # a hook's return value would replace the call's arguments
        if not self._muted:
            self.page_in()

    def _stepped(self, *_: Any) -> None:
        self._clean = False

    def _forget(self, *_: Any) -> None:
        """``load_state_dict`` replaces the state: what the file holds no longer describes it."""
        self._paged.clear()
        self._clean = False

    def _check_open(self) -> None:
        if self.closed:
            raise PagingError("the optimizer-state pager is closed")

    def close(self) -> None:
        """Read the state back (the optimizer is whole again), remove the hooks and the page file."""
        if self.closed:
            return
        try:
            self.page_in()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            self._finalizer()
        s = self.stats
        if s.written_bytes:
            log.info("optimizer state pager: %s written, %s read (%.2f s, %.2f s)", format_bytes(s.written_bytes),
                     format_bytes(s.read_bytes), s.write_s, s.read_s)

    def __enter__(self) -> "OptimizerStatePager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def measure_bandwidth(directory: str | os.PathLike[str] | None, nbytes: int = 16 * 2**20) -> tuple[float, float]:
    """Seconds per byte to write and to read back ``nbytes`` through a page file in ``directory`` (what
    paging the optimizer state costs a step there, before the first step measures it)."""
    path, fd = open_page_file(page_dir_or_default(directory))
    buf = torch.ones(max(_ALIGN, nbytes) // 4)
    try:
        view = _view(buf)
        write_all(fd, view, 0)  # first write allocates the file's blocks; time the second, as steps do
        t0 = time.perf_counter()
        write_all(fd, view, 0)
        t1 = time.perf_counter()
        read_all(fd, view, 0)
        t2 = time.perf_counter()
    finally:
        _close(fd, str(path))
    n = len(view)
    return (t1 - t0) / n, (t2 - t1) / n
