"""The search around the POET solvers: micro-batch sizes, exact memory feasibility, gaps, the Plan.

:func:`plan_search` loops over micro-batch sizes (cheapest all-keep cost first), skips sizes that
cannot beat the incumbent or cannot fit (decided exactly by :func:`feasible_schedule`), hands the rest
to a per-size solver (the MILP or the exact DP), re-costs every answer with
:func:`~edgetrain.planners.paging_model.simulate_paged` and returns one :class:`~edgetrain.plan.Plan`
with the proven gap over all sizes.

Memory feasibility is exact and fast: the smallest peak of a schedule comes with the in-flight window at
0 (every paged stage synchronous), and then every constraint has the form ``P + back + local <= A`` with
a prefix ``P`` that only grows, so the smallest reachable prefix at each group boundary, kept apart by
whether the stage before was paged (``back``), decides feasibility (an ``O(n^2)`` shortest path).
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
from ._common import candidate_micro_batches
from .paging_model import PagedScheduleCost, PagingArrays, pack_bytes, paging_arrays, simulate_paged

__all__ = ["PagedSchedule", "Candidate", "schedule_from_vectors",
           "window_candidates", "feasible_schedule", "min_activation_peak", "cost_of", "widen_window",
           "plan_search", "OBJECTIVES"]

log = logging.getLogger(__name__)
OBJECTIVES = ("energy", "time")
_BIG = np.int64(2**62)


@dataclass(frozen=True)
class PagedSchedule:
    """A schedule: micro-batch size, per-stage policy, group ids and the in-flight window (``None``: all
    paged stages asynchronous; see :func:`~edgetrain.planners.paging_model.simulate_paged`)."""

    m: int
    policies: tuple[str, ...]
    groups: tuple[int, ...]
    inflight_bytes: int | None = None


@dataclass(frozen=True)
class Candidate:
    """A per-size solver's answer: the schedule, its objective, a proven lower bound at this size.

    ``schedule`` is ``None`` when the solver proved that nothing at this size beats the incumbent.
    """

    schedule: PagedSchedule | None
    objective: float
    bound: float
    proven: bool = True


def schedule_from_vectors(m: int, page: Sequence[bool], rec: Sequence[bool], end: Sequence[bool],
                          inflight_bytes: int | None = None) -> PagedSchedule:
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
    return PagedSchedule(m, tuple(policies), tuple(groups), inflight_bytes)


def window_candidates(arr: PagingArrays, paging: bool) -> np.ndarray:
    """In-flight windows worth trying: 0 and every distinct pack size of a stage worth paging."""
    if not paging:
        return np.zeros(1, dtype=np.int64)
    return np.unique(np.concatenate([[0], arr.pack[arr.page_ok]])).astype(np.int64)


def feasible_schedule(arr: PagingArrays, act_budget: int, paging: bool,
                      recompute: bool = True) -> PagedSchedule | None:
    """A schedule (window 0) whose activation peak fits ``act_budget``, if any exists (exact; module doc).

    The witness reaches the loss with the smallest resident prefix.
    """
    n = arr.n
    if act_budget < 0:
        return None
    pmin = np.full((2, n + 1), _BIG, dtype=np.int64)     # [after a paged stage?, boundary]
    pmin[0, 0] = arr.inp0
    pred = np.full((2, n + 1, 3), -1, dtype=np.int64)    # (from boundary, from flag, kind 0/1/2)
    for s in range(n):
        for flag in (0, 1):
            p = pmin[flag, s]
            if p >= _BIG:
                continue
            base = p + (arr.out[s - 1] if flag else 0)
            ok = (base + arr.seg_local[s, s:] <= act_budget) & recompute
            cand = np.where(ok, p + arr.out[s:], _BIG)
            better = cand < pmin[0, s + 1:]
            pmin[0, s + 1:] = np.where(better, cand, pmin[0, s + 1:])
            pred[0, s + 1:][better] = (s, flag, 2)
            if base + arr.keep_local[s] > act_budget:
                continue
            moves = [(0, arr.keep_add[s], 0)]
            if paging and arr.page_ok[s]:
                moves.append((1, arr.page_add[s], 1))
            for to, add, kind in moves:
                if p + add <= pmin[to, s + 1]:
                    pmin[to, s + 1] = p + add
                    pred[to, s + 1] = (s, flag, kind)
    ends = pmin[:, n] + arr.out[-1]
    flag = int(np.argmin(ends))
    if pmin[flag, n] >= _BIG or ends[flag] > act_budget:
        return None
    page, rec, end = [False] * n, [False] * n, [False] * n
    t = n
    while t > 0:
        s, prev_flag, kind = (int(v) for v in pred[flag, t])
        for u in range(s, t):
            page[u], rec[u] = kind == 1, kind == 2
        end[t - 1] = kind == 2
        t, flag = s, prev_flag
    return schedule_from_vectors(arr.m, page, rec, end, inflight_bytes=0)


def cost_of(chain: CostChain, device: DeviceProfile, s: PagedSchedule) -> PagedScheduleCost:
    """:func:`simulate_paged` of a :class:`PagedSchedule`."""
    return simulate_paged(chain, device, s.m, s.policies, s.groups, inflight_bytes=s.inflight_bytes)


def widen_window(chain: CostChain, device: DeviceProfile, s: PagedSchedule, budget: int) -> PagedSchedule:
    """The same policies with the largest in-flight window that still fits ``budget`` (never slower)."""
    packs = sorted({p for t, p in enumerate(pack_bytes(chain, s.m)) if s.policies[t] == PAGE}, reverse=True)
    for w in packs:
        if s.inflight_bytes is not None and w <= s.inflight_bytes:
            break
        trial = PagedSchedule(s.m, s.policies, s.groups, w)
        if cost_of(chain, device, trial).peak_bytes <= budget:
            return trial
    return s


def _act_peak(chain: CostChain, device: DeviceProfile, s: PagedSchedule) -> int:
    return cost_of(chain, device, s).activation_peak_bytes


def min_activation_peak(chain: CostChain, device: DeviceProfile, arr: PagingArrays, paging: bool,
                        recompute: bool = True) -> int:
    """The smallest activation peak of any schedule at ``arr.m`` (bisection on the exact oracle)."""
    keep = PagedSchedule(arr.m, (KEEP,) * arr.n, tuple(range(arr.n)), 0)
    hi, lo = _act_peak(chain, device, keep), -1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        s = feasible_schedule(arr, mid, paging, recompute)
        if s is None:
            lo = mid
        else:
            hi = min(mid, _act_peak(chain, device, s))
    return hi


def _objective(cost: PagedScheduleCost, objective: str) -> float:
    return float(cost.energy_j if objective == "energy" else cost.step_time_s)


SolveAt = Callable[[PagingArrays, int, "float | None", float, "float | None"], "Candidate | None"]
Heuristic = Callable[[PagingArrays, int, "float | None"], "Candidate | None"]


def plan_search(chain: CostChain, budget_bytes: int, *, device: DeviceProfile, objective: str,
                time_budget: float | None, paging: bool, micro_batch_sizes: Sequence[int] | None,
                time_limit_s: float, rel_gap: float, solve_at: SolveAt, solver: str,
                recompute: bool = True, heuristic: Heuristic | None = None) -> Plan:
    """Run a per-size solver over the micro-batch sizes and build the Plan (see module doc).

    Phase 1 finds, for every size that fits, a feasible schedule (the exact oracle's witness and the
    optional ``heuristic``) and its all-keep lower bound. Phase 2 visits sizes by increasing lower bound
    and stops as soon as the incumbent is within ``rel_gap`` of every remaining bound; the others go to
    ``solve_at`` with the incumbent as a cutoff.

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
    best: tuple[float, PagedSchedule, PagedScheduleCost] | None = None
    lower = {m: _objective(keep_cost[m], objective) for m in sizes}
    open_sizes: dict[int, PagingArrays] = {}
    mem_ok = False

    def offer(sched: PagedSchedule) -> None:
        nonlocal best
        sched = widen_window(chain, device, sched, budget)
        c = cost_of(chain, device, sched)
        if c.peak_bytes <= budget and (time_cap is None or c.step_time_s <= time_cap * (1 + 1e-9)):
            v = _objective(c, objective)
            if best is None or v < best[0]:
                best = (v, sched, c)

    for m in sorted(sizes, key=lambda m: (lower[m], -m)):       # phase 1: feasibility and incumbents
        if time_cap is not None and keep_cost[m].step_time_s > time_cap * (1 + 1e-12) or act_budget < 0:
            lower[m] = np.inf
            continue
        if keep_cost[m].peak_bytes <= budget:
            mem_ok = True
            offer(PagedSchedule(m, keep_pol, tuple(range(chain.n)), 0))
            continue
        if best is not None and lower[m] >= best[0]:
            continue
        arr = paging_arrays(chain, device, m)
        witness = feasible_schedule(arr, act_budget, paging, recompute)
        if witness is None:
            lower[m] = np.inf
            continue
        mem_ok = True
        offer(witness)
        if heuristic is not None:
            h = heuristic(arr, act_budget, time_cap)
            if h is not None and h.schedule is not None:
                offer(h.schedule)
        open_sizes[m] = arr
    proven = True
    for m in sorted(open_sizes, key=lambda m: lower[m]):          # phase 2: solve what can still win
        if best is not None:
            floor = min(lower[k] for k in sizes)
            if best[0] - floor <= rel_gap * best[0] or lower[m] >= best[0]:
                break
        remaining = time_limit_s - (time.perf_counter() - t_start)
        incumbent = None if best is None else best[0]
        cand = solve_at(open_sizes[m], act_budget, time_cap, remaining, incumbent) if remaining > 0 else None
        if cand is None:
            proven = False
            continue
        proven &= cand.proven
        if cand.schedule is not None:
            c = cost_of(chain, device, cand.schedule)
            if c.peak_bytes > budget:   # solver tolerance: keep the bound only if the answer is exact
                log.warning("m=%d: solver answer exceeds the budget by %d bytes; ignored", m, c.peak_bytes - budget)
                proven = False
                continue
            offer(cand.schedule)
        lower[m] = max(lower[m], cand.bound)
    solve_s = time.perf_counter() - t_start
    if best is None:
        raise _budget_error(chain, device, budget, sizes, paging, recompute, mem_ok, time_budget, solver)
    obj, sched, cost = best
    floor = min(min(lower.values()), obj)
    gap = max(0.0, (obj - floor) / obj) if obj > 0 else 0.0
    notes = [f"objective {objective} on device {device.name}"]
    if time_cap is not None:
        notes.append(f"time budget {time_budget:g}x the fastest step ({time_cap * 1e3:.1f} ms)")
    if not proven:
        notes.append("time limit reached before every size was solved to the gap; the gap is what was proven")
    return Plan(
        batch_size=chain.batch_size, micro_batch_size=sched.m, policies=sched.policies, groups=sched.groups,
        peak_bytes=cost.peak_bytes, step_time_s=cost.step_time_s, solver=solver, solve_time_s=solve_s,
        budget_bytes=budget, stage_names=tuple(s.name for s in chain.stages), energy_j=cost.energy_j,
        optimality_gap=gap, notes=tuple(notes),
        metadata={"activation_peak_bytes": cost.activation_peak_bytes, "fixed_bytes": chain.fixed_bytes,
                  "inflight_bytes": cost.inflight_bytes, "async_stages": list(cost.async_stages),
                  "paged_bytes": cost.paged_bytes, "transfer_time_s": cost.transfer_time_s,
                  "stall_time_s": cost.stall_time_s, "recompute_time_s": cost.recompute_time_s,
                  "recomputed_stages": sched.policies.count(RECOMPUTE),
                  "paged_stages": sched.policies.count(PAGE), "objective": objective,
                  "device": device.name, "paging": paging, "recompute": recompute, "time_budget": time_budget,
                  "time_cap_s": time_cap, "lower_bound": floor})


def _budget_error(chain: CostChain, device: DeviceProfile, budget: int, sizes: list[int], paging: bool,
                  recompute: bool, mem_ok: bool, time_budget: float | None, solver: str) -> BudgetError:
    if mem_ok:
        return BudgetError(
            f"{solver}: no keep/recompute/page schedule meets the time budget of {time_budget:g}x the fastest "
            f"step within {format_bytes(budget)}; raise time_budget, raise the memory budget, or drop the time "
            "budget", budget_bytes=budget, min_feasible_bytes=None)
    arr = paging_arrays(chain, device, min(sizes))
    need = chain.fixed_bytes + min_activation_peak(chain, device, arr, paging, recompute)
    what = "/".join(["keep"] + ["recompute"] * recompute + ["page"] * paging)
    hint = "" if paging else "; allowing paging (paging=True) may lower it"
    hint += "" if recompute else "; allowing recomputation (recompute=True) may lower it"
    return BudgetError(
        f"{solver}: no {what} schedule fits {format_bytes(budget)}; the smallest budget that fits is "
        f"{format_bytes(need)} at micro-batch {min(sizes)} (fixed bytes {format_bytes(chain.fixed_bytes)} "
        f"included){hint}. Raise the budget to at least that, or lower the batch size.",
        budget_bytes=budget, min_feasible_bytes=need)
