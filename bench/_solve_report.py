"""Bench section (issue 17): DP solve time on 100+-stage chains with the selective (per-op) space.

Chains: the profiled chain of a model tiled until it has at least ``min_stages`` stages (its stages
repeated in order, so the costs are real measurements), and synthetic chains of 100 and 200 stages whose
every stage has two selective options (as ``tests/test_selective_planner.py`` builds them). Each is solved at
budgets between its minimum and its keep-everything peak; the table gives the solve seconds and the DP's
proven optimality gap (bytes rounded to buckets), beside the same chain solved over whole-stage policies.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any, Sequence

from edgetrain.graph import KEEP, CostChain, Linear, SelectiveOption, StageCost, simulate
from edgetrain.planners import min_feasible_bytes, solve_dp

__all__ = ["synthetic_chain", "tiled_chain", "solve_rows", "solve_table_lines"]


def synthetic_chain(n: int, seed: int = 0, batch: int = 64) -> CostChain:
    """``n`` stages with random costs, each with options ``conv`` and ``conv+norm``."""
    rng = random.Random(seed)
    stages = []
    for i in range(n):
        saved = Linear(0, rng.randint(10_000, 2_000_000))
        fwd = Linear(5e-3, rng.uniform(1e-4, 1e-3))
        stages.append(StageCost(
            f"block{i}", fwd_s=fwd, bwd_s=Linear(1e-2, rng.uniform(2e-4, 2e-3)), saved_bytes=saved,
            out_bytes=Linear(0, rng.randint(10_000, 500_000)), workspace_bytes=Linear(4096, rng.randint(0, 200_000)),
            selective=(SelectiveOption("conv", saved.scaled(rng.uniform(0.2, 0.45)), Linear(),
                                       fwd.scaled(rng.uniform(0.1, 0.3)), rng.random() < 0.5),
                       SelectiveOption("conv+norm", saved.scaled(rng.uniform(0.5, 0.8)), Linear(),
                                       fwd.scaled(rng.uniform(0.02, 0.1)), rng.random() < 0.5))))
    return CostChain(tuple(stages), batch, Linear(0, 150_000), fixed_bytes=50_000_000, loss_s=Linear(1e-4, 1e-5),
                     step_fixed_s=0.01, name=f"synthetic-{n}")


def tiled_chain(chain: CostChain, min_stages: int = 100) -> CostChain:
    """``chain``'s stages repeated in order until there are at least ``min_stages`` (carried tensors
    re-pointed at the copy of their producer)."""
    reps = -(-min_stages // chain.n)
    stages = []
    for r in range(reps):
        for s in chain.stages:
            carried = tuple((p + r * chain.n, b) for p, b in s.carried)
            stages.append(dataclasses.replace(s, name=f"{s.name}#{r}", carried=carried))
    return dataclasses.replace(chain, stages=tuple(stages), name=f"{chain.name or 'chain'}x{reps}")


def solve_rows(chains: Sequence[CostChain], fractions: Sequence[float] = (0.1, 0.3, 0.6)) -> list[dict[str, Any]]:
    """Solve every chain at budgets ``lo + f (hi - lo)`` with and without the selective options."""
    rows = []
    for chain in chains:
        lo = min_feasible_bytes(chain)
        hi = simulate(chain, chain.batch_size, [KEEP] * chain.n).peak_bytes
        for f in fractions:
            budget = int(lo + f * (hi - lo))
            row: dict[str, Any] = {"chain": chain.name, "stages": chain.n, "fraction": f, "budget": budget}
            for sel in (True, False):
                t0 = time.perf_counter()
                plan = solve_dp(chain, budget, selective=sel)
                row["sel" if sel else "whole"] = (time.perf_counter() - t0, plan.optimality_gap, plan.step_time_s,
                                                  sum(p.startswith("selective:") for p in plan.policies))
            rows.append(row)
    return rows


def solve_table_lines(rows: Sequence[dict[str, Any]], markdown: bool = True) -> list[str]:
    """The rows as a markdown table (solve seconds, proven gap, predicted step with/without selective)."""
    def gap(g: float | None) -> str:
        return "unknown" if g is None else f"{g:.2%}"

    lines = ["**DP solve time with the selective space (100+-stage chains)**", "",
             "| chain | stages | budget (of min..keep) | solve s | gap | selective stages | solve s whole-stage "
             "| gap whole-stage | pred step sel/whole |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s, w = r["sel"], r["whole"]
        lines.append(f"| {r['chain']} | {r['stages']} | {r['fraction']:.0%} | {s[0]:.2f} | {gap(s[1])} | {s[3]} | "
                     f"{w[0]:.2f} | {gap(w[1])} | {s[2] / w[2]:.3f}x |")
    worst = max((r["sel"][0] for r in rows), default=0.0)
    gaps = [r["sel"][1] for r in rows]
    ok = worst < 10 and all(g is not None and g <= 0.01 for g in gaps)
    lines += ["", f"selective space: slowest solve {worst:.2f} s, largest proven gap "
              f"{gap(max((g for g in gaps if g is not None), default=None)) if None not in gaps else 'unknown'}"
              f" -- under 10 s to a proven 1% gap: {'YES' if ok else 'NO'}"]
    return lines if markdown else [ln.replace("**", "") for ln in lines]
