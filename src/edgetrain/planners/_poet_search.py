"""The search around the POET solvers: micro-batch sizes, exact memory feasibility, gaps, the Plan.

:func:`plan_search` loops over micro-batch sizes (cheapest all-keep cost first), skips sizes that
cannot beat the incumbent or cannot fit (decided exactly by :func:`feasible_schedule`), hands the rest
to a per-size solver (the MILP or the exact DP), re-costs every answer with
:func:`~edgetrain.planners.paging_model.simulate_paged` and returns one :class:`~edgetrain.plan.Plan`
with the proven gap over all sizes.

Memory feasibility is exact and fast because every constraint has the form ``P + local + W <= A`` with a
prefix ``P`` that only grows: for a fixed in-flight window ``W`` (paging allowed on stages whose saved
bytes are at most ``W``), the smallest reachable prefix at each group boundary decides feasibility (an
``O(n^2)`` shortest path), and ``W`` ranges over ``{0} U {saved_t}``; all windows run at once as one
array computation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..devices import DeviceProfile
from ..errors import BudgetError
from ..graph import KEEP, PAGE, RECOMPUTE, CostChain
from ..plan import Plan
from ..units import format_bytes
from .paging_model import PagingArrays, paging_arrays, simulate_paged

__all__ = ["PagedSchedule", "Candidate", "candidate_micro_batches", "schedule_from_vectors",
           "window_candidates", "feasible_schedule", "min_activation_peak", "plan_search", "OBJECTIVES"]

log = logging.getLogger(__name__)
OBJECTIVES = ("energy", "time")
_BIG = np.int64(2**62)


@dataclass(frozen=True)
class PagedSchedule:
    """A schedule: micro-batch size, per-stage policy and group ids."""

    m: int
    policies: tuple[str, ...]
    groups: tuple[int, ...]


@dataclass(frozen=True)
class Candidate:
    """A per-size solver's answer: the schedule, its objective, a proven lower bound at this size."""

    schedule: PagedSchedule
    objective: float
    bound: float
    proven: bool = True


def candidate_micro_batches(chain: CostChain, sizes: Sequence[int] | None) -> list[int]:
    """Micro-batch sizes to search: the user's (clamped to the batch), or ``ceil(B/k)`` for ``k = 1..B``.

    Raises:
        ValueError: an empty list or a size that is not a positive integer.
    """
    b = chain.batch_size
    if sizes is None:
        return sorted({-(-b // k) for k in range(1, b + 1)}, reverse=True)
    sizes = list(sizes)
    if not sizes or any(isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1 for m in sizes):
        raise ValueError(f"micro_batch_sizes must be a non-empty list of positive integers, got {sizes!r}")
    return sorted({min(int(m), b) for m in sizes}, reverse=True)


def schedule_from_vectors(m: int, page: Sequence[bool], rec: Sequence[bool], end: Sequence[bool]) -> PagedSchedule:
    """Policies and group ids from per-stage page / recompute / group-end flags."""
    policies: list[str] = []
    groups: list[int] = []
    gid = -1
    for t in range(len(page)):
        if rec[t]:
            if not (t > 0 and rec[t - 1] and not end[t - 1]):
                gid += 1
            policies.append(RECOMPUTE)
        else:
            gid += 1
            policies.append(PAGE if page[t] else KEEP)
        groups.append(gid)
    return PagedSchedule(m, tuple(policies), tuple(groups))


def window_candidates(arr: PagingArrays, paging: bool) -> np.ndarray:
    """In-flight windows worth trying: 0 and every distinct saved size of a stage worth paging."""
    if not paging:
        return np.zeros(1, dtype=np.int64)
    return np.unique(np.concatenate([[0], arr.saved[arr.page_ok]])).astype(np.int64)


def feasible_schedule(arr: PagingArrays, act_budget: int, paging: bool) -> PagedSchedule | None:
    """A schedule whose activation peak fits ``act_budget``, if any exists (exact; module doc).

    Among windows that fit, the witness reaches the loss with the smallest resident prefix.
    """
    n = arr.n
    w = window_candidates(arr, paging)
    w = w[w <= act_budget]
    if len(w) == 0:
        return None
    k = len(w)
    cap = (act_budget - w)[:, None]
    pageable = (arr.saved[None, :] <= w[:, None]) & arr.page_ok[None, :] & (w[:, None] > 0)
    pmin = np.full((k, n + 1), _BIG, dtype=np.int64)
    pmin[:, 0] = arr.inp0
    pred = np.full((k, n + 1), -1, dtype=np.int64)
    kind = np.zeros((k, n + 1), dtype=np.int8)        # 0 keep, 1 page, 2 recompute
    for s in range(n):
        p = pmin[:, s:s + 1]
        live = p < _BIG
        ok = live & (p + arr.seg_local[s, s:][None, :] <= cap)
        cand = np.where(ok, p + arr.out[s:][None, :], _BIG)
        better = cand < pmin[:, s + 1:]
        pmin[:, s + 1:] = np.where(better, cand, pmin[:, s + 1:])
        pred[:, s + 1:] = np.where(better, s, pred[:, s + 1:])
        kind[:, s + 1:] = np.where(better, 2, kind[:, s + 1:])
        fits = live[:, 0] & (p[:, 0] + arr.keep_local[s] <= cap[:, 0])
        for code, add, allowed in ((1, arr.out[s], pageable[:, s]), (0, arr.keep_add[s], True)):
            c = np.where(fits & allowed, p[:, 0] + add, _BIG)
            b = c <= pmin[:, s + 1] if code == 0 else c < pmin[:, s + 1]
            b &= c < _BIG
            pmin[:, s + 1] = np.where(b, c, pmin[:, s + 1])
            pred[:, s + 1] = np.where(b, s, pred[:, s + 1])
            kind[:, s + 1] = np.where(b, code, kind[:, s + 1])
    ends = np.where(pmin[:, n] < _BIG, pmin[:, n] + arr.out[-1], _BIG)
    good = np.flatnonzero(ends <= cap[:, 0])
    if len(good) == 0:
        return None
    row = int(good[np.argmin(ends[good] + w[good])])
    spans: list[tuple[int, int, int]] = []
    t = n
    while t > 0:
        s = int(pred[row, t])
        spans.append((s, t - 1, int(kind[row, t])))
        t = s
    page, rec, end = [False] * n, [False] * n, [False] * n
    for i, j, code in spans:
        for u in range(i, j + 1):
            page[u], rec[u] = code == 1, code == 2
        end[j] = code == 2
    return schedule_from_vectors(arr.m, page, rec, end)


def _act_peak(chain: CostChain, device: DeviceProfile, s: PagedSchedule) -> int:
    return simulate_paged(chain, device, s.m, s.policies, s.groups).activation_peak_bytes


def min_activation_peak(chain: CostChain, device: DeviceProfile, arr: PagingArrays, paging: bool) -> int:
    """The smallest activation peak of any schedule at ``arr.m`` (bisection on the exact oracle)."""
    keep = PagedSchedule(arr.m, (KEEP,) * arr.n, tuple(range(arr.n)))
    hi, lo = _act_peak(chain, device, keep), -1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        s = feasible_schedule(arr, mid, paging)
        if s is None:
            lo = mid
        else:
            hi = min(mid, _act_peak(chain, device, s))
    return hi


def _objective(cost: object, objective: str) -> float:
    return float(cost.energy_j if objective == "energy" else cost.step_time_s)  # type: ignore[attr-defined]


SolveAt = Callable[[PagingArrays, int, "float | None", float], "Candidate | None"]


def plan_search(chain: CostChain, budget_bytes: int, *, device: DeviceProfile, objective: str,
                time_budget: float | None, paging: bool, micro_batch_sizes: Sequence[int] | None,
                time_limit_s: float, rel_gap: float, solve_at: SolveAt, solver: str) -> Plan:
    """Run a per-size solver over the micro-batch sizes and build the Plan (see module doc).

    Raises:
        BudgetError: nothing fits the memory budget (``min_feasible_bytes`` set), or nothing meets the
            time budget inside it (``min_feasible_bytes`` None).
        ValueError: bad objective or time budget.
    """
    t_start = time.perf_counter()
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if time_budget is not None and not time_budget > 0:
        raise ValueError(f"time_budget is a multiple of the fastest step and must be > 0, got {time_budget!r}")
    budget = int(budget_bytes)
    sizes = candidate_micro_batches(chain, micro_batch_sizes)
    keep_pol = (KEEP,) * chain.n
    keep_cost = {m: simulate_paged(chain, device, m, keep_pol) for m in sizes}
    t_fast = min(c.step_time_s for c in keep_cost.values())
    time_cap = None if time_budget is None else time_budget * t_fast
    act_budget = budget - chain.fixed_bytes
    best: tuple[float, PagedSchedule, object] | None = None
    bounds: list[float] = []
    mem_ok = False
    proven = True
    for m in sorted(sizes, key=lambda m: (_objective(keep_cost[m], objective), -m)):
        lb = _objective(keep_cost[m], objective)
        if best is not None and lb >= best[0]:
            bounds.append(lb)
            continue
        if time_cap is not None and keep_cost[m].step_time_s > time_cap * (1 + 1e-12):
            continue
        if keep_cost[m].peak_bytes <= budget:
            mem_ok = True
            best = (lb, PagedSchedule(m, keep_pol, tuple(range(chain.n))), keep_cost[m])
            bounds.append(lb)
            continue
        if act_budget < 0:
            continue
        arr = paging_arrays(chain, device, m)
        witness = feasible_schedule(arr, act_budget, paging)
        if witness is None:
            continue
        mem_ok = True
        found: list[tuple[float, PagedSchedule, object]] = []
        wc = simulate_paged(chain, device, m, witness.policies, witness.groups)
        if time_cap is None or wc.step_time_s <= time_cap * (1 + 1e-9):
            found.append((_objective(wc, objective), witness, wc))
        remaining = time_limit_s - (time.perf_counter() - t_start)
        m_bound, budget_m = lb, act_budget
        for _attempt in range(3):
            cand = solve_at(arr, budget_m, time_cap, remaining) if remaining > 0 else None
            if cand is None:
                proven = False
                break
            c = simulate_paged(chain, device, m, cand.schedule.policies, cand.schedule.groups)
            if c.peak_bytes > budget:   # rounding inside the solver: tighten by the excess and retry
                budget_m -= c.peak_bytes - budget
                remaining = time_limit_s - (time.perf_counter() - t_start)
                continue
            if time_cap is None or c.step_time_s <= time_cap * (1 + 1e-9):
                found.append((_objective(c, objective), cand.schedule, c))
            # a bound of a tightened problem is not one of the original: fall back to the all-keep bound
            m_bound = max(lb, cand.bound) if budget_m == act_budget else lb
            proven &= cand.proven
            break
        bounds.append(m_bound)
        for item in found:
            if best is None or item[0] < best[0]:
                best = item
    solve_s = time.perf_counter() - t_start
    if best is None:
        raise _budget_error(chain, device, budget, sizes, paging, mem_ok, time_budget, solver)
    obj, sched, cost = best
    lower = min(bounds) if bounds else obj
    gap = max(0.0, (obj - min(lower, obj)) / obj) if obj > 0 else 0.0
    notes = [f"objective {objective} on device {device.name}"]
    if time_cap is not None:
        notes.append(f"time budget {time_budget:g}x the fastest step ({time_cap * 1e3:.1f} ms)")
    if not proven:
        notes.append("time limit reached before every size was solved to the gap; the gap is what was proven")
    return Plan(
        batch_size=chain.batch_size, micro_batch_size=sched.m, policies=sched.policies, groups=sched.groups,
        peak_bytes=cost.peak_bytes, step_time_s=cost.step_time_s, solver=solver,  # type: ignore[attr-defined]
        solve_time_s=solve_s, budget_bytes=budget, stage_names=tuple(s.name for s in chain.stages),
        energy_j=cost.energy_j, optimality_gap=gap, notes=tuple(notes),  # type: ignore[attr-defined]
        metadata={"activation_peak_bytes": cost.activation_peak_bytes,  # type: ignore[attr-defined]
                  "fixed_bytes": chain.fixed_bytes, "inflight_bytes": cost.inflight_bytes,  # type: ignore[attr-defined]
                  "paged_bytes": cost.paged_bytes, "transfer_time_s": cost.transfer_time_s,  # type: ignore[attr-defined]
                  "stall_time_s": cost.stall_time_s, "recompute_time_s": cost.recompute_time_s,  # type: ignore[attr-defined]
                  "recomputed_stages": sched.policies.count(RECOMPUTE),
                  "paged_stages": sched.policies.count(PAGE), "objective": objective,
                  "device": device.name, "paging": paging, "time_budget": time_budget,
                  "time_cap_s": time_cap, "lower_bound": lower})


def _budget_error(chain: CostChain, device: DeviceProfile, budget: int, sizes: list[int], paging: bool,
                  mem_ok: bool, time_budget: float | None, solver: str) -> BudgetError:
    if mem_ok:
        return BudgetError(
            f"{solver}: no keep/recompute/page schedule meets the time budget of {time_budget:g}x the fastest "
            f"step within {format_bytes(budget)}; raise time_budget, raise the memory budget, or drop the time "
            "budget", budget_bytes=budget, min_feasible_bytes=None)
    arr = paging_arrays(chain, device, min(sizes))
    need = chain.fixed_bytes + min_activation_peak(chain, device, arr, paging)
    what = "keep/recompute/page" if paging else "keep/recompute (paging=False)"
    hint = "" if paging else "; allowing paging (paging=True) may lower it"
    return BudgetError(
        f"{solver}: no {what} schedule fits {format_bytes(budget)}; the smallest budget that fits is "
        f"{format_bytes(need)} at micro-batch {min(sizes)} (fixed bytes {format_bytes(chain.fixed_bytes)} "
        f"included){hint}. Raise the budget to at least that, or lower the batch size.",
        budget_bytes=budget, min_feasible_bytes=need)
