"""Exact choice of the parameter tensors to train within a step-time budget (ElasticTrainer, corrected).

Framework-free: plain floats and numpy, no torch. Tensors are indexed ``0..N-1`` in forward
(execution) order, so tensor 0 is the input-most one. Training a set ``S`` with deepest (input-most)
member ``d = min(S)`` costs, per step,

    fixed_s + depth_s[d] + sum_{k in S} weight_grad_s[k]

where ``fixed_s`` is what every step pays (a frozen forward pass, the loss and its backward),
``weight_grad_s[k]`` the weight-gradient time of tensor ``k`` plus its optimizer update, and
``depth_s[d]`` what reaching down to ``d`` costs: the input-gradient time from the output down to the
*output* of ``d``'s layer, plus recording the autograd graph for the layers from ``d``'s up.
Two corrections to the original ElasticTrainer selection:

* the input-most tensor (index 0) is a candidate like any other (the original's loop never reached it);
* the deepest selected tensor's own input gradient is not charged: nothing below it needs a gradient,
  so backpropagation stops at its layer's output (the original charged it).

The objective is the total importance of ``S``; :func:`select_tensors` maximises it exactly on a
discretised time grid. With the remaining budget ``R = budget_s - fixed_s`` cut into ``T`` units of
``R / T`` seconds, every cost is rounded *up* to whole units and the capacity is exactly ``T`` units, so
a selection that fits the grid also fits the real budget (conservative: the grid can only reject a set
whose real cost is within ``|S|`` units of the budget). For each choice of ``d`` (forced into ``S``),
a 0/1 knapsack over the tensors above ``d`` picks the rest. Sweeping ``d`` from the output down and
adding one item at a time to a single knapsack table gives every ``d`` in ``O(N * T)`` time and
``O(N * T)`` bits (the take-table used to read back the chosen set).
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...errors import BudgetError, InputError

__all__ = ["Selection", "SpeedupPlan", "solve_units", "select_tensors", "selection_time_s",
           "plan_for_speedup"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Selection:
    """A set of tensors chosen to train and what it is predicted to cost.

    Attributes:
        indices: chosen tensor indices, ascending (forward order); ``indices[0]`` is the deepest.
        time_s: predicted step time of training exactly these tensors.
        importance: total importance of the chosen tensors.
        budget_s: the step-time budget the choice had to fit.
    """

    indices: tuple[int, ...]
    time_s: float
    importance: float
    budget_s: float


@dataclass(frozen=True)
class SpeedupPlan:
    """The answer to "train at ``requested`` times the speed of full fine-tuning".

    Attributes:
        selection: the chosen tensors.
        requested_speedup: the speed-up asked for.
        reachable_speedup: the largest speed-up any non-empty selection can reach (forward bound).
        predicted_speedup: ``full_step_s / selection.time_s``.
        clamped: True when the request exceeded ``reachable_speedup`` and was lowered to it.
    """

    selection: Selection
    requested_speedup: float
    reachable_speedup: float
    predicted_speedup: float
    clamped: bool


def solve_units(values: Sequence[float], weights: Sequence[int], forced_weights: Sequence[int],
                capacity: int) -> tuple[tuple[int, ...], float]:
    """Exact integer core: choose ``S`` maximising ``sum(values[S])`` on the unit grid.

    The cost of ``S`` with ``d = min(S)`` is ``forced_weights[d] + sum_{k in S, k > d} weights[k]``
    (``forced_weights[d]`` covers ``d``'s own weight gradient and the input gradients down to it).

    Complexity: ``O(N * capacity)`` time, ``O(N * capacity)`` bits.

    Args:
        values: value of each item (negative values are allowed; such items are taken only when forced
            as the deepest and nothing better exists).
        weights: non-negative integer weight of each item when it is not the deepest.
        forced_weights: non-negative integer weight of each item when it is the deepest.
        capacity: integer capacity (>= 0).

    Returns:
        ``(indices, total_value)`` of an optimal non-empty selection, or ``((), -inf)`` when no single
        item fits. Ties go to the shallower deepest item.
    """
    n = len(values)
    if not (len(weights) == len(forced_weights) == n):
        raise InputError("values, weights and forced_weights must have the same length")
    cap = int(capacity)
    if cap < 0:
        return (), -math.inf
    best = np.zeros(cap + 1)             # best[c]: max value of items above d with weight <= c
    take = np.zeros((n, cap + 1), dtype=bool)
    best_total, best_d = -math.inf, -1
    for d in range(n - 1, -1, -1):       # table holds items d+1..n-1 here
        fw = int(forced_weights[d])
        if fw <= cap:
            total = float(values[d]) + float(best[cap - fw])
            if total > best_total:
                best_total, best_d = total, d
        w, v = int(weights[d]), float(values[d])
        if v > 0 and w <= cap:           # add item d to the table for the next (deeper) d
            cand = best[: cap + 1 - w] + v
            better = cand > best[w:]
            take[d, w:] = better
            best[w:] = np.where(better, cand, best[w:])
    if best_d < 0:
        return (), -math.inf
    chosen, c = [best_d], cap - int(forced_weights[best_d])
    for k in range(best_d + 1, n):       # read back in the order the table was built (reversed)
        if take[k, c]:
            chosen.append(k)
            c -= int(weights[k])
    return tuple(chosen), best_total


def selection_time_s(indices: Sequence[int], weight_grad_s: Sequence[float],
                     depth_s: Sequence[float], fixed_s: float) -> float:
    """Predicted step time of training exactly ``indices`` (the cost model in the module docstring)."""
    if not indices:
        return float(fixed_s)
    d = min(indices)
    return float(fixed_s) + float(depth_s[d]) + float(sum(weight_grad_s[k] for k in indices))


def select_tensors(importance: Sequence[float], weight_grad_s: Sequence[float],
                   depth_s: Sequence[float], fixed_s: float, budget_s: float,
                   time_units: int = 10_000) -> Selection:
    """Choose the tensors of maximum total importance whose step time fits ``budget_s``.

    Exact on a grid of ``time_units`` units over ``budget_s - fixed_s``, with costs rounded up so the
    result never exceeds the budget (see the module docstring). ``O(N * time_units)``.

    Args:
        importance: importance of each tensor (forward order); negative values count as 0.
        weight_grad_s: weight-gradient + update seconds of each tensor.
        depth_s: seconds of reaching down to each tensor as the deepest (input gradients from the
            output to its layer's output, graph recording from its layer up).
        fixed_s: seconds paid whatever is selected (forward, loss, backward of the loss).
        budget_s: the step-time budget in seconds.
        time_units: grid resolution ``T``.

    Returns:
        The chosen :class:`Selection` (never empty).

    Raises:
        BudgetError: not even one tensor fits the budget.
        InputError: the sequences differ in length or ``time_units < 1``.
    """
    n = len(importance)
    if not (len(weight_grad_s) == len(depth_s) == n) or n == 0:
        raise InputError("importance, weight_grad_s and depth_s must be non-empty and equally long")
    if time_units < 1:
        raise InputError(f"time_units must be >= 1, got {time_units}")
    values = [max(0.0, float(v)) for v in importance]
    forced_s = [float(depth_s[k]) + float(weight_grad_s[k]) for k in range(n)]
    room_s = float(budget_s) - float(fixed_s)
    fits = [k for k in range(n)
            if selection_time_s((k,), weight_grad_s, depth_s, fixed_s) <= budget_s]
    if not fits:
        cheapest = min(forced_s) + float(fixed_s)
        raise BudgetError(
            f"no tensor can be trained within {budget_s:.6g} s per step: forward and loss alone take "
            f"{fixed_s:.6g} s and the cheapest single tensor needs {cheapest:.6g} s; ask for a smaller "
            "speed-up")
    if room_s <= 0:
        chosen: tuple[int, ...] = (max(fits, key=lambda k: (values[k], k)),)
    else:
        unit_s = room_s / time_units
        weights = [math.ceil(float(w) / unit_s) for w in weight_grad_s]
        forced = [math.ceil(f / unit_s) for f in forced_s]
        chosen, _ = solve_units(values, weights, forced, time_units)
        if not chosen:   # float rounding at the very edge of the grid: fall back to one real fit
            chosen = (max(fits, key=lambda k: (values[k], k)),)
    chosen = tuple(sorted(chosen))
    time_s = selection_time_s(chosen, weight_grad_s, depth_s, fixed_s)
    return Selection(chosen, time_s, float(sum(values[k] for k in chosen)), float(budget_s))


def plan_for_speedup(importance: Sequence[float], weight_grad_s: Sequence[float],
                     depth_s: Sequence[float], fixed_s: float, full_step_s: float,
                     speedup: float, time_units: int = 10_000, warn: bool = True,
                     slack: float = 0.0) -> SpeedupPlan:
    """Select tensors for a step ``speedup`` times faster than full fine-tuning, or the fastest possible.

    The budget is ``full_step_s / speedup``. A request beyond what any selection reaches (the forward
    pass bounds it) is lowered to the reachable speed-up with a :class:`UserWarning` and a log record
    naming both numbers; it is never missed silently.

    Speed-ups closer than ``slack`` cannot be told apart by the caller's measurements (the selector
    passes its ``calibration_tolerance``), so the budget is never below ``1 + slack`` times the fastest
    selection's time: at and near the limit (``speedup=math.inf`` included) the plan is the most
    important selection that fast, not the single fastest tensor (e.g. a classifier's weight and bias
    instead of its bias alone). The budget stays non-increasing in ``speedup``.

    Args:
        importance, weight_grad_s, depth_s, fixed_s, time_units: as for :func:`select_tensors`.
        full_step_s: step time of full fine-tuning (all tensors).
        speedup: requested speed-up (>= 1; 1 trains every tensor).
        warn: raise the warning (and log it at WARNING) when the request is lowered; False logs it
            at INFO only (for repeated re-selections after the first warning).
        slack: the relative step-time resolution described above (>= 0; 0: the fastest exactly).

    Returns:
        The :class:`SpeedupPlan`.

    Raises:
        InputError: ``speedup < 1`` or not finite-or-inf positive, or ``slack < 0``.
    """
    if not speedup >= 1.0:
        raise InputError(f"speedup must be >= 1.0 (1.0 trains every tensor), got {speedup}")
    if not slack >= 0.0:
        raise InputError(f"slack must be >= 0, got {slack}")
    n = len(importance)
    singles = [fixed_s + depth_s[k] + weight_grad_s[k] for k in range(n)]
    fastest_s = float(min(singles))
    reachable = full_step_s / fastest_s if fastest_s > 0 else math.inf
    if speedup == 1.0:
        idx = tuple(range(n))
        t = selection_time_s(idx, weight_grad_s, depth_s, fixed_s)
        sel = Selection(idx, t, float(sum(max(0.0, v) for v in importance)), float(full_step_s))
        return SpeedupPlan(sel, 1.0, reachable, full_step_s / t, False)
    clamped = speedup > reachable
    if clamped:
        msg = (f"requested speed-up {speedup:.3g}x is beyond the reachable {reachable:.3g}x: the forward "
               f"pass and loss alone take {fixed_s:.4g} s of the {full_step_s:.4g} s full step; training "
               f"at {reachable:.3g}x instead" + (f" (within {100 * slack:.3g}%)" if slack else ""))
        if warn:
            logger.warning(msg)
            warnings.warn(msg, UserWarning, stacklevel=2)
        else:
            logger.info(msg)
        budget_s = fastest_s
    else:
        budget_s = full_step_s / speedup
    budget_s = max(budget_s, fastest_s * (1.0 + slack))
    sel = select_tensors(importance, weight_grad_s, depth_s, fixed_s, budget_s, time_units)
    return SpeedupPlan(sel, float(speedup), reachable, full_step_s / sel.time_s, clamped)
