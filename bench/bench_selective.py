"""Bench (issue 17 part 1): selective (per-op) recomputation against whole-stage policies, as ratios.

Run: ``python bench/bench_selective.py fresh|ab [--out FILE.json]``

* ``fresh``: one fresh process per job (:func:`edgetrain.measure.run_isolated`, profile cache off), ResNet-18
  (32x32) and MobileNetV2 (64x64) at batch 32 under fixed budgets, with ``EDGETRAIN_SELECTIVE`` on and
  off: measured peak against the plan's predicted peak and the budget, and the plan's shape.
* ``ab``: per case one process and one prepared step, which runs the DP's plans for its own profiled chain,
  budget and micro-batch size with and without the selective options, in turn (A B A B ...); the step time is
  this process's CPU time (``time.process_time``, one torch thread), which other processes on a shared
  machine do not inflate the way they inflate wall time; reported as the median ratio of the pairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

MIB = 2**20
RN18 = {"model": "resnet18", "model_kwargs": {"num_classes": 10, "in_channels": 3, "small_input": True},
        "input_shape": (3, 32, 32)}
MNV2 = {"model": "mobilenet_v2", "model_kwargs": {"num_classes": 10, "in_channels": 3}, "input_shape": (3, 64, 64)}
CASES = [("resnet18", RN18, 287.0), ("resnet18", RN18, 191.5), ("mobilenet_v2", MNV2, 150.0)]


def fresh() -> list[dict[str, Any]]:
    from edgetrain.measure import Job, run_isolated

    rows = []
    for name, spec, mib in CASES:
        for sel in ("1", "0"):
            job = Job(**spec, batch_size=32, mode="edgetrain", budget=int(mib * MIB), steps=3, threads=1,
                      env={"EDGETRAIN_NO_CACHE": "1", "EDGETRAIN_SELECTIVE": sel})
            r = run_isolated(job, timeout_s=900)
            p = r.plan or {}
            pol = p.get("policies", [])
            rows.append(dict(model=name, budget_mib=mib, selective=sel == "1", ok=r.ok, error=r.error_type,
                             peak_mib=r.peak_bytes / MIB, pred_peak_mib=p.get("peak_bytes", 0) / MIB,
                             step_s=r.step_time_s, pred_step_s=p.get("step_time_s"), micro_batch=p.get("micro_batch_size"),
                             recomputed=pol.count("recompute"), selective_stages=sum(x.startswith("selective:") for x in pol)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def ab(rounds: int = 4) -> list[dict[str, Any]]:
    """Every case in its own process (a prepared step's memory stays resident in the process it ran in,
    and would count in the next case's fixed bytes)."""
    import subprocess

    rows = []
    for i in range(len(CASES)):
        out = subprocess.run([sys.executable, __file__, "ab-one", "--case", str(i), "--rounds", str(rounds)],
                             capture_output=True, text=True, check=False)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"case": CASES[i][:1] + CASES[i][2:], "error": out.stderr[-500:]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def ab_one(case: int, rounds: int) -> dict[str, Any]:
    import torch
    from torch import nn

    import edgetrain
    from edgetrain.measure import Job, build_model_and_batch
    from edgetrain.planners import solve_dp

    torch.set_num_threads(1)
    name, spec, mib = CASES[case]
    model, x, y = build_model_and_batch(Job(**spec, batch_size=32, mode="edgetrain"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), memory_budget=int(mib * MIB))
    # both plans from the step's own profiled chain, its budget and micro-batch size
    room, sizes = step.plan.budget_bytes or int(mib * MIB), [step.plan.micro_batch_size]
    sel = solve_dp(step.costs, room, micro_batch_sizes=sizes)
    whole = solve_dp(step.costs, room, selective=False, micro_batch_sizes=sizes)
    times: dict[str, list[float]] = {"sel": [], "whole": []}
    for _ in range(rounds):
        for key, plan in (("sel", sel), ("whole", whole)):
            step.set_plan(plan)
            step(x, y)  # warm-up of this plan
            t0 = time.process_time()
            step(x, y)
            step(x, y)
            times[key].append((time.process_time() - t0) / 2)
    ratios = [a / b for a, b in zip(times["sel"], times["whole"])]
    row = dict(model=name, budget_mib=mib, micro_batch=sel.micro_batch_size,
               selective_stages=sum(p.startswith("selective:") for p in sel.policies),
               recomputed_sel=sel.policies.count("recompute"), recomputed_whole=whole.policies.count("recompute"),
               pred_ratio=sel.step_time_s / whole.step_time_s, cpu_s_sel=times["sel"],
               cpu_s_whole=times["whole"], ratio_median=statistics.median(ratios),
               ratio_min=min(ratios), ratio_max=max(ratios))
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("fresh", "ab", "ab-one"))
    p.add_argument("--case", type=int, default=0, help="ab-one: index into CASES")
    p.add_argument("--rounds", type=int, default=4, help="A/B pairs per case (ab)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.what == "ab-one":
        ab_one(args.case, args.rounds)
        return 0
    rows = fresh() if args.what == "fresh" else ab(args.rounds)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
