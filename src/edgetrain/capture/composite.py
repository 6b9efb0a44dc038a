"""Composite ops: several kernels that make one tensor, seen by a selective checkpoint as one kept unit.

The lean convolution (:mod:`.lean`) writes its batch slices into one output; under a selective checkpoint
that keeps convolutions (:mod:`edgetrain.runtime.selective`) that output is cached once and handed back in
the replay, and the slices never re-run. A thread-local stack of frames says which checkpoint (forward,
replay, or the profiler's recording) is active; it lives here, below the runtime, so that the ops the
capture rewrites insert can register themselves without importing the runtime.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

__all__ = ["Frame", "frames", "composite"]


class Frame:
    """One active selective forward, replay or profiler recording, seen by :func:`composite`."""

    def __init__(self, mode: str, keep: frozenset[str], cache: list[Any], on_kept: Any = None) -> None:
        self.mode = mode           # "forward", "replay" or "record"
        self.keep = keep
        self.cache = cache         # composite outputs, shared by a checkpoint's forward and replay
        self.on_kept = on_kept     # record mode: called with (class, output)
        self.suppress = 0          # > 0 inside a composite: its kernels are not cached one by one


_LOCAL = threading.local()


def frames() -> list[Frame]:
    if not hasattr(_LOCAL, "frames"):
        _LOCAL.frames = []
    return _LOCAL.frames


def composite(cls: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Run ``compute()`` (several kernels making one tensor of op class ``cls``) as one kept unit.

    Outside a selective checkpoint that keeps ``cls`` this is ``compute()``. Inside its forward the
    kernels run uncached and the output is cached; inside its replay the cached output comes back
    (``RuntimeError`` if it was mutated in place since) and ``compute`` does not run.
    """
    stack = frames()
    f = stack[-1] if stack else None
    if f is None or cls not in f.keep or f.suppress:
        return compute()
    if f.mode == "replay":
        if not f.cache:
            raise RuntimeError("selective recompute: a composite op ran in the replay but not in the forward")
        t, version = f.cache.pop(0)
        if t._version != version:
            raise RuntimeError("Tensor cached during selective activation checkpoint has been mutated")
        return t
    f.suppress += 1
    try:
        out = compute()
    finally:
        f.suppress -= 1
    if f.mode == "forward":
        with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
            f.cache.append((out.detach(), out._version))
    elif f.on_kept is not None:
        f.on_kept(cls, out)
    return out
