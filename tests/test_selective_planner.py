"""The per-op (selective) recompute options in the cost model and the DP, against brute force."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

import pytest

from edgetrain.errors import BudgetError
from edgetrain.graph import (
    KEEP, RECOMPUTE, CostChain, Linear, SelectiveOption, StageCost, selective_name, selective_policy, simulate,
)
from edgetrain.planners import min_feasible_bytes, solve_dp
from edgetrain.planners._common import candidate_micro_batches

from test_planners import RTOL, all_schedules, hundred_stage_chain, small_chain


def with_options(rng: random.Random, chain: CostChain, integer: bool = True) -> CostChain:
    """Give stages options ``a`` and/or ``b`` that keep part of their saved bytes (some keep their
    output too), and let some stages write their input in place."""
    stages = []
    for s in chain.stages:
        opts = []
        for name in ("a", "b"):
            if rng.random() < 0.35:
                continue
            frac = rng.uniform(0.0, 0.8)
            kept = Linear(int(s.saved_bytes.fixed * frac), int(s.saved_bytes.per_sample * frac)) if integer \
                else s.saved_bytes.scaled(frac)
            extra = Linear(0, rng.randint(0, 2)) if integer else Linear(0, rng.uniform(0, 2))
            opts.append(SelectiveOption(name, kept_bytes=kept, extra_bytes=extra,
                                        recompute_s=s.fwd_s.scaled(rng.uniform(0.0, 0.6)),
                                        keeps_output=rng.random() < 0.4))
        stages.append(dataclasses.replace(s, selective=tuple(opts), mutates_input=rng.random() < 0.15))
    return dataclasses.replace(chain, stages=tuple(stages))


def all_selective_schedules(chain: CostChain):
    """Every schedule of ``all_schedules``, and each group run as a selective group of any option all its
    stages have (the ones simulate refuses, for a stage writing its input in place, left out)."""
    for pol, grp, nested in all_schedules(chain.n):
        spans = []
        for t, g in enumerate(grp):
            if spans and spans[-1][2] == g:
                spans[-1][1] = t
            else:
                spans.append([t, t, g])
        choices = []
        for i, j, g in spans:
            names = set.intersection(*[{o.name for o in chain.stages[t].selective} for t in range(i, j + 1)])
            base = pol[i] if g not in nested else "nested"
            choices.append([base] + [selective_policy(nm) for nm in sorted(names)])
        for c in itertools.product(*choices):
            policies, groups_, nest = [], [], []
            for (i, j, g), p in zip(spans, c):
                if p == "nested":
                    nest.append(g)
                    p = RECOMPUTE
                policies += [p] * (j - i + 1)
                groups_ += [g] * (j - i + 1)
            try:
                simulate(chain, 1, policies, groups_, nest)
            except ValueError:
                continue
            yield tuple(policies), tuple(groups_), tuple(nest)


def rows_of(chain: CostChain):
    rows = []
    for m in candidate_micro_batches(chain):
        for pol, grp, nested in all_selective_schedules(chain):
            c = simulate(chain, m, pol, grp, nested)
            rows.append((c.peak_bytes, c.step_time_s, m))
    return rows


def best_time(rows, budget):
    fit = [r[1] for r in rows if r[0] <= budget]
    return min(fit) if fit else None


def cases(count: int, seed: int, integer: bool = True):
    rng = random.Random(seed)
    for _ in range(count):
        chain = small_chain(rng, rng.randint(1, 4), rng.randint(1, 6), integer=integer, carry=rng.random() < 0.5)
        yield rng, with_options(rng, chain, integer)


def test_simulate_selective_stage() -> None:
    """Keep-like: backward holds every saved tensor plus the unsaved kept ones; forward retains only those kept."""
    opt = SelectiveOption("conv", kept_bytes=Linear(0, 4), extra_bytes=Linear(0, 1), recompute_s=Linear(0, 0.25))
    a = StageCost("a", Linear(0, 1.0), Linear(0, 2.0), Linear(0, 10), Linear(0, 3), selective=(opt,))
    b = StageCost("b", Linear(0, 1.0), Linear(0, 2.0), Linear(0, 6), Linear(0, 2))
    chain = CostChain((a, b), 2, Linear(0, 1), 100)
    keep = simulate(chain, 2, [KEEP, KEEP])
    sel = simulate(chain, 2, [selective_policy("conv"), KEEP])
    # stage a: prefix 2 (input); keep adds 20 + 6, selective 8 + 6; stage b's local 12 + 4 + 6
    assert keep.per_stage_peak_bytes == (20 + 6 + 2, 12 + 4 + 6)
    assert sel.per_stage_peak_bytes == (20 + 2 + 6 + 2, 12 + 4 + 6)
    # a group of both stages under the option: a's kept bytes and, since a kept op made it, a's output
    both = StageCost("b", Linear(0, 1.0), Linear(0, 2.0), Linear(0, 6), Linear(0, 2), selective=(
        SelectiveOption("conv", kept_bytes=Linear(0, 0), recompute_s=Linear(0, 0.5)),))
    a_keeps = dataclasses.replace(a, selective=(dataclasses.replace(opt, keeps_output=True),))
    chain2 = CostChain((a_keeps, both), 2, Linear(0, 1), 100)
    grp = simulate(chain2, 2, [selective_policy("conv")] * 2, [0, 0])
    rec = simulate(chain2, 2, [RECOMPUTE] * 2, [0, 0])
    assert grp.per_stage_peak_bytes[0] == rec.per_stage_peak_bytes[0] + 2
    assert grp.activation_peak_bytes == max(2 + rec.per_stage_peak_bytes[0] + 2, 2 + 4 + 8 + 6 + 4)
    assert grp.step_time_s == pytest.approx(rec.step_time_s - (2.0 + 2.0) + (0.5 + 1.0))  # fwd vs recompute_s
    mut = dataclasses.replace(chain2, stages=(a_keeps, dataclasses.replace(both, mutates_input=True)))
    with pytest.raises(ValueError, match="in place"):
        simulate(mut, 2, [selective_policy("conv")] * 2, [0, 0])
    with pytest.raises(ValueError, match="in place"):
        simulate(mut, 2, [selective_policy("conv"), KEEP], [0, 1])
    assert keep.activation_peak_bytes == 2 + 26 + 22
    assert sel.activation_peak_bytes == max(2 + 30, 2 + 14 + 22, 2 + 14 + 16 + 4)
    assert sel.step_time_s == pytest.approx(keep.step_time_s + 0.5)
    assert sel.recompute_time_s == pytest.approx(0.5)
    assert selective_name(selective_policy("conv")) == "conv" and selective_name(KEEP) is None
    with pytest.raises(ValueError, match="no selective option"):
        simulate(chain, 2, [KEEP, selective_policy("conv")])
    assert CostChain.from_json(chain.to_json()) == chain


@pytest.mark.parametrize("seed", range(4))
def test_dp_with_selective_options_equals_brute_force(seed: int) -> None:
    for rng, chain in cases(14, 100 + seed):
        rows = rows_of(chain)
        lo = min(r[0] for r in rows)
        hi = simulate(chain, chain.batch_size, [KEEP] * chain.n).peak_bytes
        assert min_feasible_bytes(chain) == lo
        for budget in {lo, hi, lo - 1, *(rng.randint(lo, hi) for _ in range(5))}:
            expected = best_time(rows, budget)
            if expected is None:
                with pytest.raises(BudgetError):
                    solve_dp(chain, budget)
                continue
            plan = solve_dp(chain, budget)
            cost = simulate(chain, plan.micro_batch_size, plan.policies, plan.groups, plan.nested_groups)
            assert plan.peak_bytes == cost.peak_bytes <= budget
            assert plan.step_time_s == cost.step_time_s == pytest.approx(expected, rel=RTOL)
            assert plan.optimality_gap == 0.0


def test_selective_never_slower_and_sometimes_faster() -> None:
    wins = 0
    for rng, chain in cases(30, 7):
        plain = dataclasses.replace(chain, stages=tuple(dataclasses.replace(s, selective=()) for s in chain.stages))
        lo = min_feasible_bytes(plain)
        hi = simulate(chain, chain.batch_size, [KEEP] * chain.n).peak_bytes
        assert min_feasible_bytes(chain) <= lo
        for budget in (lo, (lo + hi) // 2):
            a, b = solve_dp(chain, budget), solve_dp(chain, budget, selective=False)
            assert not any(selective_name(p) for p in b.policies)
            assert a.step_time_s <= b.step_time_s * (1 + RTOL)
            wins += a.step_time_s < b.step_time_s * (1 - 1e-6)
    assert wins > 0


def test_rounded_buckets_with_selective_stay_feasible_and_gap_is_proven() -> None:
    for rng, chain in cases(10, 11, integer=False):
        rows = rows_of(chain)
        lo = min(r[0] for r in rows)
        hi = simulate(chain, chain.batch_size, [KEEP] * chain.n).peak_bytes
        for budget in (lo, *(rng.randint(lo, hi) for _ in range(3))):
            plan = solve_dp(chain, budget, max_buckets=16)
            assert simulate(chain, plan.micro_batch_size, plan.policies, plan.groups,
                            plan.nested_groups).peak_bytes <= budget
            best = best_time(rows, budget)
            assert plan.step_time_s >= best * (1 - RTOL)
            assert plan.optimality_gap is not None
            assert plan.step_time_s <= best * (1 + plan.optimality_gap) * (1 + RTOL)


def selective_hundred(seed: int = 0) -> CostChain:
    """A 100-stage chain whose every stage has two options (convolution outputs; plus norm outputs)."""
    chain = hundred_stage_chain(seed)
    rng = random.Random(seed)
    stages = []
    for s in chain.stages:
        f1, f2 = rng.uniform(0.2, 0.45), rng.uniform(0.5, 0.8)
        stages.append(dataclasses.replace(s, selective=(
            SelectiveOption("conv", s.saved_bytes.scaled(f1), Linear(), s.fwd_s.scaled(rng.uniform(0.1, 0.3))),
            SelectiveOption("conv+norm", s.saved_bytes.scaled(f2), Linear(), s.fwd_s.scaled(rng.uniform(0.02, 0.1))))))
    return dataclasses.replace(chain, stages=tuple(stages))


def test_dp_with_selective_on_100_stages_is_fast_and_near_optimal() -> None:
    chain = selective_hundred(3)
    hi = simulate(chain, 64, [KEEP] * 100).peak_bytes
    for frac in (0.1, 0.4):
        budget = int(chain.fixed_bytes + frac * (hi - chain.fixed_bytes))
        start = time.perf_counter()
        plan = solve_dp(chain, budget)
        elapsed = time.perf_counter() - start
        assert elapsed < 10.0
        assert plan.peak_bytes <= budget
        assert any(selective_name(p) for p in plan.policies)
        assert plan.optimality_gap is not None and plan.optimality_gap < 0.01
        assert plan.step_time_s <= solve_dp(chain, budget, selective=False).step_time_s * (1 + RTOL)
    assert RECOMPUTE  # the whole-stage policies stay in the space


def test_device_scaling_keeps_the_options_share_of_the_forward() -> None:
    from edgetrain.devices import list_profiles, load_profile, scale_chain

    names = list_profiles()
    src, dst = load_profile(names[0]), load_profile(names[-1])
    opt = SelectiveOption("conv", Linear(0, 4), recompute_s=Linear(0.0, 0.25))
    st = StageCost("a", Linear(0, 1.0), Linear(0, 2.0), Linear(0, 10), Linear(0, 3), flops=Linear(0, 1e9),
                   selective=(opt,))
    chain = CostChain((st,), 2, Linear(0, 1), 0)
    for scaled in (scale_chain(chain, src, dst), scale_chain(chain, None, dst)):
        s = scaled.stages[0]
        assert s.selective[0].recompute_s.at(2) == pytest.approx(0.25 * s.fwd_s.at(2), rel=1e-9)
        assert s.selective[0].kept_bytes == opt.kept_bytes


def test_bench_solve_section_rows() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from _solve_report import solve_rows, solve_table_lines, synthetic_chain, tiled_chain

    chain = tiled_chain(synthetic_chain(7, seed=2), min_stages=20)
    assert chain.n == 21 and chain.stages[8].name.endswith("#1")
    rows = solve_rows([chain], fractions=(0.3,))
    lines = solve_table_lines(rows)
    assert rows[0]["sel"][2] <= rows[0]["whole"][2] * (1 + RTOL)
    assert any("under 10 s to a proven 1% gap" in ln for ln in lines)
