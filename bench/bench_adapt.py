"""Bench (issue 4): what a memory-budget change costs while training runs.

Two sections, one run:

* ``replan``: building the budget table and switching plans from it, for 100-stage chains (synthetic,
  with per-sample costs of the size real CNN stages have) and for the real models' profiled chains;
  ``step.set_memory_budget`` timed on a prepared step (lookup plus executor rebuild).
* ``adapt``: the budget drops after 25%, 50% and 75% of a step's micro-batches. edgetrain keeps the
  gradients accumulated so far and runs the remaining micro-batches under the new plan; Melon's baseline
  abandons the step and restarts it under the new plan. Reported: measured step wall time of both, the
  recomputed forward FLOPs (checkpoint replays), the discarded FLOPs (work thrown away by the restart,
  forward + backward counted as 3x forward), and their sum as "redone" work, from the profiled FLOPs.

Run: ``python bench/bench_adapt.py [--quick] [--out bench/RESULTS_ADAPT.md]``.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    FULL_MODELS, MIB, MNV2_KW, TF_KW, ModelSpec, Progress, Table, machine_info, mib, ratio, render,
)

MICRO_BATCHES = 8
DROP_FRACTIONS = (0.25, 0.5, 0.75)


SPECS = FULL_MODELS
QUICK = {
    "mobilenet_v2": ModelSpec("mobilenet_v2", {**MNV2_KW, "width_mult": 0.5}, (3, 32, 32), 16),
    "transformer": ModelSpec("transformer", {**TF_KW, "d_model": 64, "num_layers": 2, "dim_feedforward": 128},
                             (28, 28), 32),
}


def synthetic_chain(n: int, seed: int) -> Any:
    """A ``n``-stage chain with per-sample costs drawn from the ranges real CNN stages show here."""
    from edgetrain.graph import CostChain, Linear, StageCost

    rng = random.Random(seed)
    stages = []
    for i in range(n):
        fwd = rng.uniform(0.2e-3, 3e-3)
        stages.append(StageCost(
            name=f"s{i}", fwd_s=Linear(1e-4, fwd), bwd_s=Linear(2e-4, 2.1 * fwd),
            saved_bytes=Linear(0, rng.randint(50_000, 2_000_000)), out_bytes=Linear(0, rng.randint(20_000, 600_000)),
            workspace_bytes=Linear(rng.randint(0, 2 * MIB), rng.randint(0, 300_000)),
            flops=Linear(0, fwd * 2e10)))
    return CostChain(tuple(stages), 64, Linear(0, 12_288), 80 * MIB, Linear(1e-4, 1e-5), 5e-3, f"synthetic-{n}-{seed}")


def _median_us(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def bench_table(chain: Any, label: str, table: Table, quick: bool) -> None:
    from edgetrain.planners import PlanTable

    built = PlanTable.build(chain, n_points=16 if quick else 64)
    lo, hi = built.budgets[0], built.budgets[-1]
    rng = random.Random(0)
    queries = [rng.randint(lo, hi) for _ in range(1000)]
    it = iter(queries * 1000)
    lookup_us = _median_us(lambda: built.plan_for(next(it)), 1000)
    table.add(label, chain.n, len(built), f"{built.build_time_s:.2f}", f"{lookup_us:.1f}",
              "yes" if lookup_us < 10_000 else "NO")


@dataclass
class AdaptRow:
    fraction: float
    adapt_s: float
    restart_s: float
    recomputed_adapt: float
    recomputed_restart: float
    discarded_restart: float


def _recompute_flops(costs: Any, plan: Any, micro: int) -> float:
    return sum(costs.stages[i].flops.at(micro) for i, p in enumerate(plan.policies) if p == "recompute")


def _fwd_flops(costs: Any, micro: int) -> float:
    return sum(s.flops.at(micro) for s in costs.stages)


class _Drop(Exception):
    """Raised by the restart baseline's budget source to abandon the running step."""


def bench_adapt(spec: ModelSpec, progress: Progress, threads: int, repeats: int) -> tuple[Table, list[str]]:
    import torch

    import edgetrain
    from edgetrain.measure import Job, build_model_and_batch
    from edgetrain.planners import PlanTable

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, x, y = build_model_and_batch(Job(spec.name, spec.input_shape, spec.batch_size, model_kwargs=spec.kwargs))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    micro = spec.batch_size // MICRO_BATCHES
    step = edgetrain.prepare(model, opt, torch.nn.CrossEntropyLoss(), (x, y), micro_batch_size=micro,
                             exact_batchnorm=False)
    costs = step.costs
    # The table at this micro-batch: the high budget keeps everything, the low one recomputes.
    t0 = time.perf_counter()
    table = PlanTable.build(costs, n_points=32, micro_batch_sizes=[micro])
    step._table = table
    build_s = time.perf_counter() - t0
    high_plan = table.plans[-1]
    # The low budget: the table's plan that recomputes closest to half of the stages.
    low_budget = min((b for b, p in zip(table.budgets, table.plans) if "recompute" in p.policies),
                     key=lambda b: (abs(table.plan_for(b).policies.count("recompute") - costs.n / 2), -b))
    low_plan = table.plan_for(low_budget)
    high_budget = table.budgets[-1]
    margin = 1.0 + step.margin_bytes / step.budget_bytes if step.budget_bytes else 1.0
    high_b, low_b = int(high_budget * margin) + 1, int(low_budget * margin) + 1

    def run_step(source: Any) -> float:
        step.set_memory_budget(high_b)
        step.budget_source = source
        t = time.perf_counter()
        try:
            step(x, y)
        finally:
            step.budget_source = None
        return time.perf_counter() - t

    def drop_after(k: int, exc: bool) -> Any:
        calls = {"n": 0}

        def source() -> int:
            calls["n"] += 1  # polled once before the step and once after each micro-batch but the last
            if calls["n"] > k:
                if exc:
                    raise _Drop()
                return low_b
            return high_b
        return source

    switch_us = _median_us(lambda: (step.set_memory_budget(low_b), step.set_memory_budget(high_b)), 50) / 2
    run_step(None)  # warm-up at both plans
    step.set_memory_budget(low_b)
    step(x, y)
    rows = []
    for f in DROP_FRACTIONS:
        k = int(round(f * MICRO_BATCHES))
        adapt, restart = [], []
        for _ in range(repeats):
            adapt.append(run_step(drop_after(k, False)))
            t = time.perf_counter()
            try:
                run_step(drop_after(k, True))
            except _Drop:
                step.set_memory_budget(low_b)
                step(x, y)
            restart.append(time.perf_counter() - t)
        r_hi = _recompute_flops(costs, high_plan, micro)
        r_lo = _recompute_flops(costs, low_plan, micro)
        rows.append(AdaptRow(f, statistics.median(adapt), statistics.median(restart),
                             k * r_hi + (MICRO_BATCHES - k) * r_lo, k * r_hi + MICRO_BATCHES * r_lo,
                             k * (3 * _fwd_flops(costs, micro) + r_hi)))
        progress(f"{spec.name}: drop at {f:.0%}: adapt {rows[-1].adapt_s:.2f} s, restart {rows[-1].restart_s:.2f} s")
    t = Table(f"{spec.name} {'x'.join(map(str, spec.input_shape))}, batch {spec.batch_size} = {MICRO_BATCHES} micro-batches "
              f"of {micro}: budget {mib(high_b)} -> {mib(low_b)} MiB ({high_plan.policies.count('recompute')} -> "
              f"{low_plan.policies.count('recompute')}/{costs.n} stages recomputed)",
              ["drop at", "adapt step s", "restart step s", "restart/adapt", "recomputed GFLOP adapt",
               "recomputed GFLOP restart", "discarded GFLOP restart", "redone GFLOP adapt", "redone GFLOP restart",
               "less redone"])
    less = []
    for r in rows:
        redone_a, redone_r = r.recomputed_adapt, r.recomputed_restart + r.discarded_restart
        less.append(1 - redone_a / redone_r if redone_r else 0.0)
        t.add(f"{r.fraction:.0%}", f"{r.adapt_s:.3f}", f"{r.restart_s:.3f}", ratio(r.restart_s / r.adapt_s),
              f"{r.recomputed_adapt / 1e9:.2f}", f"{r.recomputed_restart / 1e9:.2f}",
              f"{r.discarded_restart / 1e9:.2f}", f"{redone_a / 1e9:.2f}", f"{redone_r / 1e9:.2f}", f"{less[-1]:.1%}")
    mean_less = sum(less) / len(less)
    mean_rec = 1 - sum(r.recomputed_adapt for r in rows) / max(1e-9, sum(r.recomputed_restart for r in rows))
    t.notes += [f"table: {len(table)} budgets built in {build_s:.2f} s; set_memory_budget (lookup + executor "
                f"rebuild) {switch_us:.0f} us",
                f"mean over drops at 25/50/75%: redone work {mean_less:.1%} less than restarting "
                f"(checkpoint recomputation alone: {mean_rec:.1%} less) -- target >= 50%: "
                f"{'met' if mean_less >= 0.5 else 'MISSED'}"]
    step.close()
    return t, [f"{spec.name}: {mean_less:.1%} less redone work, {mean_rec:.1%} less recomputation"]


FRAG_MODES = {  # label: (environment, budget: None plain / "none" / fraction of plain's peak, install the pool)
    "plain (glibc defaults)": ({"EDGETRAIN_ALLOCATOR": "system"}, None, False),
    "plain, mmap threshold 64 KiB": ({"EDGETRAIN_ALLOCATOR": "tuned"}, None, False),
    "plain + edgetrain's tensor pool": ({}, None, True),
    "edgetrain, no budget": ({}, "none", False),
    "edgetrain, 60% budget": ({}, 0.6, False),
    "edgetrain, 60% budget, mmap threshold only": ({"EDGETRAIN_ALLOCATOR": "tuned"}, 0.6, False),
}


def frag_worker(spec_json: str) -> None:
    """In a fresh process: one step's resident growth vs its live-tensor growth (printed as JSON)."""
    import json

    import torch
    from torch.profiler import ProfilerActivity, profile

    import edgetrain
    from edgetrain.profile import memory
    from edgetrain.measure import Job, build_model_and_batch

    d = json.loads(spec_json)
    torch.set_num_threads(d["threads"] or torch.get_num_threads())
    torch.manual_seed(0)
    model, x, y = build_model_and_batch(Job(d["model"], tuple(d["shape"]), d["batch"], model_kwargs=d["kwargs"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    if d["budget"] is None:
        if d["pool"]:
            from edgetrain.runtime import pool

            pool.install()

        def run() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
        plan = None
    else:
        budget = None if d["budget"] == "none" else int(d["budget"])
        step = edgetrain.prepare(model, opt, loss_fn, (x, y), memory_budget=budget)
        run = lambda: step(x, y)  # noqa: E731
        plan = f"mb={step.plan.micro_batch_size}, {step.plan.policies.count('recompute')}/{step.plan.num_stages} recomp"
    for _ in range(2):
        run()
    # Tensors that live through the whole step; gradients are not among them: both loops free them at the
    # start of the step (zero_grad(set_to_none=True)) and the profiler sees them allocated again.
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers(), x, y,
                          *(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))]}
    faults0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    run()  # a steady step: its time and page faults (the peak is taken on the next one)
    step_s, faults = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    with memory.measure_peak() as meter:
        run()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    print("FRAG " + json.dumps({"live_start": sum(storages.values()), "live_growth": peak,
                                "peak": meter.above_baseline_bytes, "plan": plan, "step_s": step_s,
                                "faults": faults}))


def bench_fragmentation(spec: ModelSpec, threads: int, progress: Progress, quick: bool) -> Table:
    import json
    import os
    import subprocess

    from edgetrain.measure import Job, run_isolated

    plain = run_isolated(Job(spec.name, spec.input_shape, spec.batch_size, mode="plain", model_kwargs=spec.kwargs,
                             steps=2, threads=threads, env={"EDGETRAIN_ALLOCATOR": "system"}))
    t = Table(f"{spec.name} {'x'.join(map(str, spec.input_shape))} batch {spec.batch_size}: one step's resident growth "
              f"over its live tensor bytes (plain peak {mib(plain.peak_bytes)} MiB)",
              ["mode", "config", "peak MiB", "live tensors at start MiB", "peak live tensors MiB", "peak/live",
               "step s", "page faults"])
    for label, (env, frac, use_pool) in FRAG_MODES.items():
        if quick and isinstance(frac, float):
            label, frac = label.replace("60%", "100%"), 1.0  # small models: runtime overhead leaves no room
        budget = None if frac is None else ("none" if frac == "none" else int(frac * plain.peak_bytes))
        spec_json = json.dumps({"model": spec.name, "shape": spec.input_shape, "batch": spec.batch_size,
                                "kwargs": spec.kwargs, "threads": threads, "budget": budget, "pool": use_pool})
        proc = subprocess.run([sys.executable, __file__, "--frag-worker", spec_json], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=900)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FRAG ")), None)
        if line is None:
            t.add(label, "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:80])
            continue
        r = json.loads(line[5:])
        live = r["live_start"] + r["live_growth"]
        t.add(label, r["plan"] or "-", mib(r["peak"]), mib(r["live_start"]), mib(live), ratio(r["peak"] / max(1, live)),
              f"{r['step_s']:.3f}", f"{r['faults']:,}")
        progress(f"{spec.name}: {label}: peak {mib(r['peak'])} MiB vs live {mib(live)} MiB")
    t.notes += ["peak: VmHWM over the fourth step above the RSS after `import torch, edgetrain` (what a budget "
                "bounds); peak live tensors: bytes of the parameters, optimizer state and batch (gradients are freed "
                "as the step starts) plus the highest growth, during the fifth step, of bytes allocated "
                "through PyTorch's CPU allocator (torch.profiler memory events). peak/live is the allocator's "
                "and the runtime's share: "
                "glibc's retention and fragmentation, plus memory outside PyTorch's allocator (oneDNN kernels and "
                "scratch, the autograd engine), which is why even an exact allocator stays above 1. step s and page "
                "faults: the step before it (minor faults from getrusage), so the pool's cache is warm as in training."]
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small models, 16-point tables")
    ap.add_argument("--models", default=None, help="comma-separated subset of the models")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per drop (median)")
    ap.add_argument("--out", default=None, help="write the report as markdown here")
    ap.add_argument("--sections", default="replan,adapt,fragmentation", help="comma-separated sections to run")
    ap.add_argument("--frag-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.frag_worker:
        frag_worker(args.frag_worker)
        return 0
    progress = Progress()
    wanted = set(args.sections.split(","))
    specs = QUICK if args.quick else SPECS
    names = args.models.split(",") if args.models else list(specs)
    replan = Table("Re-planning from the budget table (100-stage chains and the real models)",
                   ["chain", "stages", "table budgets", "build s", "lookup us (median)", "under 10 ms"])
    for seed in range(3 if "replan" in wanted else 0):
        bench_table(synthetic_chain(100, seed), f"synthetic seed {seed}", replan, args.quick)
        progress(f"replan: synthetic chain {seed} done")
    tables: list[Table | str] = []
    summary: list[str] = []
    frag: list[Table | str] = []
    for name in names:
        if "adapt" in wanted:
            t, s = bench_adapt(specs[name], progress, args.threads, 1 if args.quick else args.repeats)
            tables.append(t)
            summary += s
        if "fragmentation" in wanted:
            frag.append(bench_fragmentation(specs[name], args.threads, progress, args.quick))
    meta = [(k, v) for k, v in machine_info().items()] + [("command", " ".join(["python bench/bench_adapt.py"] +
                                                                              (argv or sys.argv[1:])))]
    sections = [("Re-planning", [replan]), ("Budget drop in the middle of a step", tables + ["\n".join(summary)]),
                ("Allocator share: resident growth over live tensor bytes", frag)]
    print(render("edgetrain bench: budget changes while training (issue 4)", meta, sections, markdown=False))
    if args.out:
        Path(args.out).write_text(render("edgetrain bench: budget changes while training (issue 4)", meta, sections,
                                         markdown=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
