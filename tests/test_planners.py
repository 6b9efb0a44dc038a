"""Planners against brute force over every schedule that :func:`edgetrain.graph.simulate` accepts."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgetrain.errors import BudgetError
from edgetrain.graph import KEEP, RECOMPUTE, CostChain, Linear, StageCost, simulate
from edgetrain.plan import Plan
from edgetrain.planners import (
    PLANNERS, PlanTable, min_feasible_bytes, solve, solve_checkpoint_sequential, solve_chen_sqrt, solve_dp,
    solve_no_saving, solve_recompute_all,
)
from edgetrain.planners._common import candidate_micro_batches
from edgetrain.planners.baselines import checkpoint_sequential_pattern, equal_chunks
from edgetrain.units import format_bytes

RTOL = 1e-9


# ----------------------------------------------------------------------------- chains and brute force

def small_chain(rng: random.Random, n: int, batch: int, *, integer: bool = True,
                carry: bool = False) -> CostChain:
    """A random chain; ``integer`` gives integer byte costs at every m (so the DP grid is exact);
    ``carry`` lets some cuts carry tensors made by earlier stages (a residual block's skip input)."""
    def size(hi_fixed: int, hi_per: int) -> Linear:
        if integer:
            return Linear(rng.randint(0, hi_fixed), rng.randint(0, hi_per))
        return Linear(rng.uniform(0, hi_fixed), rng.uniform(0, hi_per))

    def secs() -> Linear:
        # Some stages cost nothing to recompute, and some costs have no fixed part: exact ties.
        r = rng.random()
        if r < 0.2:
            return Linear(0.0, 0.0)
        return Linear(0.0 if r < 0.4 else rng.random() * 0.1, rng.random())

    stages = [StageCost(f"s{i}", fwd_s=secs(), bwd_s=secs(), saved_bytes=size(5, 20),
                        out_bytes=size(3, 10), workspace_bytes=size(3, 5)) for i in range(n)]
    if carry:  # a tensor made by stage p crossing the cuts after stages p+1..q-1 (read by stage q)
        for p in range(n - 2):
            if rng.random() < 0.5:
                q, b = rng.randint(p + 2, n - 1), size(3, 10)
                for t in range(p + 1, q):
                    stages[t] = dataclasses.replace(stages[t], carried=stages[t].carried + ((p, b),))
    stages = tuple(stages)
    return CostChain(stages, batch, input_bytes=size(3, 6), fixed_bytes=rng.randint(0, 50),
                     loss_s=Linear(0.01, 0.001), step_fixed_s=0.1, name="random")


def all_schedules(n: int, segments: bool = True):
    """Every (policies, groups): each segmentation, singletons keep or recompute, longer groups recompute."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        spans, start = [], 0
        for i, cut in enumerate(cuts):
            if cut:
                spans.append((start, i))
                start = i + 1
        spans.append((start, n - 1))
        if not segments and any(j > i for i, j in spans):
            continue
        # Groups of several stages recompute in one or two levels ("nested": checkpointed inside again).
        for choice in itertools.product(*[(KEEP, RECOMPUTE) if i == j else (RECOMPUTE, "nested")
                                          for i, j in spans]):
            policies, groups, nested = [], [], []
            for g, ((i, j), pol) in enumerate(zip(spans, choice)):
                if pol == "nested":
                    nested.append(g)
                    pol = RECOMPUTE
                policies += [pol] * (j - i + 1)
                groups += [g] * (j - i + 1)
            yield tuple(policies), tuple(groups), tuple(nested)


def enumerate_costs(chain: CostChain, sizes=None, segments: bool = True) -> list[tuple[int, float, int, int]]:
    """(peak, time, recomputed, m) of every schedule at every candidate micro-batch size."""
    rows = []
    for m in candidate_micro_batches(chain, sizes):
        for pol, grp, nested in all_schedules(chain.n, segments):
            c = simulate(chain, m, pol, grp, nested)
            rows.append((c.peak_bytes, c.step_time_s, pol.count(RECOMPUTE), m))
    return rows


def brute_best(rows, budget: int):
    """Minimum time, then fewest recomputed, then largest m, among rows fitting ``budget`` (None if none)."""
    fit = [r for r in rows if r[0] <= budget]
    if not fit:
        return None
    t_min = min(r[1] for r in fit)
    tied = [r for r in fit if r[1] <= t_min * (1 + RTOL)]
    return t_min, min((r[2], -r[3]) for r in tied)


def recomputed(plan: Plan) -> int:
    return plan.policies.count(RECOMPUTE)


def assert_consistent(chain: CostChain, plan: Plan, budget: int) -> None:
    """The plan's predictions are simulate's, and it fits."""
    cost = simulate(chain, plan.micro_batch_size, plan.policies, plan.groups, plan.nested_groups)
    assert plan.peak_bytes == cost.peak_bytes <= budget
    assert plan.step_time_s == cost.step_time_s


def cases(count: int, seed: int, **kw):
    rng = random.Random(seed)
    for _ in range(count):
        chain = small_chain(rng, rng.randint(1, 6), rng.randint(1, 8), **kw)
        yield rng, chain


def test_carried_tensors_in_the_memory_model() -> None:
    """Stage 0 makes x (10 B); stage 1 runs beside it (x carried across its cut); stage 2 adds them."""
    def st(name: str, saved: int, out: int, carried: tuple = ()) -> StageCost:
        return StageCost(name, Linear(0, 1.0), Linear(0, 2.0), Linear(0, saved), Linear(0, out),
                         carried=tuple((p, Linear(0, b)) for p, b in carried))

    chain = CostChain((st("x", 1, 10), st("main", 2, 20, ((0, 10),)), st("add", 0, 5)), 1, Linear(0, 4), 0)
    # group 0..1 makes x, so it retains x with its output (30); stage 1's backward holds x's gradient
    a = simulate(chain, 1, [RECOMPUTE, RECOMPUTE, KEEP], [0, 0, 1])
    assert a.per_stage_peak_bytes == ((1 + 10) + 2 + 20 + 10 + 10, 0 + 5 + 20 + 0)
    assert a.activation_peak_bytes == 4 + 30 + 25
    # a group starting after x's maker retains only its output: x is already resident
    b = simulate(chain, 1, [KEEP, RECOMPUTE, KEEP], [0, 1, 2])
    assert b.per_stage_peak_bytes == (1 + 10 + 4, 2 + 20 + 10 + 10, 25)
    assert b.activation_peak_bytes == 4 + 11 + 20 + 25
    assert CostChain.from_json(chain.to_json()) == chain


# ----------------------------------------------------------------------------- dp against brute force

@pytest.mark.parametrize("seed", range(4))
def test_dp_equals_brute_force(seed: int) -> None:
    for rng, chain in cases(12, seed, carry=seed % 2 == 1):
        rows = enumerate_costs(chain)
        lo = min(r[0] for r in rows)
        hi = simulate(chain, chain.batch_size, [KEEP] * chain.n).peak_bytes
        assert min_feasible_bytes(chain) == lo
        for budget in {lo, hi, lo - 1, *(rng.randint(lo, hi) for _ in range(5))}:
            expected = brute_best(rows, budget)
            if expected is None:
                with pytest.raises(BudgetError) as err:
                    solve_dp(chain, budget)
                assert err.value.min_feasible_bytes == lo and err.value.budget_bytes == budget
                continue
            plan = solve_dp(chain, budget)
            assert_consistent(chain, plan, budget)
            assert plan.step_time_s == pytest.approx(expected[0], rel=RTOL)
            assert (recomputed(plan), -plan.micro_batch_size) == expected[1]
            assert plan.solver == "dp" and plan.optimality_gap == 0.0 and plan.budget_bytes == budget


def test_dp_without_segments_and_with_user_sizes_equal_brute_force() -> None:
    for rng, chain in cases(15, 11):
        sizes = sorted(rng.sample(range(1, chain.batch_size + 1), rng.randint(1, chain.batch_size)))
        for segments in (False, True):
            rows = enumerate_costs(chain, sizes, segments)
            lo = min(r[0] for r in rows)
            assert min_feasible_bytes(chain, micro_batch_sizes=sizes, allow_segments=segments) == lo
            for budget in (lo, lo + rng.randint(0, 60)):
                plan = solve_dp(chain, budget, micro_batch_sizes=sizes, allow_segments=segments)
                assert_consistent(chain, plan, budget)
                assert plan.micro_batch_size in sizes
                if not segments:
                    assert plan.groups == tuple(range(chain.n))
                expected = brute_best(rows, budget)
                assert plan.step_time_s == pytest.approx(expected[0], rel=RTOL)
                assert (recomputed(plan), -plan.micro_batch_size) == expected[1]


def test_segments_pay_off_somewhere() -> None:
    """Recompute segments are a real choice: on some chains they beat per-stage recomputation."""
    wins = 0
    for _, chain in cases(30, 5):
        lo_seg, lo_single = min_feasible_bytes(chain), min_feasible_bytes(chain, allow_segments=False)
        assert lo_seg <= lo_single
        wins += lo_seg < lo_single
    assert wins > 0


def test_rounded_buckets_stay_feasible_and_gap_is_proven() -> None:
    """Non-integer sizes and few buckets: plans still fit, and the reported gap bounds the true one."""
    for rng, chain in cases(12, 3, integer=False):
        rows = enumerate_costs(chain)
        lo = min(r[0] for r in rows)
        assert min_feasible_bytes(chain) == lo
        hi = simulate(chain, chain.batch_size, [KEEP] * chain.n).peak_bytes
        for budget in (lo, *(rng.randint(lo, hi) for _ in range(4))):
            plan = solve_dp(chain, budget, max_buckets=16)
            assert_consistent(chain, plan, budget)
            best = brute_best(rows, budget)[0]
            assert plan.step_time_s >= best * (1 - RTOL)
            assert plan.optimality_gap is not None
            assert plan.step_time_s <= best * (1 + plan.optimality_gap) * (1 + RTOL)


# ----------------------------------------------------------------------------- properties

@st.composite
def chain_and_budgets(draw):
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    chain = small_chain(rng, draw(st.integers(1, 12)), draw(st.integers(1, 16)), integer=draw(st.booleans()),
                        carry=draw(st.booleans()))
    hi = simulate(chain, chain.batch_size, [KEEP] * chain.n).peak_bytes
    b1, b2 = sorted(draw(st.integers(0, hi + 10)) for _ in range(2))
    return chain, b1, b2, draw(st.sampled_from([16, 64, 4096]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain_and_budgets())
def test_property_never_over_budget_and_monotone(case) -> None:
    chain, b1, b2, buckets = case
    need = min_feasible_bytes(chain)
    plans = []
    for budget in (b1, b2):
        if budget < need:
            with pytest.raises(BudgetError) as err:
                solve_dp(chain, budget, max_buckets=buckets)
            assert err.value.min_feasible_bytes == need
            assert format_bytes(need) in str(err.value)
            continue
        plan = solve_dp(chain, budget, max_buckets=buckets)
        assert_consistent(chain, plan, budget)
        plans.append(plan)
    if len(plans) == 2:   # a larger budget never gives a slower plan
        assert plans[1].step_time_s <= plans[0].step_time_s * (1 + RTOL)
    assert_consistent(chain, solve_dp(chain, need, max_buckets=buckets), need)


# ----------------------------------------------------------------------------- baselines

def test_baselines_fit_and_are_never_faster_than_dp() -> None:
    for rng, chain in cases(25, 7):
        rows = enumerate_costs(chain)
        lo = min(r[0] for r in rows)
        hi = simulate(chain, chain.batch_size, [KEEP] * chain.n).peak_bytes
        for budget in (rng.randint(lo, hi), hi):
            dp = solve_dp(chain, budget)
            for name, fn in PLANNERS.items():
                if name.startswith("poet"):  # paging planners need a device profile; tests/test_poet.py
                    continue
                try:
                    plan = fn(chain, budget)
                except BudgetError as err:
                    assert name != "dp"
                    assert err.min_feasible_bytes > budget
                    assert_consistent(chain, fn(chain, err.min_feasible_bytes), err.min_feasible_bytes)
                    continue
                assert_consistent(chain, plan, budget)
                assert plan.solver == name
                assert plan.step_time_s >= dp.step_time_s * (1 - RTOL)


def test_baseline_patterns() -> None:
    chain = small_chain(random.Random(0), 7, 8)
    big = 10**9
    assert set(solve_no_saving(chain, big).policies) == {KEEP}
    assert solve_no_saving(chain, big).micro_batch_size == 8
    rec = solve_recompute_all(chain, big)
    assert set(rec.policies) == {RECOMPUTE} and rec.groups == tuple(range(7))
    chen = solve_chen_sqrt(chain, big)   # round(sqrt(7)) = 3 segments of 3, 2, 2 stages
    assert set(chen.policies) == {RECOMPUTE} and chen.groups == (0, 0, 0, 1, 1, 2, 2)
    assert equal_chunks(10, 3) == [(0, 3), (4, 6), (7, 9)]
    cs = solve_checkpoint_sequential(chain, big, segments=3)   # chunks of 7 // 3 = 2; the rest runs plain
    assert cs.policies == (RECOMPUTE,) * 4 + (KEEP,) * 3 and cs.groups == (0, 0, 1, 1, 2, 3, 4)
    with pytest.raises(ValueError, match="segments"):
        solve_checkpoint_sequential(chain, big, segments=8)


@pytest.mark.parametrize("n,segments", [(5, 1), (5, 2), (7, 3), (6, 6), (9, 4)])
def test_checkpoint_sequential_pattern_matches_torch(n: int, segments: int) -> None:
    """The stages torch's checkpoint_sequential re-runs in backward are exactly our recompute stages."""
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint_sequential

    calls = [0] * n

    class Counted(torch.nn.Linear):
        def __init__(self, i: int) -> None:
            super().__init__(3, 3)
            self.i = i

        def forward(self, x):
            calls[self.i] += 1
            return super().forward(x)

    layers = [Counted(i) for i in range(n)]
    out = checkpoint_sequential(layers, segments, torch.randn(2, 3, requires_grad=True), use_reentrant=False)
    out.sum().backward()
    policies, _ = checkpoint_sequential_pattern(n, segments)
    assert [RECOMPUTE if c == 2 else KEEP for c in calls] == list(policies)


def test_baseline_budget_error_carries_own_minimum() -> None:
    chain = small_chain(random.Random(2), 5, 6)
    need = min(simulate(chain, m, [KEEP] * 5).peak_bytes for m in candidate_micro_batches(chain))
    with pytest.raises(BudgetError) as err:
        solve_no_saving(chain, need - 1)
    assert err.value.min_feasible_bytes == need and format_bytes(need) in str(err.value)
    assert solve_no_saving(chain, need).peak_bytes <= need


# ----------------------------------------------------------------------------- errors, dispatch, JSON

def test_budget_error_messages() -> None:
    chain = small_chain(random.Random(4), 4, 8)
    need = min_feasible_bytes(chain)
    with pytest.raises(BudgetError, match="Raise the budget") as err:
        solve_dp(chain, chain.fixed_bytes - 1)
    assert err.value.min_feasible_bytes == need
    assert isinstance(err.value, ValueError)
    need_8 = min_feasible_bytes(chain, micro_batch_sizes=[8])
    if need_8 > need:
        with pytest.raises(BudgetError, match="smaller micro-batches"):
            solve_dp(chain, need_8 - 1, micro_batch_sizes=[8])


def test_dispatcher_and_registry() -> None:
    chain = small_chain(random.Random(6), 4, 4)
    assert set(PLANNERS) == {"dp", "no_saving", "recompute_all", "chen_sqrt", "checkpoint_sequential", "poet",
                             "poet-milp"}
    assert solve(chain, 10**9).replace(solve_time_s=0.0) == solve_dp(chain, 10**9).replace(solve_time_s=0.0)
    assert solve(chain, 10**9, "chen_sqrt").solver == "chen_sqrt"
    with pytest.raises(ValueError, match="unknown solver 'magic'.*checkpoint_sequential"):
        solve(chain, 10**9, "magic")
    with pytest.raises(ValueError, match="positive integers"):
        solve_dp(chain, 10**9, micro_batch_sizes=[0])
    assert candidate_micro_batches(chain.with_batch_size(10)) == [10, 5, 4, 3, 2, 1]


def test_plan_json_round_trip() -> None:
    chain = small_chain(random.Random(8), 6, 8)
    plan = solve_dp(chain, min_feasible_bytes(chain) + 5)
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.metadata == plan.metadata
    assert "dp" in plan.summary()


# ----------------------------------------------------------------------------- scale: speed and the table

def hundred_stage_chain(seed: int = 0, batch: int = 64) -> CostChain:
    rng = random.Random(seed)
    stages = tuple(StageCost(
        f"block{i}", fwd_s=Linear(5e-3, rng.uniform(1e-4, 1e-3)), bwd_s=Linear(1e-2, rng.uniform(2e-4, 2e-3)),
        saved_bytes=Linear(0, rng.randint(10_000, 2_000_000)), out_bytes=Linear(0, rng.randint(10_000, 500_000)),
        workspace_bytes=Linear(4096, rng.randint(0, 200_000))) for i in range(100))
    return CostChain(stages, batch, Linear(0, 150_000), fixed_bytes=50_000_000, loss_s=Linear(1e-4, 1e-5),
                     step_fixed_s=0.01, name="synthetic-100")


def test_dp_speed_on_100_stages() -> None:
    chain = hundred_stage_chain(seed=1)
    hi = simulate(chain, 64, [KEEP] * 100).peak_bytes
    for frac in (0.1, 0.4):
        budget = int(chain.fixed_bytes + frac * (hi - chain.fixed_bytes))
        start = time.perf_counter()
        plan = solve_dp(chain, budget)
        elapsed = time.perf_counter() - start
        assert elapsed < 2.0, f"solve_dp took {elapsed:.2f} s on 100 stages"
        assert plan.solve_time_s <= elapsed and plan.peak_bytes <= budget and recomputed(plan) > 0
        assert 0.0 <= plan.optimality_gap < 0.05
        for name in ("no_saving", "checkpoint_sequential", "chen_sqrt"):
            try:
                assert solve(chain, budget, name).step_time_s >= plan.step_time_s * (1 - RTOL)
            except BudgetError:
                pass


def test_plan_table_lookups() -> None:
    chain = hundred_stage_chain(seed=2)
    table = PlanTable.build(chain, n_points=12)
    lo = min_feasible_bytes(chain)
    hi = simulate(chain, 64, [KEEP] * 100).peak_bytes
    assert table.budgets[0] == lo and table.budgets[-1] == hi and len(table) == 12
    times = [p.step_time_s for p in table.plans]
    assert all(b <= a * (1 + RTOL) for a, b in zip(times, times[1:]))
    assert table.plans[-1].policies == (KEEP,) * 100 and table.plans[-1].micro_batch_size == 64
    rng = random.Random(0)
    asks = [rng.randint(lo, 2 * hi) for _ in range(20_000)]
    start = time.perf_counter()
    plans = [table.plan_for(b) for b in asks]
    per_lookup = (time.perf_counter() - start) / len(asks)
    assert per_lookup < 1e-3, f"{per_lookup * 1e6:.1f} us per lookup"
    for b, plan in zip(asks[:500], plans[:500]):
        assert plan.peak_bytes <= b
    with pytest.raises(BudgetError) as err:
        table.plan_for(lo - 1)
    assert err.value.min_feasible_bytes == lo
    assert PlanTable.from_json(table.to_json()) == table


def test_plan_table_exact_on_small_chains() -> None:
    """On exact chains every grid plan is the optimum at its grid budget; baselines can fill tables too."""
    for _, chain in cases(6, 9):
        table = PlanTable.build(chain, n_points=8)
        rows = enumerate_costs(chain)
        for b, plan in zip(table.budgets, table.plans):
            assert plan.step_time_s == pytest.approx(brute_best(rows, b)[0], rel=RTOL)
        base = PlanTable.build(chain, table.budgets, solver=solve_no_saving)
        for b in base.budgets:
            assert base.plan_for(b).peak_bytes <= b
            assert base.plan_for(b).step_time_s >= table.plan_for(b).step_time_s * (1 - RTOL)
    assert math.isfinite(table.build_time_s)


def test_elastic_suffix_keeps_carried_tensors() -> None:
    """Planning the trained suffix: a carried tensor the frozen prefix made is resident from the start."""
    from edgetrain.approx.elastic.memory import elastic_chain

    def st(out: int, carried: tuple = ()) -> StageCost:
        return StageCost("s", Linear(0, 1.0), Linear(0, 1.0), Linear(0, 1), Linear(0, out),
                         carried=tuple((p, Linear(0, b)) for p, b in carried))

    chain = CostChain((st(8), st(4, ((0, 8),)), st(4, ((0, 8),)), st(2, ((2, 4),)), st(1)), 1, Linear(0, 3), 0)
    sub = elastic_chain(chain, 2).chain
    assert sub.input_bytes == Linear(0, 4 + 8)  # stage 1's output and stage 0's carried x
    assert [s.carried for s in sub.stages] == [(), ((0, Linear(0, 4)),), ()]
