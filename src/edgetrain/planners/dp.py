"""The exact keep/recompute planner: a dynamic programme over (stage, resident bytes) for every budget.

For each candidate micro-batch size ``m`` the planner solves, over the group boundaries of the chain,

    cost_t(P) = min( keep t:            [P + keep_local_t <= A]  cost_{t+1}(P + keep_add_t),
                     recompute t..j:    [P + seg_local_tj <= A]  c_t + ... + c_j + cost_{j+1}(P + add_tj) )

with ``cost_n(P) = 0`` when the loss fits (``P + out_{n-1} <= A``), where ``P`` is the resident prefix,
``A`` the budget minus the chain's fixed bytes, ``add_tj`` what the group retains (its output and the
carried tensors made inside it) and ``c_t`` the seconds per step that recomputing stage
``t`` adds (see :mod:`edgetrain.planners._common` and :func:`edgetrain.graph.simulate`). ``cost_t`` is
vectorised with numpy over all ``P`` at once, so one micro-batch size costs ``O(n^2 K)`` element
operations with recompute segments and ``O(n K)`` without (``K`` byte buckets), ``O(#m n^2 K)`` in all.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np

from ..errors import BudgetError
from ..graph import KEEP, RECOMPUTE, CostChain, selective_policy, simulate
from ..plan import Plan, plan_from_schedule
from ..units import format_bytes
from ._common import (
    NESTED, TIME_RTOL, Schedule, Sizes, better, candidate_micro_batches, hashable, keep_time_s, min_peak_schedule,
    min_prefix_path, recompute_costs, schedule_from_groups, selective_costs, sizes_at, without_selective,
)

__all__ = ["solve_dp", "min_feasible_bytes"]

logger = logging.getLogger(__name__)


def _keep_peak(sz: Sizes) -> int:
    """Activation peak of keeping every stage."""
    prefix = sz.inp0 + np.concatenate([[0], np.cumsum(sz.keep_add)])
    return int(max((prefix[:-1] + sz.keep_local).max(), prefix[-1] + sz.out[-1]))


def _bucket_size(sz: Sizes, max_buckets: int) -> tuple[int, bool]:
    """Budget-independent bucket size ``g`` for ``m`` and whether it is exact (divides every size).

    ``g`` depends on the chain and ``m`` only (never on the budget), so the rounded problems are nested
    as the budget grows and the planner's step time never rises with the budget. The DP runs only when
    the all-keep peak exceeds the budget, so ``A // g <= max_buckets``.
    """
    g = max(1, -(-_keep_peak(sz) // max_buckets))
    common = sz.gcd()
    if common >= g:
        return common, True
    return g, g == 1


def _dp_at(sz: Sizes, costs: np.ndarray, act_budget: int, g: int, allow_segments: bool,
           round_up: bool = True, extra_costs: np.ndarray | None = None,
           sel_costs: np.ndarray | None = None) -> tuple[Schedule | None, float]:
    """Minimum total recompute cost at one micro-batch size on the ``g``-byte grid.

    Rounding every size up (``round_up``) makes each constraint stricter, so a schedule found is
    feasible in exact bytes; rounding down relaxes them, so the optimum is a lower bound.

    A two-level group costs its stages' ``costs`` plus their ``extra_costs`` (default ``costs``): the
    second forward, without a second tie-breaking epsilon, so ties still go to fewer recomputed stages.
    ``sel_costs[t, k]`` is the cost of stage ``t``'s ``k``-th selective option (``None``: none is used).

    Returns:
        The optimal schedule (``None`` when nothing fits on the grid) and its cost.
    """
    def q(x: np.ndarray | int) -> np.ndarray:
        return -(-np.asarray(x, dtype=np.int64) // g) if round_up else np.asarray(x, dtype=np.int64) // g

    n = sz.n
    cap = act_budget // g
    inp0, last = int(q(sz.inp0)), int(q(sz.out[-1]))
    if inp0 + last > cap:
        return None, float("inf")
    kl, ka = q(sz.keep_local).tolist(), q(sz.keep_add).tolist()
    sa = q(np.minimum(sz.seg_add, np.int64(cap + 1) * g)).tolist()  # _BIG (invalid) must not overflow
    sl, sw = q(sz.seg_local), q(sz.seg_worst)
    nested = allow_segments and sz.nseg_local is not None
    nsl, nsw = (q(sz.nseg_local), q(sz.nseg_worst)) if nested else (sl, sw)
    cum = np.concatenate([[0.0], np.cumsum(costs)]).tolist()
    xcum = np.concatenate([[0.0], np.cumsum(costs if extra_costs is None else extra_costs)]).tolist()
    n_sel = 0 if sel_costs is None or sz.sel_local is None else sz.sel_local.shape[0]
    if n_sel:
        big = np.int64(cap + 1) * g
        sel_l = q(np.minimum(sz.sel_local, big))
        sel_a = q(np.minimum(sz.sel_add, big))
        # cumulative per-stage costs of each option: group t..j costs scum[k][j+1] - scum[k][t]
        # (a stage without the option costs 0 here: sel_local already forbids every group holding it)
        costs_k = np.where(np.isfinite(sel_costs), sel_costs, 0.0)
        scum = [np.concatenate([[0.0], np.cumsum(c)]).tolist() for c in costs_k]
    table = np.full((n + 1, cap + 1), np.inf)
    table[n, : cap - last + 1] = 0.0
    buf = np.empty(cap + 1)
    for t in range(n - 1, -1, -1):
        row = table[t]
        if kl[t] <= cap:
            w = cap - kl[t] + 1
            np.minimum(row[:w], table[t + 1, ka[t]: ka[t] + w], out=row[:w])
        j_end = n if allow_segments else t + 1
        sl_t, sw_t, sa_t = sl[t].tolist(), sw[t].tolist(), sa[t]
        for j in range(t, j_end):
            if sw_t[j] > cap:   # the re-materialised part only grows with j
                break
            if sl_t[j] > cap:
                continue
            w = cap - sl_t[j] + 1
            np.add(table[j + 1, sa_t[j]: sa_t[j] + w], cum[j + 1] - cum[t], out=buf[:w])
            np.minimum(row[:w], buf[:w], out=row[:w])
        for k in range(n_sel):  # selective groups t..j: some op outputs kept, the rest re-run
            sl_k, sa_k, sc = sel_l[k, t].tolist(), sel_a[k, t].tolist(), scum[k]
            for j in range(t, j_end):
                if sw_t[j] > cap:
                    break
                reach = max(sl_k[j], sa_k[j])   # a prefix above cap is infeasible anyway
                # never better than the plain recompute group t..j, which retains and holds no more
                if reach > cap or sc[j + 1] - sc[t] >= cum[j + 1] - cum[t]:
                    continue
                w = cap - reach + 1
                np.add(table[j + 1, sa_k[j]: sa_k[j] + w], sc[j + 1] - sc[t], out=buf[:w])
                np.minimum(row[:w], buf[:w], out=row[:w])
        if nested:  # two-level groups: less memory, their stages' forward once more
            nsl_t, nsw_t = nsl[t].tolist(), nsw[t].tolist()
            for j in range(t + 1, n):
                if nsw_t[j] > cap:
                    break
                if nsl_t[j] > cap or nsl_t[j] >= sl_t[j]:  # never better where the one-level group fits
                    continue
                w = cap - nsl_t[j] + 1
                np.add(table[j + 1, sa_t[j]: sa_t[j] + w], (cum[j + 1] - cum[t]) + (xcum[j + 1] - xcum[t]),
                       out=buf[:w])
                np.minimum(row[:w], buf[:w], out=row[:w])
    best = float(table[0, inp0])
    if not np.isfinite(best):
        return None, best
    # Walk forward repeating the same float operations, so the argmin matches the table exactly;
    # keep is tried first, then shorter segments.
    spans: list[tuple[int, int, str]] = []
    t, p = 0, inp0
    while t < n:
        val = table[t, p]
        if kl[t] + p <= cap and table[t + 1, p + ka[t]] == val:
            spans.append((t, t, KEEP))
            t, p = t + 1, p + ka[t]
            continue
        for j in range(t, n if allow_segments else t + 1):
            if int(sl[t, j]) + p <= cap and table[j + 1, p + sa[t][j]] + (cum[j + 1] - cum[t]) == val:
                spans.append((t, j, RECOMPUTE))
                t, p = j + 1, p + sa[t][j]
                break
        else:
            chosen = next(((k, j) for k in range(n_sel) for j in range(t, n if allow_segments else t + 1)
                           if max(int(sel_l[k, t, j]), int(sel_a[k, t, j])) + p <= cap
                           and table[j + 1, p + int(sel_a[k, t, j])] + (scum[k][j + 1] - scum[k][t]) == val), None)
            if chosen is not None:
                k, j = chosen
                spans.append((t, j, selective_policy(sz.sel_names[k])))
                t, p = j + 1, p + int(sel_a[k, t, j])
                continue

            for j in range(t + 1, n if nested else t + 1):
                if (int(nsl[t, j]) + p <= cap and int(nsl[t, j]) < int(sl[t, j])
                        and table[j + 1, p + sa[t][j]] + ((cum[j + 1] - cum[t]) + (xcum[j + 1] - xcum[t])) == val):
                    spans.append((t, j, NESTED))
                    t, p = j + 1, p + sa[t][j]
                    break
            else:
                raise AssertionError("dp reconstruction lost the optimal path")
    return schedule_from_groups(sz.m, n, spans), best


def _budget_error(chain: CostChain, budget_bytes: int, cands: list[int], allow_segments: bool,
                  solver: str = "dp") -> BudgetError:
    need = min_feasible_bytes(chain, micro_batch_sizes=cands, allow_segments=allow_segments)
    what = "keep/recompute schedule" + ("" if allow_segments else " without recompute segments")
    msg = (f"{solver}: no {what} fits a budget of {format_bytes(budget_bytes)} for a batch of "
           f"{chain.batch_size}; the smallest budget that fits is {format_bytes(need)} ({need} bytes: "
           f"{format_bytes(chain.fixed_bytes)} of parameters, gradients, optimizer state and batch, the "
           f"rest activations). Raise the budget to at least {format_bytes(need)}")
    if min(cands) > 1:
        need_1 = min_feasible_bytes(chain, micro_batch_sizes=[1], allow_segments=allow_segments)
        if need_1 < need:
            msg += f", or allow smaller micro-batches (micro-batch 1 fits {format_bytes(need_1)})"
    if not allow_segments:
        msg += ", or allow recompute segments"
    if chain.fixed_bytes > budget_bytes:
        msg += "; the fixed state alone exceeds the budget, so a smaller model or an optimizer with less " \
               "state (e.g. SGD without momentum) is the other way"
    return BudgetError(msg + ".", budget_bytes=budget_bytes, min_feasible_bytes=need)


def solve_dp(chain: CostChain, budget_bytes: int, *, micro_batch_sizes: Sequence[int] | None = None,
             allow_segments: bool = True, max_buckets: int = 4096, selective: bool = True) -> Plan:
    """Fastest keep/recompute schedule under a memory budget, by dynamic programming (exact).

    Algorithm: for every candidate micro-batch size ``m`` (pruned once even its recompute-free time
    cannot beat the best plan found), a backward dynamic programme over (group boundary ``t``, resident
    prefix bytes ``P``) chooses per stage keep or recompute and the recompute segments ``i..j``
    (module doc), and for stages with per-op options (``StageCost.selective``) whether to run one of them.
    Complexity ``O(#m * n^2 * K)`` time and ``O(n * K)`` memory with segments,
    ``O(#m * n * K)`` without, where ``K <= max_buckets`` is the number of byte buckets.

    Bytes are counted in buckets of ``g`` bytes, with every size rounded up, so a plan found always fits
    under :func:`edgetrain.graph.simulate`; it is the exact optimum when all sizes are multiples of
    ``g`` (always so for ``g = 1``; ``g`` is the sizes' common divisor when that keeps ``K`` in range).
    Otherwise the rounding costs at most about ``n * g`` bytes of budget; the planner then also considers
    the exact minimum-memory schedule (so it never fails where a plan fits) and proves a gap with a
    second pass that rounds down (a relaxation), reported as ``optimality_gap``.
    Ties (times within ``TIME_RTOL``) go to fewer recomputed stages, then to the larger micro-batch.

    Args:
        chain: the profiled chain.
        budget_bytes: peak bytes the step may use (fixed bytes included).
        micro_batch_sizes: sizes allowed; ``None`` tries the balanced size ``ceil(B/k)`` for every
            number of micro-batches ``k``.
        allow_segments: allow recompute groups of several stages (else every group is one stage).
        max_buckets: byte buckets of the budget axis (accuracy vs time and memory).
        selective: plan the stages' per-op (selective) recompute options where the chain has them
            (``False``: whole-stage policies only).

    Returns:
        The plan (``solver="dp"``), its predictions from :func:`edgetrain.graph.simulate`.

    Raises:
        BudgetError: no schedule fits; carries the smallest feasible budget.
        ValueError: bad micro-batch sizes or ``max_buckets < 16``.
    """
    start = time.perf_counter()
    if max_buckets < 16:
        raise ValueError(f"max_buckets must be >= 16, got {max_buckets}")
    budget_bytes = int(budget_bytes)
    chain = hashable(chain if selective else without_selective(chain))
    cands = candidate_micro_batches(chain, micro_batch_sizes)
    act_budget = budget_bytes - chain.fixed_bytes
    best: tuple[float, int, int, Schedule] | None = None
    lower = float("inf")        # proven lower bound on the optimal step time
    all_exact = True
    if act_budget >= 0:
        for m in sorted(cands, key=lambda m: (keep_time_s(chain, m), -m)):
            base = keep_time_s(chain, m)
            if best is not None and base > best[0] * (1 + TIME_RTOL):
                break   # sorted by this lower bound: no later m can win
            sz = sizes_at(chain, m)
            if min_prefix_path(sz, act_budget, allow_segments) is None:
                continue        # exactly infeasible at m
            if _keep_peak(sz) <= act_budget:
                found = [Schedule(m, (KEEP,) * chain.n, tuple(range(chain.n)))]
                lower = min(lower, base)
            else:
                g, exact = _bucket_size(sz, max_buckets)
                costs = recompute_costs(chain, m)
                # An epsilon per recomputed stage makes the DP prefer fewer of them among near-ties.
                eps = TIME_RTOL * base / (10 * (chain.n + 1))
                sel = selective_costs(chain, m)
                sched, _ = _dp_at(sz, costs + eps, act_budget, g, allow_segments, extra_costs=costs,
                                  sel_costs=sel + eps)
                found = [] if sched is None else [sched]
                if exact:
                    lower = min(lower, base if sched is None else
                                simulate(chain, m, sched.policies, sched.groups, sched.nested_groups).step_time_s)
                else:
                    all_exact = False
                    found.append(min_peak_schedule(chain, m, allow_segments)[1])
                    _, relaxed = _dp_at(sz, costs, act_budget, g, allow_segments, round_up=False, sel_costs=sel)
                    lower = min(lower, base + relaxed)
            for s in found:
                t_s = simulate(chain, s.m, s.policies, s.groups, s.nested_groups).step_time_s
                if best is None or better(t_s, s.recomputed, s.m, best[0], best[1], best[2]):
                    best = (t_s, s.recomputed, s.m, s)
    if best is None:
        raise _budget_error(chain, budget_bytes, cands, allow_segments)
    step_s, _, m, sched = best
    gap: float | None = 0.0
    notes: list[str] = []
    if not all_exact:
        gap = max(0.0, (step_s - lower) / lower) if 0 < lower < float("inf") else None
        notes.append("bytes rounded up to buckets for speed; proven optimality gap "
                     + ("unknown" if gap is None else f"{gap:.2%}"))
    elapsed = time.perf_counter() - start
    logger.info("dp: %d stages, budget %s, %d micro-batch sizes: m=%d, %d recomputed, %.3f s to solve",
                chain.n, format_bytes(budget_bytes), len(cands), m, sched.recomputed, elapsed)
    return plan_from_schedule(chain, m, sched.policies, sched.groups, nested_groups=sched.nested_groups,
                              solver="dp", solve_time_s=elapsed,
                              budget_bytes=budget_bytes, optimality_gap=gap, notes=notes)


def min_feasible_bytes(chain: CostChain, *, micro_batch_sizes: Sequence[int] | None = None,
                       allow_segments: bool = True) -> int:
    """The smallest budget (bytes, fixed bytes included) under which some keep/recompute schedule fits.

    Exact: for each micro-batch size, bisection over the integer budget with an exact ``O(n^2)``
    feasibility test (smallest reachable prefix per group boundary); a size is skipped at once when it
    does not fit the best budget found so far.

    Args:
        chain: the profiled chain.
        micro_batch_sizes: sizes allowed (``None``: the balanced sizes, as :func:`solve_dp`).
        allow_segments: allow recompute groups of several stages.

    Returns:
        The budget in bytes; ``solve_dp(chain, min_feasible_bytes(chain))`` succeeds.
    """
    best: int | None = None
    chain = hashable(chain)
    for m in sorted(candidate_micro_batches(chain, micro_batch_sizes)):
        if best is not None and min_prefix_path(sizes_at(chain, m), best - 1, allow_segments) is None:
            continue
        peak, _ = min_peak_schedule(chain, m, allow_segments)
        best = peak if best is None else min(best, peak)
    assert best is not None
    return chain.fixed_bytes + best
