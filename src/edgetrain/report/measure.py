"""Resident memory sampled during one real training step, the model and optimizer restored afterwards."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..profile import memory

__all__ = ["MeasuredStep", "measure_step"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_now() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


@dataclass(frozen=True)
class MeasuredStep:
    """Samples of one step: seconds since its start and resident bytes above the import baseline."""

    times_s: tuple[float, ...]
    rss_bytes: tuple[int, ...]
    step_time_s: float
    peak_bytes: int


def measure_step(step: Any, batch: Any, interval_s: float = 0.0005) -> MeasuredStep:
    """Run ``step(*batch)`` once while a thread samples ``/proc/self/statm``; then restore everything.

    The model's state dict, the optimizer's, the gradients, the step counter and the RNG states are saved
    to a temporary file first (not held in memory, which would show in the samples) and loaded back after,
    so the step leaves no trace. Torch kernels release the GIL, so the sampler runs during them.
    """
    from ..trainer._rng import capture_rng, restore_rng

    model, opt = step.model, step.optimizer
    grads = [p.grad for p in model.parameters()]
    fd, tmp = tempfile.mkstemp(prefix="edgetrain-report-", suffix=".pt")
    os.close(fd)
    try:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "steps": step.steps_done,
                    "grads": grads, "rng": capture_rng()}, tmp)
        base = memory.baseline_rss_bytes()
        times: list[float] = []
        rss: list[int] = []
        stop = threading.Event()
        t0 = time.perf_counter()

        def sample() -> None:
            while not stop.is_set():
                times.append(time.perf_counter() - t0)
                rss.append(_rss_now() - base)
                time.sleep(interval_s)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t_start = time.perf_counter()
        step(*batch)
        elapsed = time.perf_counter() - t_start
        stop.set()
        sampler.join()
        saved = torch.load(tmp, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        for p, g in zip(model.parameters(), saved["grads"]):
            p.grad = g
        step.steps_done = saved["steps"]
        restore_rng(saved["rng"])
    finally:
        os.unlink(tmp)
    offset = t_start - t0
    return MeasuredStep(tuple(t - offset for t in times), tuple(rss), elapsed, max(rss) if rss else 0)
