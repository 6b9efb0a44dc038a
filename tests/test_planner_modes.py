"""Which way of holding the optimizer state and the gradients a prepare() takes: the analysing child's way
first in the process that trains, the fused update's fallback between two validated ways, and a validation
run that began above where it ended."""

import pytest
import torch
from torch import nn

from edgetrain.graph import simulate
from edgetrain.planning.analysis import FUSED_KEY, Analysis, Outcome
from edgetrain.planning.planner import Measured, Planner

from _chains import per_call_chain as _chain

MIB = 2**20
HELD = 100 * MIB


def test_a_run_that_began_above_where_it_ended_is_not_planned_again():
    """The process gave heap back during the run: measured from its end, the run's activations match the model,
    yet its peak (from where it began) is over the budget. The corrected model must put that plan at its
    measured peak, or the next solve takes it again and re-reads the same miss until the loop gives up."""
    keep_act = simulate(_chain(0), 8, ("keep",) * 6).activation_peak_bytes
    budget = HELD + keep_act + MIB
    planner = Planner(_chain(HELD), budget, 0, "dp", 8, False, 1, 0)
    assert planner._solve(budget).policies == ("keep",) * 6  # the model says keeping everything fits
    runs = []

    def run(plan):
        runs.append(plan)
        act = simulate(_chain(0), 8, plan.policies, plan.groups, plan.nested_groups).activation_peak_bytes
        return Measured(rss_before=HELD + 2 * MIB, peak=HELD + 2 * MIB + act, rss_after=HELD)

    plan, _ = planner.plan_validated(run, 0, 0)
    keeps = [r for r in runs if r.policies == ("keep",) * 6]
    assert len(keeps) == 1  # run once, not re-read eight times
    assert plan.policies != ("keep",) * 6 and plan.peak_bytes <= budget
    assert len(runs) <= 3


class _Chain:
    skips_blocks = False
    method = "fx"
    unmanaged_mutations: list[str] = []


def _analysis(monkeypatch, modes, times):
    """An Analysis whose ways of holding the state are ``modes`` in that order and whose planners 'validate' a
    plan of the step time ``times[mode]`` (None: no plan fits that way); returns it and the validations made,
    as ``(mode, first plan run)``."""
    import edgetrain.runtime.fused as fused_mod

    model = nn.Linear(4, 2)
    a = Analysis(model=model, inputs=(torch.zeros(8, 4),), env={}, targets=None, loss_fn=None, batch=8,
                 fixed=HELD, rss_start=0, budget=400 * MIB, margin=0, solver="dp", solver_kw={},
                 micro_batch_size=None, prefer_full_batch=False, min_micro=1, update_bytes=0, state_bytes=40 * MIB,
                 grads=20 * MIB, max_stages=64, use_cache=False, name="t", state_mode="auto",
                 pageable_state=40 * MIB, pageable_new=0, state_s_per_byte=0.0, fuse="auto", fused_bytes=MIB)
    monkeypatch.setattr(fused_mod, "shared_parameter_bytes", lambda chain: 0)
    monkeypatch.setattr(Analysis, "_state_modes", lambda self, pf: list(modes))
    a.validator = lambda chain, isolated=False, paged=False, fused=False: (paged, fused)
    calls = []

    def plan_validated(self, run, unallocated, grads, first=None, strict=False):
        calls.append((run, first))
        if times[run] is None:
            from edgetrain.errors import BudgetError
            raise BudgetError("no plan", budget_bytes=1, min_feasible_bytes=2)
        plan = first if first is not None else self._solve(400 * MIB)
        return plan.replace(step_time_s=times[run]), self.costs

    monkeypatch.setattr(Planner, "plan_validated", plan_validated)
    return a, calls


HELD_W, PAGED, FUSED = (False, False), (True, False), (True, True)


def test_the_childs_way_is_tried_first_with_its_plan(monkeypatch):
    """The process that trains re-plans from the child's corrected costs; ordering the ways afresh there took
    another way than the one the child validated against the others (ResNet-18 at half of plain's peak: the
    child's fused plan, 0.85 s, became a paged one recomputing six more stages, 1.0 s). The child's way now goes
    first, its plan run first, and the fused fallback is not re-argued."""
    a, calls = _analysis(monkeypatch, [HELD_W, PAGED, FUSED], {HELD_W: 1.0, PAGED: 1.0, FUSED: 0.99})
    a._unfused_best_s = 0.5  # the guard would otherwise validate the next way too
    child = a._analyse(_Chain(), _chain(HELD), None, ())
    assert [m for m, _ in calls] == [HELD_W]  # no tried outcome: the order given
    calls.clear()
    a, calls = _analysis(monkeypatch, [HELD_W, PAGED, FUSED], {HELD_W: 1.0, PAGED: 1.0, FUSED: 0.99})
    a._unfused_best_s = 0.5
    tried = Outcome(child.plan, child.costs, 0, [8], page_state=True, fused=True,
                    validated=child.validated.replace(metadata={"mark": 1}))
    out = a._analyse(_Chain(), _chain(HELD), None, (), tried)
    assert [m for m, _ in calls] == [FUSED]
    assert calls[0][1] is tried.validated  # the child's plan as its way validated it, run first
    assert out.fused and out.page_state and out.plan.metadata.get(FUSED_KEY)
    assert out.plan.step_time_s == pytest.approx(0.99)  # the way's time added once (io and calls are 0 here)
    assert out.validated.metadata["mark"] == 1


@pytest.mark.parametrize("held_time, taken", [(1.2, FUSED), (0.9, HELD_W)])
def test_a_fused_plan_no_faster_than_promised_is_weighed_against_the_next_ways_validated_plan(
        monkeypatch, held_time, taken):
    a, calls = _analysis(monkeypatch, [FUSED, HELD_W, PAGED], {FUSED: 1.0, HELD_W: held_time, PAGED: 2.0})
    a._unfused_best_s = 1.0  # what the held way's model promised: the fused plan validated no faster
    out = a._analyse(_Chain(), _chain(HELD), None, ())
    assert [m for m, _ in calls] == [FUSED, HELD_W]
    assert (out.page_state, out.fused) == taken


def test_a_fused_plan_faster_than_promised_is_taken_without_the_next_way(monkeypatch):
    a, calls = _analysis(monkeypatch, [FUSED, HELD_W], {FUSED: 0.5, HELD_W: 0.1})
    a._unfused_best_s = 1.0
    out = a._analyse(_Chain(), _chain(HELD), None, ())
    assert [m for m, _ in calls] == [FUSED] and out.fused
