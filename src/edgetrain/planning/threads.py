"""Planning for a process that runs more intra-op threads than the analysing child.

The child that profiles and validates plans runs this process's intra-op threads on a thread of its own
(:func:`edgetrain.forking.on_new_thread`); where no thread can be started there, it runs one on its main
thread (GNU OpenMP cannot restart its pool there), and what follows applies. A step's memory grows with the
threads: oneDNN's primitives built for more threads hold more, and its primitive
cache keeps them (MobileViT, micro-batch 16: 50.9 MiB of activations at two threads, 44.6 at one; a small
MobileNetV2 plan 38.9 against 35.0 MiB, and 35.7 with the cache off, at 2.9x plain's step time). A plan the
child fitted can therefore measure over the budget in the process that will train. That process cannot validate
alternatives in itself for long (every run leaves kernels and heap resident there for good), so it runs the
child's plan once and, when that measures over, has a new child plan with the difference held back from the
budget: :func:`reserved` is that child's side.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

from ..errors import BudgetError
from ..profile.fork import run_in_child
from ..units import format_bytes
from .budgets import RETRY_SLACK, RunOver

__all__ = ["THREAD_TRIES", "need_here", "refused_here", "reserved", "train_here"]

log = logging.getLogger("edgetrain.api")

#: plans fitted in a child with more held back, at most, before a process with more threads gives up
THREAD_TRIES = 3


def train_here(chain: Any, analyse: Callable[..., Any], costs: Any, outcome: Any, budget: int) -> Any:
    """The analysing child's ``outcome`` as this process, running more intra-op threads than the child, can
    train it (``analyse_safely``'s ``more_threads``).

    The child's plan is run here once (``strict``). Threads add memory a single-threaded child never measures,
    so that run can measure over the budget; this process then does not plan on in itself (each run here
    leaves kernels and heap resident for good: an HF ResNet's fixed bytes went 26.9 -> 40.7 MiB in one
    prepare, and the budget its child had named was refused). A fresh child plans again with what this run
    measured over the child's held back from the budget, and its plan is run here once more.

    Args:
        chain: this process's chain (the children plan on it too: a second capture there would be charged).
        analyse: :meth:`~edgetrain.planning.analysis.Analysis.analyse`.
        costs: the profiling child's costs (None: the analysing children profile).
        outcome: the first child's outcome.
        budget: the memory budget.

    Raises:
        BudgetError: no plan fitted here (:func:`refused_here`).
    """
    reserve = 0
    overs: list[RunOver] = []
    for attempt in range(THREAD_TRIES + 1):
        try:
            return analyse(chain, outcome.costs, outcome, strict=True)
        except RunOver as over:
            overs.append(over)
        if attempt == THREAD_TRIES:
            break
        over = overs[-1]
        reserve += max(over.measured - over.planned, 2**20)  # at least a MiB more each time: it ends
        log.info("the analysing child's plan measured %s here against %s there (%d intra-op threads here); "
                 "planning again in a child with %s held back", format_bytes(over.measured),
                 format_bytes(over.planned), torch.get_num_threads(), format_bytes(reserve))
        held = reserve
        # this process's chain, not a new capture: a second one would stay resident beside it in the child
        # (traced graphs, kernels: 5.6 MiB more fixed bytes measured on an HF ResNet) and be charged to the plan
        res = run_in_child(lambda: analyse(chain, costs, reserve=held) if costs is not None
                           else analyse(chain, reserve=held))
        if res is None or res.error is not None:
            log.info("re-planning in a child failed (%s); planning in this process", res and res.error)
            return analyse(chain, outcome.costs, outcome)
        if res.budget_error is not None:
            raise refused_here(budget, overs, child_need=res.budget_error[2])
        outcome = res.value
    raise refused_here(budget, overs)


def reserved(analysis: Any, reserve: int, analyse: Callable[[], Any]) -> Any:
    """``analyse()`` with ``reserve`` bytes held back from ``analysis``'s budget (the analysing child's side).

    Raises:
        BudgetError: no plan fits what is left; its smallest feasible budget gives the reserve back, with the
            retry slack every named budget carries (:func:`refused_here` words the refusal the user sees).
    """
    full = analysis.budget
    analysis.budget = full - reserve
    try:
        return analyse()
    except BudgetError as e:
        need = e.min_feasible_bytes
        if need is not None:
            need = max(need + math.ceil(RETRY_SLACK * reserve), math.ceil(full * 1.01))
        raise BudgetError(str(e), budget_bytes=full, min_feasible_bytes=need) from e
    finally:
        analysis.budget = full


def need_here(budget: int, over: Any) -> int:
    """The budget at which the plan that ran over (a :class:`~edgetrain.planning.budgets.RunOver`) fits in this
    process, its margin and the retry slack every named budget carries added; above ``budget``."""
    return max(math.ceil(RETRY_SLACK * over.measured * budget / max(1, over.limit)), math.ceil(budget * 1.01))


def refused_here(budget: int, overs: list[Any], child_need: int | None = None) -> BudgetError:
    """The refusal of a process whose runs of its children's plans all measured over ``budget``.

    It names the smaller of what the last child named (with the reserve given back) and the budget at which
    a plan that ran here fits: the run measured that plan in this process, so a retry there trains (an HF
    ResNet, 2 threads: its child's plan measured 27.2 MiB here at 27.6 MiB; the child planning with 1 MiB held
    back named 34.7 MiB, since this process's run had left its kernels resident; retried at 29.6 it trained,
    28.3 MiB).

    Args:
        overs: the :class:`~edgetrain.planning.budgets.RunOver` of each plan run here.
        child_need: the smallest budget the last child named, if it refused.
    """
    need = min(need_here(budget, o) for o in overs)
    if child_need is not None:
        need = min(need, max(child_need, math.ceil(budget * 1.01)))
    least = min(o.measured for o in overs)
    return BudgetError(
        f"no plan trains this batch within {format_bytes(budget)} with this process's {torch.get_num_threads()} "
        f"intra-op threads: the plans prepare's single-threaded analysis fitted measured over it here (the least "
        f"at {format_bytes(least)}; each thread keeps its own scratch buffers), and none fitted with that held "
        f"back; the smallest feasible budget is {format_bytes(need)}. Raise memory_budget to at least that, "
        "train with fewer threads (torch.set_num_threads), or train a smaller batch.",
        budget_bytes=budget, min_feasible_bytes=need)
