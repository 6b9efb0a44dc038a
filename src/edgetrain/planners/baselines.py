"""Baseline planners (what users do without edgetrain), returning the same :class:`Plan` as ``solve_dp``.

Each baseline fixes the keep/recompute pattern the way a common recipe does and then takes the largest
micro-batch size (from the same candidates as :func:`edgetrain.planners.solve_dp`) whose predicted peak
fits, i.e. plain gradient accumulation on top of that recipe.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

from ..errors import BudgetError
from ..graph import KEEP, RECOMPUTE, CostChain, simulate
from ..plan import Plan, plan_from_schedule
from ..units import format_bytes
from ._common import Schedule, better, candidate_micro_batches
from .dp import min_feasible_bytes

__all__ = ["solve_no_saving", "solve_recompute_all", "solve_chen_sqrt", "solve_checkpoint_sequential",
           "equal_chunks"]

# A pattern: (policies, groups) for the chain, independent of the micro-batch size.
_Pattern = tuple[tuple[str, ...], tuple[int, ...]]


def equal_chunks(n: int, k: int) -> list[tuple[int, int]]:
    """Split stages ``0..n-1`` into ``k`` consecutive chunks whose lengths differ by at most one."""
    size, extra = divmod(n, k)
    spans, start = [], 0
    for c in range(k):
        end = start + size + (1 if c < extra else 0)
        spans.append((start, end - 1))
        start = end
    return spans


def _pattern(n: int, spans: Sequence[tuple[int, int, str]]) -> _Pattern:
    """Policies and group ids for consecutive ``(first, last, policy)`` spans covering ``0..n-1``.

    A recompute span is one checkpoint group; a keep span is one group per stage.
    """
    policies: list[str] = []
    groups: list[int] = []
    for i, j, pol in spans:
        for t in range(i, j + 1):
            policies.append(pol)
            new_group = not groups or pol == KEEP or t == i
            groups.append(groups[-1] + 1 if groups and new_group else (groups[-1] if groups else 0))
    if len(policies) != n:
        raise AssertionError(f"spans cover {len(policies)} of {n} stages")
    return tuple(policies), tuple(groups)


def _largest_fitting(chain: CostChain, budget_bytes: int, pattern: _Pattern,
                     cands: list[int]) -> Schedule | None:
    policies, groups = pattern
    for m in cands:   # descending
        if simulate(chain, m, policies, groups).peak_bytes <= budget_bytes:
            return Schedule(m, policies, groups)
    return None


def _own_min(chain: CostChain, pattern: _Pattern, cands: list[int]) -> int:
    return min(simulate(chain, m, *pattern).peak_bytes for m in cands)


def _error(chain: CostChain, budget_bytes: int, solver: str, need: int, cands: list[int]) -> BudgetError:
    msg = (f"{solver}: nothing fits a budget of {format_bytes(budget_bytes)} for a batch of "
           f"{chain.batch_size}; this recipe needs at least {format_bytes(need)} ({need} bytes, at micro-batch "
           f"{min(cands)}). Raise the budget to at least {format_bytes(need)}")
    if min(cands) > 1:
        msg += ", allow smaller micro-batches"
    try:
        dp_need = min_feasible_bytes(chain, micro_batch_sizes=cands)
        if dp_need < need:
            msg += f", or use solver='dp', which fits down to {format_bytes(dp_need)}"
    except ValueError:
        pass
    return BudgetError(msg + ".", budget_bytes=budget_bytes, min_feasible_bytes=need)


def _solve_pattern(chain: CostChain, budget_bytes: int, solver: str, patterns: Sequence[_Pattern],
                   micro_batch_sizes: Sequence[int] | None, note: Callable[[Schedule], str]) -> Plan:
    """The fastest of ``patterns``, each at its largest fitting micro-batch size."""
    start = time.perf_counter()
    budget_bytes = int(budget_bytes)
    cands = candidate_micro_batches(chain, micro_batch_sizes)
    best: tuple[float, int, int, Schedule] | None = None
    for pat in patterns:
        s = _largest_fitting(chain, budget_bytes, pat, cands)
        if s is None:
            continue
        t_s = simulate(chain, s.m, s.policies, s.groups).step_time_s
        if best is None or better(t_s, s.recomputed, s.m, best[0], best[1], best[2]):
            best = (t_s, s.recomputed, s.m, s)
    if best is None:
        raise _error(chain, budget_bytes, solver, min(_own_min(chain, p, cands) for p in patterns), cands)
    s = best[3]
    return plan_from_schedule(chain, s.m, s.policies, s.groups, solver=solver,
                              solve_time_s=time.perf_counter() - start, budget_bytes=budget_bytes,
                              optimality_gap=None, notes=[note(s)])


def solve_no_saving(chain: CostChain, budget_bytes: int, *,
                    micro_batch_sizes: Sequence[int] | None = None) -> Plan:
    """Plain PyTorch with gradient accumulation: keep everything, largest micro-batch that fits.

    Args:
        chain: the profiled chain.
        budget_bytes: peak bytes the step may use.
        micro_batch_sizes: sizes allowed (``None``: balanced sizes ``ceil(B/k)``).

    Returns:
        The plan (``solver="no_saving"``).

    Raises:
        BudgetError: even micro-batch ``min(sizes)`` does not fit; carries this recipe's smallest budget.
    """
    pat = ((KEEP,) * chain.n, tuple(range(chain.n)))
    return _solve_pattern(chain, budget_bytes, "no_saving", [pat], micro_batch_sizes,
                          lambda s: "baseline: plain PyTorch, nothing recomputed, gradient accumulation")


def solve_recompute_all(chain: CostChain, budget_bytes: int, *,
                        micro_batch_sizes: Sequence[int] | None = None) -> Plan:
    """Every stage its own checkpoint (recomputed, only its output kept); largest micro-batch that fits.

    Args, Returns and Raises as :func:`solve_no_saving` (``solver="recompute_all"``).
    """
    pat = ((RECOMPUTE,) * chain.n, tuple(range(chain.n)))
    return _solve_pattern(chain, budget_bytes, "recompute_all", [pat], micro_batch_sizes,
                          lambda s: "baseline: every stage checkpointed")


def solve_chen_sqrt(chain: CostChain, budget_bytes: int, *,
                    micro_batch_sizes: Sequence[int] | None = None) -> Plan:
    """Chen et al. 2016: ``round(sqrt(n))`` near-equal segments, each one recompute group.

    Args, Returns and Raises as :func:`solve_no_saving` (``solver="chen_sqrt"``).
    """
    k = max(1, round(math.sqrt(chain.n)))
    pat = _pattern(chain.n, [(i, j, RECOMPUTE) for i, j in equal_chunks(chain.n, k)])
    return _solve_pattern(chain, budget_bytes, "chen_sqrt", [pat], micro_batch_sizes,
                          lambda s: f"baseline: Chen et al. sqrt(n), {k} recompute segments")


def checkpoint_sequential_pattern(n: int, segments: int) -> _Pattern:
    """What ``torch.utils.checkpoint.checkpoint_sequential(functions, segments, x)`` does to ``n`` stages.

    The first ``segments - 1`` chunks of ``n // segments`` stages are checkpoints; the last chunk (the
    rest of the chain, so possibly longer) runs normally.
    """
    if not 1 <= segments <= n:
        raise ValueError(f"segments must be in 1..{n} for a chain of {n} stages, got {segments}")
    size = n // segments
    spans = [(c * size, (c + 1) * size - 1, RECOMPUTE) for c in range(segments - 1)]
    spans.append(((segments - 1) * size, n - 1, KEEP))
    return _pattern(n, spans)


def solve_checkpoint_sequential(chain: CostChain, budget_bytes: int, segments: int | None = None, *,
                                micro_batch_sizes: Sequence[int] | None = None) -> Plan:
    """``torch.utils.checkpoint.checkpoint_sequential`` with the largest micro-batch that fits.

    Args:
        chain: the profiled chain.
        budget_bytes: peak bytes the step may use.
        segments: the ``segments`` argument; ``None`` tries every count in ``1..n`` and returns the
            fastest feasible one (what a user tuning it by hand would find at best).
        micro_batch_sizes: sizes allowed (``None``: balanced sizes ``ceil(B/k)``).

    Returns:
        The plan (``solver="checkpoint_sequential"``); its note names the segment count.

    Raises:
        BudgetError: no segment count fits; carries the smallest budget any of them needs.
        ValueError: ``segments`` outside ``1..n``.
    """
    counts = range(1, chain.n + 1) if segments is None else [segments]
    pats = {checkpoint_sequential_pattern(chain.n, k): k for k in counts}
    return _solve_pattern(chain, budget_bytes, "checkpoint_sequential", list(pats), micro_batch_sizes,
                          lambda s: f"baseline: checkpoint_sequential with segments="
                                    f"{pats[(s.policies, s.groups)]}")
