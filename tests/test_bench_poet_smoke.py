"""Smoke tests of bench/bench_poet.py's table and claim code on small fake inputs (no subprocess, no model)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_poet as bp  # noqa: E402

from edgetrain.devices import DeviceProfile  # noqa: E402

MIB = 2**20
DEV = DeviceProfile(name="smoke", compute_flops_per_s=1e10, active_power_w=5.0, memory_power_w=0.5,
                    page_in_latency_s=1e-4, page_in_bytes_per_s=2e9, page_out_latency_s=1e-4,
                    page_out_bytes_per_s=1e9, ram_bytes=1 << 32,
                    provenance={"active_power_w": "estimate", "memory_power_w": "measured"})


def _sweep(budget: int, rec: float | None, pag: float | None, joint: float) -> list[bp.SweepRow]:
    rows = []
    for fam, e in (("recompute-only", rec), ("paging-only", pag), ("joint", joint)):
        for solver in bp.SOLVERS:
            if e is None:
                rows.append(bp.SweepRow("m", budget, 100 * MIB, fam, solver, False, solve_s=0.001))
            else:
                rows.append(bp.SweepRow("m", budget, 100 * MIB, fam, solver, True, 1.0, e, budget, 0.01,
                                        0.0 if solver == "poet" else 0.004, 2, 3))
    return rows


def test_sweep_claims_per_budget():
    rows = _sweep(50 * MIB, None, 2.0, 2.0) + _sweep(60 * MIB, 3.0, 2.5, 2.4) + _sweep(70 * MIB, 3.0, 2.5, 2.6)
    claims = bp.sweep_claims(rows)
    assert claims == {("m", 50 * MIB): None, ("m", 60 * MIB): True, ("m", 70 * MIB): False}
    table = bp.sweep_table(rows, "estimated")
    assert len(table.rows) == 9                       # one row per (budget, family), both solvers in it
    joint_rows = [r for r in table.rows if r[3] == "joint"]
    assert [r[-1] for r in joint_rows] == ["n/a", "yes", "NO"]
    assert table.rows[0][4] == "infeasible"
    lines = bp.claim_lines([], rows, [], [])
    assert lines == ["FAIL joint energy <= best single family at 1/2 budgets both meet (exact DP); "
                     "fails at m @ 70.0 MiB"]


def test_min_table_and_claims():
    rows = [bp.MinRow("a", 32, 20, 70 * MIB, 270 * MIB, 8.0, {"recompute-only": 140 * MIB, "paging-only": 120 * MIB,
                                                              "joint": 120 * MIB}),
            bp.MinRow("b", 32, 20, 70 * MIB, 270 * MIB, 8.0, {"recompute-only": 140 * MIB, "paging-only": None,
                                                              "joint": 140 * MIB})]
    t = bp.min_table(rows)
    assert t.rows[0][-2:] == ["0.86", "yes"] and t.rows[1][-1] == "NO" and t.rows[1][6] == "-"
    text, md = t.to_text(), t.to_markdown()
    widths = {len(line) for line in text.splitlines()[1:3]}
    assert len(widths) == 1                            # header and rule are aligned
    assert md.count("\n| ") == 3                       # header + 2 rows
    lines = bp.claim_lines(rows, [], [], [])
    assert lines[0].startswith("PASS min budget a") and lines[1].startswith("FAIL min budget b")


def test_real_rows_and_claims():
    good = bp.RealRow("a", 100 * MIB, 80 * MIB, 95 * MIB, peak_bytes=99 * MIB, predicted_time_s=1.0,
                      measured_time_s=1.2, exact=True, exact_tensors=10, paged=3, rec_only="BudgetError, needs 110",
                      rec_only_ran=False)
    slow = bp.RealRow("b", 100 * MIB, 80 * MIB, 95 * MIB, peak_bytes=101 * MIB, predicted_time_s=1.0,
                      measured_time_s=1.3, exact=False, exact_tensors=10, rec_only_ran=True, failed_tries=["x"])
    failed = bp.RealRow("c", 100 * MIB, 80 * MIB, 95 * MIB, error="BudgetError: too small")
    assert good.fits and not slow.fits and not failed.fits
    assert good.time_ratio == pytest.approx(1.2) and failed.time_ratio is None
    t = bp.real_table([good, slow, failed], steps=3)
    assert t.rows[0][6] == "yes" and t.rows[0][11] == "yes" and t.rows[1][11] == "NO"
    assert t.rows[2][5].startswith("FAILED")
    assert any(n.startswith("b: earlier tries: x") for n in t.notes)
    verdicts = [line.split(" ", 1)[0] for line in bp.claim_lines([], [], [good, slow, failed], [])]
    assert verdicts == ["PASS", "PASS", "PASS", "FAIL", "FAIL", "FAIL", "FAIL"]


def test_solve_rows_and_claims():
    rows = [bp.SolveRow("c", 120, "tight", MIB, "energy", None, "poet", "ok", 0.5, 0.0, 1.0, 1.0),
            bp.SolveRow("c", 120, "tight", MIB, "energy", None, "poet-milp", "ok", 11.0, 0.0, 1.0, 1.0),
            bp.SolveRow("c", 120, "mid", MIB, "energy", 1.5, "poet", "killed", 30.0),
            bp.SolveRow("c", 120, "mid", MIB, "energy", 1.5, "poet-milp", "ok", 2.0, 0.02, 1.0, 1.0),
            bp.SolveRow("c", 120, "mid", MIB, "time", None, "poet", "infeasible", 1.0),
            bp.SolveRow("c", 120, "mid", MIB, "time", None, "poet-milp", "infeasible", 1.0)]
    assert [r.meets for r in rows] == [True, False, False, False, False, False]
    t = bp.solve_table(rows, cap_s=30.0)
    assert [r[-1] for r in t.rows] == ["yes", "NO", "NO", "NO", "n/a", "n/a"]
    lines = bp.claim_lines([], [], [], rows)
    assert len(lines) == 3                             # per solver, then the better one per configuration
    assert lines[0].startswith("FAIL solve poet: 1/2 ") and "c mid energy <=1.5x (killed" in lines[0]
    assert lines[1].startswith("FAIL solve poet-milp: 0/2 ")
    assert lines[2].startswith("FAIL solve, better planner per configuration: 1/2")
    assert bp.claim_lines([], [], [], rows[:2])[-1].startswith("PASS solve, better planner per configuration: 1/1")
    md = bp.claims_table(lines).to_markdown()
    assert "| FAIL | solve poet: 1/2" in md


def test_sweep_budgets_and_energy_label():
    b = bp.sweep_budgets(100, 140, 400)
    assert b == [100, 140, 226, 313, 400]
    assert bp.sweep_budgets(100, None, 400)[0] == 100 and bp.sweep_budgets(100, None, 400)[-1] == 400
    assert "ESTIMATED" in bp.energy_label(DEV)


def test_family_minimums_on_a_synthetic_chain():
    chain = bp.synthetic_chain(8, seed=3, batch=4)
    mins = bp.family_minimums(chain, DEV, chain.batch_size)
    assert set(mins) == {"recompute-only", "paging-only", "joint"}
    assert all(v is not None and v > chain.fixed_bytes for v in mins.values())
    assert mins["joint"] <= min(mins["recompute-only"], mins["paging-only"])
    rows = bp.sweep_model("synth", chain, DEV, bp.sweep_budgets(mins["joint"], mins["recompute-only"],
                                                               mins["recompute-only"] * 2), 2 * mins["recompute-only"])
    assert all(r.peak_bytes <= r.budget_bytes for r in rows if r.feasible)
    assert all(v is not False for v in bp.sweep_claims(rows).values())


def test_tiled_chain_and_capped_solve():
    chain = bp.synthetic_chain(12, seed=1, batch=4)
    tiled = bp.tiled_chain(chain, 3)
    assert tiled.n == 36 and tiled.stages[12].saved_bytes == chain.stages[0].saved_bytes
    mins = bp.family_minimums(chain, DEV, chain.batch_size)
    status, wall, gap, energy, step = bp.capped_solve("poet", chain, int(mins["joint"]), 20.0, device=DEV,
                                                      micro_batch_sizes=[4])
    assert status == "ok" and gap == 0.0 and energy > 0 and step > 0 and wall < 20.0
    assert bp.capped_solve("poet", chain, chain.fixed_bytes, 20.0, device=DEV)[0] == "infeasible"


def test_capped_solve_kills_a_solve_past_its_cap():
    chain = bp.synthetic_chain(120, seed=1)
    budget = bp.family_minimums(chain, DEV, chain.batch_size)["recompute-only"]    # tight: many schedules fit
    status, wall, gap, _, _ = bp.capped_solve("poet", chain, budget, 0.05, device=DEV, objective="time")
    assert status == "killed" and gap is None and wall < 5.0
