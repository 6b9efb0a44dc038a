"""Exact dynamic programme for the POET problem on chains: Pareto fronts over resident prefix bytes.

The same problem as :func:`edgetrain.planners.poet_milp.solve_poet` (same model, same Plan), solved exactly
without an LP solver. For a fixed in-flight window ``W`` (paged stages whose pack fits it page
asynchronously, the rest synchronously) a schedule is a path over group boundaries ``0..n``; the state at
a boundary is the resident prefix ``P`` and whether the stage before was paged (its boundary must come
back for the next group). A smaller prefix is never worse for the rest of the chain, so at each
(boundary, flag) only the Pareto front of (prefix, cost) survives, or of (prefix, energy, time) when
energy is minimised under a time budget. ``W`` ranges over 0 and the stages' pack sizes; the best over
all windows and micro-batch sizes is optimal (gap 0). Cost: ``O(|W| n^2 F)`` per size for fronts of
``F`` points. Two exact prunings keep ``F`` down: a point whose prefix leaves no feasible way to the loss
(a backward pass gives the largest completable prefix per boundary) and a point already costing more
than the incumbent (a thinned DP run first, or another size's plan) are dropped before the Pareto
filter. The time limit is hard: the clock is checked at every boundary, and on expiry the best plan so
far is returned with the gap that was proven.
"""

from __future__ import annotations

import bisect
import time
from typing import Sequence

import numpy as np

from ..devices import DeviceProfile
from ..graph import CostChain
from ..plan import Plan
from ._poet_search import Candidate, plan_search, schedule_from_vectors, window_candidates
from .paging_model import PagingArrays

__all__ = ["solve_poet_dp", "solve_poet_dp_at", "SOLVER"]

SOLVER = "poet-dp"
_HEURISTIC_FRONT = 16     # points per front in the incumbent-finding pass
_HEURISTIC_SEGMENT = 12   # longest recompute group it tries


class _TimedOut(Exception):
    """The deadline passed inside a window's search."""


def _pareto(p: np.ndarray, c: np.ndarray, t: np.ndarray | None, deadline: float | None = None) -> np.ndarray:
    """Indices of the points no other point beats in every coordinate (lowest prefix first).

    Raises:
        _TimedOut: ``deadline`` (a ``time.perf_counter()`` value) passed during the three-coordinate scan.
    """
    order = np.lexsort((c, p)) if t is None else np.lexsort((t, c, p))
    if t is None:
        cs = c[order]
        prev_min = np.concatenate([[np.inf], np.minimum.accumulate(cs)[:-1]])
        return order[cs < prev_min]
    # Points come by increasing prefix; one is dominated iff a kept point has cost and time no larger.
    # The kept points' (cost, time) staircase answers that by bisection.
    keep: list[int] = []
    stair_c: list[float] = []
    stair_t: list[float] = []
    for n_seen, i in enumerate(order.tolist()):
        if deadline is not None and n_seen % 4096 == 4095 and time.perf_counter() > deadline:
            raise _TimedOut
        ci, ti = float(c[i]), float(t[i])
        k = bisect.bisect_right(stair_c, ci)
        if k and stair_t[k - 1] <= ti:
            continue
        keep.append(i)
        end = k
        while end < len(stair_c) and stair_t[end] >= ti:
            end += 1
        stair_c[k:end] = [ci]
        stair_t[k:end] = [ti]
    return np.array(keep, dtype=np.int64)


def _thin(idx: np.ndarray, limit: int | None) -> np.ndarray:
    """At most ``limit`` points of a front (its two ends and evenly spaced ones between): a heuristic."""
    if limit is None or len(idx) <= limit:
        return idx
    return idx[np.unique(np.linspace(0, len(idx) - 1, limit).round().astype(np.int64))]


def _completable(arr: PagingArrays, cap: int, paging: bool, recompute: bool,
                 max_segment: int | None) -> np.ndarray:
    """``[flag, s]``: the largest prefix at boundary ``s`` from which the rest of the chain fits ``cap``.

    Feasibility only gets harder as the prefix grows (every constraint is ``P + const <= cap`` and every
    move adds to ``P``), so a point above this bound has no feasible completion: the exact search drops
    it before the Pareto filter. Backward over the same moves as :func:`_solve_window`.
    """
    n = arr.n
    lowest = np.iinfo(np.int64).min // 4
    pmax = np.full((2, n + 1), lowest, dtype=np.int64)
    pmax[:, n] = cap - arr.out[-1]
    for s in range(n - 1, -1, -1):
        last = n if max_segment is None else min(n, s + max_segment)
        for flag in (0, 1):
            if flag and s == 0:
                continue
            back = int(arr.out[s - 1]) if flag else 0
            best = lowest
            room = cap - back - int(arr.keep_local[s])
            if room >= 0:
                best = max(best, min(room, int(pmax[0, s + 1]) - int(arr.keep_add[s])))
                if paging and arr.page_ok[s]:
                    best = max(best, min(room, int(pmax[1, s + 1]) - int(arr.page_add[s])))
            if recompute:
                seg = cap - back - arr.seg_local[s, s:last]
                nxt = pmax[0, s + 1:last + 1] - arr.out[s:last]
                ok = seg >= 0
                if ok.any():
                    best = max(best, int(np.minimum(seg, nxt)[ok].max()))
            pmax[flag, s] = best
    return pmax


def _solve_window(arr: PagingArrays, cap: int, window: int, *, energy: bool, time_cap_s: float | None,
                  paging: bool, recompute: bool, max_front: int | None = None,
                  max_segment: int | None = None, deadline: float | None = None,
                  cost_cap: float | None = None) -> tuple[float, list[tuple[int, int, int]]] | None:
    """Best (cost, spans) for one window; spans are ``(first, last, kind)`` with kind 0 keep/1 page/2 rec.

    ``max_front`` thins every front to that many points and ``max_segment`` caps recompute groups at
    that many stages: fast and feasible, but no longer exact. Points that cannot reach the loss within
    the memory cap (:func:`_completable`) or whose cost already exceeds ``cost_cap`` (an incumbent's
    added cost; every move adds a non-negative cost) are dropped, which keeps the search exact.

    Raises:
        _TimedOut: ``deadline`` (a ``time.perf_counter()`` value) passed; checked at every boundary.
    """
    n = arr.n
    pmax = _completable(arr, cap, paging, recompute, max_segment)
    c_cap = None if cost_cap is None else cost_cap * (1 + 1e-12) + 1e-15
    rec_cost = arr.rec_energy_j if energy else arr.rec_time_s
    is_async = (arr.pack <= window) & (window > 0)
    page_time = np.where(is_async, arr.async_time_s, arr.sync_time_s)
    page_cost = arr.page_energy_j if energy else page_time
    base = arr.base_energy_j if energy else arr.base_time_s
    track_t = energy and time_cap_s is not None
    t_room = None if time_cap_s is None else time_cap_s - arr.base_time_s
    rec_cum = np.concatenate([[0.0], np.cumsum(rec_cost)])
    rect_cum = np.concatenate([[0.0], np.cumsum(arr.rec_time_s)])
    # pending[(s, flag)]: lists of (P, C, T, from_s, from_flag, from_idx, kind)
    pending: dict[tuple[int, int], list[tuple[np.ndarray, ...]]] = {}
    fronts: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}

    def push(key: tuple[int, int], *cols: np.ndarray) -> None:
        if len(cols[0]):
            pending.setdefault(key, []).append(cols)

    z = np.zeros(1)
    push((0, 0), np.array([arr.inp0], dtype=np.int64), z, z, np.array([-1]), np.array([-1]), np.array([-1]),
         np.array([-1]))
    for s in range(n + 1):
        for flag in (0, 1):
            parts = pending.pop((s, flag), None)
            if not parts:
                continue
            if deadline is not None and time.perf_counter() > deadline:
                raise _TimedOut
            cols = [np.concatenate([p[k] for p in parts]) for k in range(7)]
            p, c, tt = cols[0], cols[1], cols[2]
            ok = p <= pmax[flag, s]
            if t_room is not None:
                ok &= (tt if track_t else c) <= t_room * (1 + 1e-12) + 1e-15
            if c_cap is not None:
                ok &= c <= c_cap
            if not ok.all():
                cols = [col[ok] for col in cols]
                p, c, tt = cols[0], cols[1], cols[2]
            if not len(p):
                continue
            keep_idx = _thin(_pareto(p, c, tt if track_t else None, deadline), max_front)
            cols = [col[keep_idx] for col in cols]
            fronts[(s, flag)] = tuple(cols)
            if s == n:
                continue
            p, c, tt = cols[0], cols[1], cols[2]
            idx = np.arange(len(p))
            back = arr.out[s - 1] if flag else 0
            here = p + back
            last = n if max_segment is None else min(n, s + max_segment)
            fits = (here[:, None] + arr.seg_local[s, s:last][None, :] <= cap) & recompute
            for j in range(s, last):
                sel = fits[:, j - s]
                if sel.any():
                    push((j + 1, 0), p[sel] + arr.out[j], c[sel] + (rec_cum[j + 1] - rec_cum[s]),
                         tt[sel] + (rect_cum[j + 1] - rect_cum[s]), np.full(sel.sum(), s), np.full(sel.sum(), flag),
                         idx[sel], np.full(sel.sum(), 2))
            sel = here + arr.keep_local[s] <= cap
            if sel.any():
                k = int(sel.sum())
                push((s + 1, 0), p[sel] + arr.keep_add[s], c[sel], tt[sel], np.full(k, s), np.full(k, flag),
                     idx[sel], np.zeros(k, dtype=np.int64))
                if paging and arr.page_ok[s]:
                    push((s + 1, 1), p[sel] + arr.page_add[s], c[sel] + page_cost[s], tt[sel] + page_time[s],
                         np.full(k, s), np.full(k, flag), idx[sel], np.ones(k, dtype=np.int64))
    best: tuple[float, int, int] | None = None
    for flag in (0, 1):
        if (n, flag) not in fronts:
            continue
        p, c = fronts[(n, flag)][0], fronts[(n, flag)][1]
        ok = np.flatnonzero(p + arr.out[-1] <= cap)
        if len(ok):
            i = int(ok[np.argmin(c[ok])])
            if best is None or c[i] < best[0]:
                best = (float(c[i]), flag, i)
    if best is None:
        return None
    spans: list[tuple[int, int, int]] = []
    s, flag, i = n, best[1], best[2]
    while s > 0:
        cols = fronts[(s, flag)]
        fs, ff, fi, kind = int(cols[3][i]), int(cols[4][i]), int(cols[5][i]), int(cols[6][i])
        spans.append((fs, s - 1, kind))
        s, flag, i = fs, ff, fi
    return base + best[0], spans[::-1]


def solve_poet_dp_at(arr: PagingArrays, act_budget: int, *, objective: str, time_cap_s: float | None,
                     paging: bool, recompute: bool = True, deadline: float | None = None,
                     windows: Sequence[int] | None = None, max_front: int | None = None,
                     max_segment: int | None = None, incumbent: float | None = None) -> Candidate | None:
    """The exact optimum at one micro-batch size (module doc), or ``None`` when nothing fits.

    Args:
        arr: the model's arrays at this size.
        act_budget: bytes available to activations.
        objective: ``"energy"`` or ``"time"``.
        time_cap_s: the most step seconds allowed (``None``: no time budget).
        paging: whether stages may be paged.
        recompute: whether stages may be recomputed.
        deadline: ``time.perf_counter()`` value at which the search stops, inside a window too (checked
            at every boundary); the best window finished by then is returned, marked unproven, or
            ``None`` when none finished.
        windows: in-flight windows to try (default: every candidate). With the energy objective and no
            time budget only window 0 is needed: making a page synchronous changes no joule and frees
            its window, so the best synchronous schedule is optimal.
        max_front: thin fronts to this many points (a fast heuristic, marked unproven); ``None``: exact.
        max_segment: longest recompute group tried (a heuristic too); ``None``: any.
        incumbent: an objective already achieved (another size's plan): partial schedules costing more
            are dropped, and a size that cannot beat it returns a schedule-less candidate bounded by it.
    """
    best: tuple[float, list[tuple[int, int, int]], int] | None = None
    proven = True
    base = arr.base_energy_j if objective == "energy" else arr.base_time_s
    if windows is None:
        windows = (0,) if objective == "energy" and time_cap_s is None else window_candidates(arr, paging)
    for w in windows:
        if w > act_budget:
            break
        if deadline is not None and time.perf_counter() > deadline:
            proven = False
            break
        bar = min(v for v in (incumbent, None if best is None else best[0]) if v is not None) \
            if incumbent is not None or best is not None else None
        try:
            got = _solve_window(arr, int(act_budget - w), int(w), energy=objective == "energy",
                                time_cap_s=time_cap_s, paging=paging, recompute=recompute, max_front=max_front,
                                max_segment=max_segment, deadline=deadline,
                                cost_cap=None if bar is None else bar - base)
        except _TimedOut:
            proven = False
            break
        if got is not None and (best is None or got[0] < best[0]):
            best = (got[0], got[1], int(w))
    proven &= max_front is None and max_segment is None
    if best is None:
        if proven:    # searched everything: nothing at this size fits (or beats the incumbent)
            return Candidate(None, np.inf, np.inf if incumbent is None else incumbent, proven=True)
        return None
    n = arr.n
    page, rec, end = [False] * n, [False] * n, [False] * n
    for i, j, kind in best[1]:
        for u in range(i, j + 1):
            page[u], rec[u] = kind == 1, kind == 2
        end[j] = kind == 2
    sched = schedule_from_vectors(arr.m, page, rec, end, best[2])
    return Candidate(sched, best[0], best[0] if proven else -np.inf, proven=proven)


def solve_poet_dp(chain: CostChain, budget_bytes: int, *, device: DeviceProfile, objective: str = "energy",
                  time_budget: float | None = None, paging: bool = True, recompute: bool = True,
                  micro_batch_sizes: Sequence[int] | None = None, time_limit_s: float = 60.0) -> Plan:
    """Exact optimum of :func:`edgetrain.planners.poet_milp.solve_poet`'s problem by dynamic programming.

    Every size that fits first gets a fast schedule from the thinned DP (fronts of
    :data:`_HEURISTIC_FRONT` points, recompute groups of at most :data:`_HEURISTIC_SEGMENT` stages): an
    incumbent that prunes the exact search and the answer if the time runs out. ``time_limit_s`` is a
    hard limit: the clock is checked at every boundary of every window's search (and inside the Pareto
    filter), and the best plan found by then is returned with the gap that was proven.

    Args and Returns as :func:`~edgetrain.planners.poet_milp.solve_poet` (solver ``poet-dp``, gap 0 when the
    search finished within ``time_limit_s``).

    Raises:
        BudgetError: no plan fits (as ``solve_poet``).
        ValueError: an unknown objective or a non-positive time budget.
    """
    deadline = time.perf_counter() + time_limit_s

    def heuristic(arr: PagingArrays, act_budget: int, time_cap_s: float | None) -> Candidate | None:
        if time.perf_counter() > deadline:
            return None
        return solve_poet_dp_at(arr, act_budget, objective=objective, time_cap_s=time_cap_s, paging=paging,
                                recompute=recompute, deadline=deadline, max_front=_HEURISTIC_FRONT,
                                max_segment=_HEURISTIC_SEGMENT)

    def at_m(arr: PagingArrays, act_budget: int, time_cap_s: float | None, remaining_s: float,
             incumbent: float | None) -> Candidate | None:
        return solve_poet_dp_at(arr, act_budget, objective=objective, time_cap_s=time_cap_s, paging=paging,
                                recompute=recompute, deadline=deadline, incumbent=incumbent)

    return plan_search(chain, budget_bytes, device=device, objective=objective, time_budget=time_budget,
                       paging=paging, micro_batch_sizes=micro_batch_sizes, time_limit_s=time_limit_s,
                       rel_gap=0.0, solve_at=at_m, solver=SOLVER, recompute=recompute, heuristic=heuristic)
