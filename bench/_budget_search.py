"""bench_budget's search: which configurations to run, and which of the runs fits a budget.

Pure functions over measured results (no process is started here), so the tests check them directly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from _budget_report import fits

from edgetrain.measure import Job, JobResult

_KEY_FIELDS = ("model", "input_shape", "batch_size", "mode", "model_kwargs", "budget", "micro_batch_size",
               "segments", "solver", "steps", "optimizer", "seed", "threads", "env", "exact_batchnorm",
               "activation_memory_budget", "compile", "layout")
#: the value a field had in logs written before it existed
_KEY_DEFAULTS = {"exact_batchnorm": True, "compile": False, "layout": "keep"}


def job_key(job: Job | dict[str, Any]) -> str:
    """Identity of a job for the run's cache and for ``--replay`` (the fields this bench sets)."""
    d = asdict(job) if isinstance(job, Job) else job
    return json.dumps({k: d.get(k, _KEY_DEFAULTS.get(k)) for k in _KEY_FIELDS}, sort_keys=True)

def micro_batch_candidates(batch_size: int) -> list[int]:
    """B, ceil(B/2), ceil(B/4), ... 1, without repeats."""
    out, m = [], batch_size
    while True:
        if not out or m < out[-1]:
            out.append(m)
        if m == 1:
            return out
        m = math.ceil(m / 2)


def segment_candidates(n_stages: int, quick: bool = False) -> list[int]:
    """Segment counts to try for ``checkpoint_sequential``: {2, 4, sqrt(n), n/2} ({2, sqrt(n)} quick)."""
    root = max(1, round(math.sqrt(n_stages)))
    cand = {2, root} if quick else {2, 4, root, n_stages // 2}
    return sorted(s for s in cand if 1 <= s <= n_stages) or [1]


def hopeless(peaks_bytes: Sequence[int], budget_bytes: int) -> bool:
    """Whether halving the micro-batch further cannot bring the peak under the budget.

    ``peaks_bytes`` are measured peaks at successively halved micro-batches. If a peak is F + a*m, a halving
    from m saves a*m/2 and no micro-batch below m gets under last - a*m/2; twice the largest saving seen is
    allowed, and three peaks are needed, since glibc's retention can make a halving save much less than the
    next (the transformer's plain peak once fell 22 MiB from 64 to 32 samples, then 37 MiB from 32 to 16).
    """
    if len(peaks_bytes) < 3:  # two points: one halving that glibc's retention made look small decides nothing
        return False
    d = max(max(0, a - b) for a, b in zip(peaks_bytes, peaks_bytes[1:]))
    return peaks_bytes[-1] - 2 * d > budget_bytes


def largest_fitting(by_micro: dict[int, JobResult], budget_bytes: int) -> int | None:
    """The largest micro-batch whose measured peak fits (None when none does)."""
    ok = [m for m, r in by_micro.items() if fits(r, budget_bytes)]
    return max(ok) if ok else None


def fastest_fitting(configs: dict[tuple[int, int], JobResult], budget_bytes: int) -> tuple[int, int] | None:
    """The (micro-batch, segments) with the shortest step among those whose measured peak fits."""
    ok = [(r.step_time_s, -k[0], k) for k, r in configs.items() if fits(r, budget_bytes)]
    return min(ok)[2] if ok else None


def compile_best(by_ratio: dict[float, JobResult], budget_bytes: int) -> float | None:
    """The largest measured ``activation_memory_budget`` ratio whose peak fits (None when none does)."""
    ok = [r for r, res in by_ratio.items() if fits(res, budget_bytes)]
    return max(ok) if ok else None


def compile_next_ratio(by_ratio: dict[float, JobResult], budget_bytes: int) -> float | None:
    """The next ratio worth measuring for a budget, or None when the measured ones settle it.

    None when the largest ratio measured (1.0 first) fits. Otherwise, above the largest fitting ratio ``a``
    the nearest measured ratio ``b`` is over the budget: the ratio where the line through their measured
    peaks meets the budget (the midpoint if the peak does not rise from ``a`` to ``b``), unless it is
    within 0.02 of one already measured. With no fitting ratio yet, the midpoint 0.5 once (the peak is not
    monotone in the ratio, so one between 0 and 1 can fit where neither end does).
    """
    ok = {r: res for r, res in by_ratio.items() if res.ok}
    if not ok:
        return None
    best = compile_best(ok, budget_bytes)
    if best is None:
        return 0.5 if 0.5 not in by_ratio else None
    above = [r for r in ok if r > best]
    if not above:
        return None
    b = min(above)
    pa, pb = ok[best].peak_bytes, ok[b].peak_bytes
    r = best + (b - best) * (budget_bytes - pa) / (pb - pa) if pb > pa else (best + b) / 2
    r = round(min(max(r, best), b), 3)
    if any(abs(r - x) < 0.02 for x in by_ratio):
        return None
    return r


def max_batch_search(fit: Callable[[int], bool], start: int, resolution: float, limit: int) -> tuple[int, int | None]:
    """Largest batch for which ``fit`` holds: double (or halve) from ``start``, then bisect.

    Args:
        fit: whether a batch trains inside the budget (assumed monotone).
        start: first batch tried.
        resolution: stop bisecting once the gap is at most this share of the best batch (and at least 1).
        limit: largest batch tried.

    Returns:
        (largest batch that fit, 0 if none; smallest batch that did not fit, None if ``limit`` fit).
    """
    b = max(1, min(start, limit))
    if fit(b):
        lo = b
        while 2 * lo <= limit and fit(2 * lo):
            lo *= 2
        hi = 2 * lo if 2 * lo <= limit else None
        if hi is None:
            return lo, None
    else:
        hi, lo = b, b // 2
        while lo >= 1 and not fit(lo):
            hi, lo = lo, lo // 2
    while hi - lo > max(1, int(lo * resolution)):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fit(mid) else (lo, mid)
    return lo, hi


# --------------------------------------------------------------------------------------------- measuring
