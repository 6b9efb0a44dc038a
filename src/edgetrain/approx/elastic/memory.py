"""What an elastic selection changes in the memory planner's cost chain: a frozen prefix saves nothing.

Framework-free (plain data from :mod:`edgetrain.graph`, no torch). When ElasticTrainer trains only the
tensors from some layer up, autograd records nothing below that layer: the stages before the *first
trained stage* run forward only, save no activations, keep no output beyond the next stage's use and
run no backward. The memory planner should therefore plan the *suffix* of the chain (from the first
trained stage on, its input being the last frozen stage's output) and account for the frozen prefix as a
forward-only transient. :func:`elastic_chain` gives it exactly that; :func:`stage_saved_bytes` gives the
per-stage saved bytes of a selection for reports.

Re-planning per selection: after every re-selection (``ElasticSelector.reselect``), map the deepest
selected tensor's layer to its stage (:func:`first_trained_stage`), build ``elastic_chain(chain, s)``
and re-solve (or look up in a budget table built for that ``s``; there are at most ``n`` distinct
suffixes, so a planner may cache one table per ``s``). Stages at or above ``s`` keep their measured
saved bytes: a layer inside the trained suffix whose own tensors are frozen still saves most of what it
saves when trained (activation functions and normalisations need their tensors for the input gradient;
only a Linear/Conv's saved input becomes unnecessary), so this is a safe upper bound.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Sequence

from ...errors import BudgetError, InputError
from ...graph import CostChain, Linear, StageCost
from ...plan import Plan
from ...units import format_bytes

__all__ = ["ElasticChain", "first_trained_stage", "elastic_chain", "plan_trained_suffix", "stage_saved_bytes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ElasticChain:
    """The chain a memory planner should plan when only stages ``first_trained..n-1`` are trained.

    Attributes:
        chain: the trained suffix as a :class:`CostChain` (stage 0 of it is the first trained stage; its
            ``input_bytes`` is the frozen prefix's output; the prefix's forward seconds are folded into
            ``loss_s`` so that step times stay comparable with the full chain).
        first_trained: index, in the full chain, of the first trained stage.
        prefix: the frozen stages (forward only: they save nothing and run no backward).
        prefix_input_bytes: bytes of the full chain's input (the first frozen stage's input).
    """

    chain: CostChain
    first_trained: int
    prefix: tuple[StageCost, ...]
    prefix_input_bytes: Linear = Linear()

    def prefix_peak_bytes(self, micro_batch_size: int) -> float:
        """Activation bytes at the busiest moment of the frozen prefix's forward pass: the running
        stage's input, output and workspace (nothing else of the prefix is alive)."""
        m = micro_batch_size
        return max((self._in_bytes(i, m) + st.out_bytes.at(m) + st.workspace_bytes.at(m)
                    for i, st in enumerate(self.prefix)), default=0.0)

    def _in_bytes(self, i: int, m: int) -> float:
        return self.prefix_input_bytes.at(m) if i == 0 else self.prefix[i - 1].out_bytes.at(m)


def first_trained_stage(stage_layers: Sequence[Sequence[str]], deepest_layer: str | None) -> int:
    """Index of the stage holding ``deepest_layer`` (the module of the deepest selected tensor).

    Args:
        stage_layers: for each stage, in forward order, the qualified names of the modules it covers.
        deepest_layer: ``ElasticSelector`` reports it (the module owning its ``deepest_selected``
            tensor); None means nothing is frozen.

    Returns:
        The stage index (0 when ``deepest_layer`` is None).

    Raises:
        InputError: no stage covers that module.
    """
    if deepest_layer is None:
        return 0
    for i, names in enumerate(stage_layers):
        if deepest_layer in names:
            return i
    raise InputError(f"no stage covers module {deepest_layer!r}; pass the module names of every stage "
                     "(as in model.named_modules())")


def elastic_chain(chain: CostChain, first_trained: int) -> ElasticChain:
    """Split ``chain`` into a frozen forward-only prefix and the trained suffix a planner should plan.

    Args:
        chain: the full model's cost chain.
        first_trained: the first stage with a trained tensor (:func:`first_trained_stage`).

    Returns:
        The :class:`ElasticChain`; with ``first_trained == 0`` its ``chain`` equals ``chain``.

    Raises:
        InputError: ``first_trained`` is outside ``0..chain.n - 1``.
    """
    if not 0 <= first_trained < chain.n:
        raise InputError(f"first_trained must be in 0..{chain.n - 1}, got {first_trained}")
    prefix = chain.stages[:first_trained]
    suffix = tuple(chain.stages[first_trained:])
    input_bytes = prefix[-1].out_bytes if prefix else chain.input_bytes
    if prefix:  # tensors the frozen prefix made that cross into the suffix are resident from its start
        for _, b in prefix[-1].carried:
            input_bytes = input_bytes + b
        suffix = tuple(replace(st, carried=tuple((p - first_trained, b) for p, b in st.carried
                                                 if p >= first_trained)) for st in suffix)
    loss_s = chain.loss_s
    for st in prefix:
        loss_s = loss_s + st.fwd_s
    sub = CostChain(stages=suffix, batch_size=chain.batch_size, input_bytes=input_bytes,
                    fixed_bytes=chain.fixed_bytes, loss_s=loss_s, step_fixed_s=chain.step_fixed_s,
                    name=f"{chain.name}[{first_trained}:]" if prefix else chain.name)
    return ElasticChain(sub, first_trained, tuple(prefix), chain.input_bytes)


def stage_saved_bytes(chain: CostChain, first_trained: int, micro_batch_size: int) -> list[float]:
    """Bytes each stage saves for backward at ``micro_batch_size`` when stages below ``first_trained``
    are frozen: 0 for those, the measured ``saved_bytes`` for the others.

    Raises:
        InputError: ``first_trained`` is outside ``0..chain.n - 1``.
    """
    if not 0 <= first_trained < chain.n:
        raise InputError(f"first_trained must be in 0..{chain.n - 1}, got {first_trained}")
    return [0.0 if i < first_trained else st.saved_bytes.at(micro_batch_size)
            for i, st in enumerate(chain.stages)]


def plan_trained_suffix(full: Plan, chain: CostChain, first_trained: int, budget_bytes: int,
                        solver_options: dict[str, Any] | None = None) -> Plan:
    """The plan for a selection whose first trained stage is ``first_trained``, or ``full`` when none is better.

    The trained suffix (:func:`elastic_chain`) is planned with the DP at ``full``'s micro-batch size; the
    frozen prefix runs forward only and keeps its stages. ``full``, the full chain's plan and an upper bound
    for every selection, is returned (and why is logged at INFO) when the selection trains every stage or
    none, when no plan of the suffix fits ``budget_bytes``, or when the prefix's own forward peak does not.

    Args:
        full: the plan of the full chain under the same budget.
        chain: the full chain's costs.
        first_trained: :func:`first_trained_stage` of the selection.
        budget_bytes: the budget the plan must fit (after the safety margin).
        solver_options: extra options for the DP (``planning.analysis.block_solver_options``).
    """
    from ...planners import solve

    if first_trained == 0 or first_trained >= chain.n:
        log.info("elastic re-plan: the selection trains %s; the full chain's plan stays",
                 "every stage" if first_trained == 0 else "no stage")
        return full
    ec = elastic_chain(chain, first_trained)
    micro = full.micro_batch_size
    try:
        sub = solve(ec.chain, budget_bytes, solver="dp", micro_batch_sizes=[micro], **(solver_options or {}))
    except BudgetError as e:
        log.info("elastic re-plan: no plan of the trained suffix fits (%s); the full chain's plan stays", e)
        return full
    prefix_peak = int(ec.prefix_peak_bytes(micro) + chain.fixed_bytes)
    if prefix_peak > budget_bytes:
        log.info("elastic re-plan: the frozen prefix's forward peaks at %s, over %s; the full chain's plan "
                 "stays", format_bytes(prefix_peak), format_bytes(budget_bytes))
        return full
    first = first_trained
    plan = full.replace(
        policies=("keep",) * first + sub.policies,
        groups=tuple(range(first)) + tuple(g + first for g in sub.groups),
        peak_bytes=max(sub.peak_bytes, prefix_peak), step_time_s=sub.step_time_s,
        notes=full.notes + (f"elastic selection: stages 0-{first - 1} frozen (forward only, nothing saved); "
                            "planned for the trained suffix",))
    log.info("elastic re-plan: %d frozen stages, %d of %d trained stages recomputed", first,
             sub.policies.count("recompute"), len(sub.policies))
    return plan
