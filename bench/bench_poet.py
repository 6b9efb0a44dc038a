"""Bench (issue 3): joint recomputation + paging (POET-style) against recompute-only and paging-only.

Run: ``python bench/bench_poet.py [--quick] [--models mobilenet_v2,resnet18,transformer] [--out FILE.md]``

Per model, at a batch where activations dominate and with the micro-batch FIXED to the full batch (paging
cannot beat recomputation at micro-batch 1, where both fit the same few tensors, so every family is compared
at one size):

1. profile once in a fresh process (``prepare`` without a budget; ``step.costs``) and, with the measured
   ``host`` device profile, the smallest feasible budget of each policy family (recompute-only,
   paging-only, joint), from the planners' ``BudgetError.min_feasible_bytes``;
2. a budget sweep from the joint minimum to plain PyTorch's peak: per family the predicted step time and
   energy (energy objective), solve time and proven gap, by the exact DP (``poet``) and the MILP
   (``poet-milp``);
3. a real run in a fresh process (``measure.run_isolated``, ``prepare(paging=True)``) at a budget below
   recompute-only's minimum but above joint's: measured peak vs budget, measured vs predicted step time;
   the same budget with ``paging=False`` (expected: BudgetError) and plain PyTorch for reference; then,
   in this process, the plan that ran vs plain PyTorch for 2 steps, ``torch.equal`` on every parameter
   and buffer;
4. solve time of both planners on chains of 100+ stages (a random synthetic chain and a real profiled
   chain repeated), each solve in a forked child with a hard wall-clock cap.

Every subprocess uses a private profile cache (a temp dir), so nothing measured by others is reused.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    FULL_MODELS, MNV2_KW, RN18_KW, TF_KW, ModelSpec, Progress, Table, machine_info, mib, render,
)
from _poet_report import (  # noqa: E402,F401  (rows and tables are re-exported: the smoke tests read them here)
    FAMILIES, GAP_LIMIT, MAX_TRIES, OPT_LR, OPT_MOMENTUM, SAFETY_MARGIN, SOLVE_LIMIT_S, SOLVERS, TIME_TOLERANCE,
    MinRow, RealRow, SolveRow, SweepRow, claim_lines, claims_table, min_table, real_table, solve_table, sweep_claims,
    sweep_table,
)

MIB = 2**20


QUICK_MODELS = {"mobilenet_v2": ModelSpec("mobilenet_v2", MNV2_KW, (3, 32, 32), 16),
                "resnet18": ModelSpec("resnet18", RN18_KW, (3, 16, 16), 16),
                "transformer": ModelSpec("transformer", TF_KW, (28, 28), 32)}


@dataclass(frozen=True)
class Settings:
    """How much to measure (``--quick`` picks the small values)."""

    steps: int = 3                          # optimizer steps per fresh-process job (first is warm-up)
    fraction: float = 0.5                   # real-run plan budget: joint min + f x (recompute min - joint min)
    real_models: tuple[str, ...] | None = None   # models given a real run (None: all)
    check_recompute: bool = True            # fresh run with paging=False at the same budget
    plain_runs: bool = True                 # fresh plain-PyTorch run per model
    exact_steps: int = 2
    synth_stages: int = 120
    tiled_copies: int = 5                   # real chain repeated to 100+ stages (0: skip)
    synth_objectives: tuple[tuple[str, float | None], ...] = (("energy", None), ("time", None), ("energy", 1.5))
    solve_cap_s: float = 30.0               # hard wall-clock cap per synthetic solve (forked child)
    job_timeout_s: float = 900.0


QUICK = Settings(steps=2, plain_runs=False, tiled_copies=0, real_models=("transformer",),
                 synth_objectives=(("energy", None), ("time", None)), solve_cap_s=15.0, job_timeout_s=300.0)


# ---------------------------------------------------------------------------------------- measurement
def _job(spec: ModelSpec, **kw: Any) -> Any:
    from edgetrain.measure import Job

    return Job(spec.name, spec.input_shape, spec.batch_size, model_kwargs=dict(spec.kwargs), **kw)


def profile_model(spec: ModelSpec, env: dict[str, str], timeout_s: float) -> Any:
    """Profile ``spec`` in a fresh process (``prepare`` without a budget) and return its ``CostChain``."""
    from edgetrain.graph import CostChain

    arg = json.dumps({"name": spec.name, "kwargs": spec.kwargs, "shape": spec.input_shape, "batch": spec.batch_size})
    proc = subprocess.run([sys.executable, __file__, "--profile-worker", arg], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **env})
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("BENCH_POET_COSTS "):
            return CostChain.from_json(line[len("BENCH_POET_COSTS "):])
    raise RuntimeError(f"profiling {spec.name} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")


def _profile_worker(arg: str) -> int:
    import torch

    import edgetrain
    from edgetrain.measure import build_model_and_batch

    d = json.loads(arg)
    spec = ModelSpec(d["name"], d["kwargs"], tuple(d["shape"]), d["batch"])
    model, x, y = build_model_and_batch(_job(spec))
    opt = torch.optim.SGD(model.parameters(), lr=OPT_LR, momentum=OPT_MOMENTUM)
    step = edgetrain.prepare(model, opt, torch.nn.CrossEntropyLoss(), (x, y), name=spec.name)
    print("BENCH_POET_COSTS " + json.dumps(step.costs.to_dict()), flush=True)
    step.close()
    return 0


def family_minimums(costs: Any, device: Any, batch: int) -> dict[str, int | None]:
    """Smallest feasible budget of each family at micro-batch ``batch`` (the planners' BudgetError)."""
    from edgetrain.errors import BudgetError
    from edgetrain.planners import solve_poet_dp

    out: dict[str, int | None] = {}
    for fam, paging, recompute in FAMILIES:
        try:
            solve_poet_dp(costs, 0, device=device, paging=paging, recompute=recompute, micro_batch_sizes=[batch])
            out[fam] = 0
        except BudgetError as e:
            out[fam] = e.min_feasible_bytes
    return out


def _solve(solver: str, costs: Any, budget: int, **kw: Any) -> Any:
    from edgetrain.planners import solve_poet, solve_poet_dp

    return (solve_poet_dp if solver == "poet" else solve_poet)(costs, budget, **kw)


def sweep_model(model: str, costs: Any, device: Any, budgets: Sequence[int], plain_peak: int) -> list[SweepRow]:
    """Plan every family with both solvers at every budget (energy objective, micro-batch = batch)."""
    from edgetrain.errors import BudgetError

    rows = []
    for b in budgets:
        for fam, paging, recompute in FAMILIES:
            for solver in SOLVERS:
                t0 = time.perf_counter()
                try:
                    p = _solve(solver, costs, b, device=device, objective="energy", paging=paging,
                               recompute=recompute, micro_batch_sizes=[costs.batch_size])
                except BudgetError:
                    rows.append(SweepRow(model, b, plain_peak, fam, solver, False, solve_s=time.perf_counter() - t0))
                    continue
                rows.append(SweepRow(model, b, plain_peak, fam, solver, True, p.step_time_s, float(p.energy_j or 0),
                                     p.peak_bytes, p.solve_time_s, p.optimality_gap, p.policies.count("recompute"),
                                     p.policies.count("page")))
    return rows


def sweep_budgets(joint_min: int, rec_min: int | None, plain_peak: int) -> list[int]:
    """Joint minimum, recompute-only minimum, two points between it and plain's peak, plain's peak."""
    lo = rec_min if rec_min is not None and joint_min < rec_min < plain_peak else joint_min
    pts = [joint_min, lo] + [int(lo + (plain_peak - lo) * k / 3) for k in (1, 2)] + [plain_peak]
    return sorted(set(pts))


def check_exact(spec: ModelSpec, plan: Any, steps: int, env: dict[str, str]) -> tuple[bool, int, int]:
    """Train ``plan`` (with its paging) and plain PyTorch from the same weights; compare every tensor.

    Returns:
        (all equal, tensors compared, bytes the pager wrote).
    """
    import torch

    import edgetrain
    from edgetrain.measure import build_model_and_batch

    os.environ.update(env)
    ref, x, y = build_model_and_batch(_job(spec))
    new, _, _ = build_model_and_batch(_job(spec))
    loss_fn = torch.nn.CrossEntropyLoss()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=OPT_LR, momentum=OPT_MOMENTUM)
    opt_new = torch.optim.SGD(new.parameters(), lr=OPT_LR, momentum=OPT_MOMENTUM)
    step = edgetrain.prepare(new, opt_new, loss_fn, (x, y), paging=True, micro_batch_size=spec.batch_size,
                             objective="energy", name=spec.name)
    try:
        step.set_plan(plan)
        for i in range(steps):
            torch.manual_seed(1000 + i)     # the same dropout masks for both (the transformer has dropout)
            opt_ref.zero_grad(set_to_none=True)
            loss_fn(ref(x), y).backward()
            opt_ref.step()
            torch.manual_seed(1000 + i)
            step(x, y)
        pager = getattr(step, "_pager", None)     # TrainStep has no public accessor for its pager
        written = pager.stats.written_bytes if pager is not None else 0
    finally:
        step.close()
    a, b = ref.state_dict(), new.state_dict()
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return equal, len(a), written


def _paging_job(spec: ModelSpec, budget: int, paging: bool, s: Settings, env: dict[str, str]) -> Any:
    return _job(spec, budget=budget, micro_batch_size=spec.batch_size, paging=paging, objective="energy",
                solver="poet", steps=s.steps, env=env)


def real_run(spec: ModelSpec, mins: dict[str, int | None], s: Settings, env: dict[str, str],
             log: Callable[[str], None], plain_predicted_time_s: float = 0.0) -> RealRow | None:
    """Section 3 for one model; ``None`` when paging does not lower the minimum (nothing to show).

    The budget's plan part (budget minus prepare's margin) starts between the joint and the recompute-only
    minimum of the bench's profile. The fresh process measures its own fixed bytes, which may be larger;
    if it raises BudgetError the run is repeated once at the budget the error names (what a user would do).
    Whether that budget is below recompute-only's minimum is then checked the same way: a fresh run with
    ``paging=False`` at the same budget.
    """
    from edgetrain.measure import run_isolated
    from edgetrain.plan import Plan

    joint, rec = mins.get("joint"), mins.get("recompute-only")
    if joint is None or rec is None or joint >= rec:
        return None
    budget = math.ceil(int(joint + s.fraction * (rec - joint)) / (1 - SAFETY_MARGIN))
    row = RealRow(spec.name, budget, joint, rec, plain_predicted_time_s=plain_predicted_time_s)
    for attempt in range(MAX_TRIES):
        log(f"{spec.name}: fresh run with paging at {mib(budget)} MiB")
        res = run_isolated(_paging_job(spec, budget, True, s, env), timeout_s=s.job_timeout_s)
        row.budget_bytes = budget
        if res.ok:
            row.error = None
            break
        row.error = f"{res.error_type}: {res.error}"
        log(f"{spec.name}: {row.error[:300]}")
        if attempt + 1 == MAX_TRIES or res.error_type != "BudgetError":
            return row
        row.failed_tries.append(f"{mib(budget)} MiB: {res.error_type} naming {mib(res.min_feasible_bytes)} MiB")
        budget = max(int(res.min_feasible_bytes or 0), math.ceil(budget * 1.02))
    p = res.plan or {}
    policies = list(p.get("policies", []))
    row.peak_bytes, row.measured_time_s = res.peak_bytes, res.step_time_s
    row.predicted_peak_bytes, row.predicted_time_s = int(p.get("peak_bytes", 0)), float(p.get("step_time_s", 0))
    row.predicted_energy_j, row.micro_batch = p.get("energy_j"), int(p.get("micro_batch_size", 0))
    row.recomputed, row.paged = policies.count("recompute"), policies.count("page")
    row.predicted_stall_s = float(p.get("metadata", {}).get("stall_time_s") or 0.0)
    if s.check_recompute:
        log(f"{spec.name}: fresh run with paging=False at {mib(budget)} MiB (expected: BudgetError)")
        r2 = run_isolated(_paging_job(spec, budget, False, s, env), timeout_s=s.job_timeout_s)
        row.rec_only_ran = r2.ok
        row.rec_only = (f"ran, peak {mib(r2.peak_bytes)}" if r2.ok else
                        f"{r2.error_type}, needs {mib(r2.min_feasible_bytes)}" if r2.min_feasible_bytes else
                        f"{r2.error_type}")
    if s.plain_runs:
        log(f"{spec.name}: fresh plain PyTorch run")
        r3 = run_isolated(_job(spec, mode="plain", steps=s.steps, env={**env, "EDGETRAIN_ALLOCATOR": "system"}),
                          timeout_s=s.job_timeout_s)
        row.plain_peak_bytes, row.plain_time_s = (r3.peak_bytes, r3.step_time_s) if r3.ok else (0, 0.0)
    plan = Plan.from_json(json.dumps(p))
    if "page" not in plan.policies:
        row.exact_note = "the plan that ran pages nothing"
        return row
    log(f"{spec.name}: bit-exactness in process ({s.exact_steps} steps, plan with {row.paged} paged stages)")
    try:
        row.exact, row.exact_tensors, row.paged_written_bytes = check_exact(spec, plan, s.exact_steps, env)
    except Exception as e:  # report, do not hide: the table shows the failure
        row.exact, row.exact_note = False, f"{type(e).__name__}: {e}"[:120]
    return row


def synthetic_chain(n: int, seed: int, batch: int = 8) -> Any:
    """A random chain of ``n`` stages (seeded): compute per sample log-normal, saved bytes often large."""
    from edgetrain.graph import CostChain, Linear, StageCost

    rng = random.Random(seed)
    stages = []
    for t in range(n):
        fwd = rng.lognormvariate(-7.0, 0.8)              # ~1 ms per sample, spread over ~5x
        saved = rng.choice([0.0, 0.5, 1.0, 2.0, 3.0, 6.0]) * 2**16
        out = rng.choice([0.5, 1.0, 2.0]) * 2**16
        stages.append(StageCost(f"s{t}", fwd_s=Linear(1e-5, fwd), bwd_s=Linear(2e-5, 2.1 * fwd),
                                saved_bytes=Linear(0, saved), out_bytes=Linear(0, out),
                                workspace_bytes=Linear(4096, rng.uniform(0, 0.3) * out), flops=Linear(0, fwd * 1e10)))
    return CostChain(tuple(stages), batch, Linear(0, 2**16), 8 << 20, Linear(1e-5, 1e-5), 1e-3, f"synthetic-{n}")


def tiled_chain(costs: Any, copies: int) -> Any:
    """A real profiled chain repeated ``copies`` times (a deeper network with the same kinds of stages)."""
    stages = tuple(replace(st, name=f"{k}.{st.name}") for k in range(copies) for st in costs.stages)
    return replace(costs, stages=stages, name=f"{costs.name}x{copies}")


def _child(conn: Any, solver: str, chain: Any, budget: int, kw: dict[str, Any]) -> None:
    from edgetrain.errors import BudgetError

    t0 = time.perf_counter()
    try:
        p = _solve(solver, chain, budget, **kw)
        status = "ok, time limit" if any("time limit" in n for n in p.notes) else "ok"
        conn.send((status, time.perf_counter() - t0, p.optimality_gap, float(p.energy_j or 0), p.step_time_s))
    except BudgetError:
        conn.send(("infeasible", time.perf_counter() - t0, None, 0.0, 0.0))
    except Exception as e:  # pragma: no cover - reported in the table
        conn.send((f"error {type(e).__name__}", time.perf_counter() - t0, None, 0.0, 0.0))


def capped_solve(solver: str, chain: Any, budget: int, cap_s: float, **kw: Any) -> tuple[str, float, Any, float, float]:
    """Run one solve in a forked child; kill it after ``cap_s`` seconds."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    t0 = time.perf_counter()
    proc = ctx.Process(target=_child, args=(send, solver, chain, budget, kw), daemon=True)
    proc.start()
    got = recv.poll(cap_s)
    result = recv.recv() if got else ("killed", time.perf_counter() - t0, None, 0.0, 0.0)
    if proc.is_alive():
        proc.kill()
    proc.join()
    return result


def long_chain_solves(chains: Sequence[Any], device: Any, s: Settings, log: Callable[[str], None]) -> list[SolveRow]:
    """Section 4: both planners on each long chain, at a tight and a mid budget, per objective."""
    from edgetrain.errors import BudgetError
    from edgetrain.planners import solve_poet_dp
    from edgetrain.planners.paging_model import simulate_paged

    rows = []
    for chain in chains:
        try:
            solve_poet_dp(chain, 0, device=device, paging=False)
            raise RuntimeError("a zero budget cannot be feasible")
        except BudgetError as e:
            tight = int(e.min_feasible_bytes)
        keep = simulate_paged(chain, device, chain.batch_size, ["keep"] * chain.n).peak_bytes
        for label, budget in (("tight", tight), ("mid", (tight + keep) // 2)):
            for obj, tb in s.synth_objectives:
                for solver in SOLVERS:
                    log(f"solve {chain.name} ({chain.n} stages) {label} {obj}{'' if tb is None else f' <= {tb}x'} "
                        f"with {solver}")
                    status, wall, gap, e_j, t_s = capped_solve(solver, chain, budget, s.solve_cap_s, device=device,
                                                               objective=obj, time_budget=tb,
                                                               time_limit_s=SOLVE_LIMIT_S)
                    rows.append(SolveRow(chain.name, chain.n, label, budget, obj, tb, solver, status, wall, gap,
                                         e_j, t_s))
    return rows


# ------------------------------------------------------------------------------------------------ main
def energy_label(device: Any) -> str:
    """Whether the host profile's powers are measured (RAPL) or estimated, from its provenance."""
    prov = {k: device.provenance.get(k, "?") for k in ("active_power_w", "memory_power_w")}
    kind = "measured (RAPL)" if set(prov.values()) == {"measured"} else "ESTIMATED (RAPL unreadable here)"
    return (f"predicted from the host profile, powers {kind}: active {device.active_power_w:.2f} W "
            f"({prov['active_power_w']}), paging {device.memory_power_w:.2f} W ({prov['memory_power_w']}); "
            "no measured energy column: no RAPL counter is readable")


def host_profile_table(device: Any) -> Table:
    t = Table("Host device profile (edgetrain.devices.load_profile('host'))", ["field", "value", "provenance"])
    for k in ("compute_flops_per_s", "active_power_w", "memory_power_w", "page_out_bytes_per_s",
              "page_out_latency_s", "page_in_bytes_per_s", "page_in_latency_s"):
        t.add(k, f"{getattr(device, k):.4g}", device.provenance.get(k, "?"))
    return t


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke-sized run (smaller inputs, no reference runs)")
    p.add_argument("--models", default=",".join(FULL_MODELS), help="comma-separated subset of "
                   + ", ".join(FULL_MODELS))
    p.add_argument("--sections", default="min,sweep,real,solve", help="subset of min,sweep,real,solve "
                   "(sweep and real need min)")
    p.add_argument("--out", default=None, help="write the report as markdown here")
    p.add_argument("--costs-dir", default=None, help="write each model's profiled cost chain (JSON) here, to "
                   "re-plan or reproduce a solve later")
    p.add_argument("--note", default="machine shared with other jobs: timings are noisy",
                   help="a line added to the report")
    p.add_argument("--profile-worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile_worker is not None:
        return _profile_worker(args.profile_worker)
    s = QUICK if args.quick else Settings()
    specs = [(QUICK_MODELS if args.quick else FULL_MODELS)[m] for m in args.models.split(",") if m]
    sections = set(args.sections.split(","))
    log = Progress()
    cache = tempfile.TemporaryDirectory(prefix="bench-poet-cache-")
    env = {"EDGETRAIN_CACHE_DIR": cache.name}
    os.environ.update(env)
    from edgetrain.devices import load_profile
    from edgetrain.planners import solve_poet_dp

    device = load_profile("host")
    meta = [("command", " ".join([Path(sys.executable).name, *sys.argv])),
            ("date", time.strftime("%Y-%m-%d %H:%M:%S %Z")), *machine_info().items(), ("note", args.note)]
    print(render("edgetrain bench: joint recomputation + paging (issue 3)", meta, [], False), flush=True)
    mins: list[MinRow] = []
    sweep: list[SweepRow] = []
    real: list[RealRow] = []
    solves: list[SolveRow] = []
    profiled: dict[str, Any] = {}
    for spec in specs if sections & {"min", "sweep", "real"} or s.tiled_copies else []:
        log(f"{spec.name}: profiling in a fresh process (batch {spec.batch_size}, input {spec.input_shape})")
        costs = profile_model(spec, env, s.job_timeout_s)
        profiled[spec.name] = costs
        if args.costs_dir:
            Path(args.costs_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.costs_dir) / f"{spec.name}.json").write_text(costs.to_json())
        plain = solve_poet_dp(costs, 2**62, device=device, paging=False, recompute=False,
                              micro_batch_sizes=[spec.batch_size])
        fam = family_minimums(costs, device, spec.batch_size)
        mins.append(MinRow(spec.name, spec.batch_size, costs.n, costs.fixed_bytes, plain.peak_bytes,
                           plain.step_time_s, fam))
        log(f"{spec.name}: minimums (MiB) " + ", ".join(f"{k} {mib(v)}" for k, v in fam.items()))
        if "sweep" in sections and fam.get("joint"):
            budgets = sweep_budgets(int(fam["joint"]), fam.get("recompute-only"), plain.peak_bytes)
            log(f"{spec.name}: sweep over {len(budgets)} budgets x 3 families x 2 solvers")
            sweep += sweep_model(spec.name, costs, device, budgets, plain.peak_bytes)
        if "real" in sections and (s.real_models is None or spec.name in s.real_models):
            row = real_run(spec, fam, s, env, log, plain.step_time_s)
            if row is not None:
                real.append(row)
    if "solve" in sections:
        chains = [synthetic_chain(s.synth_stages, seed=1)]
        base = profiled.get("resnet18") or next(iter(profiled.values()), None)
        if s.tiled_copies and base is not None:
            copies = max(s.tiled_copies, math.ceil(100 / base.n))
            chains.append(tiled_chain(base, copies))
        solves = long_chain_solves(chains, device, s, log)
    items: list[tuple[str, list[Table | str]]] = [("Device", [host_profile_table(device)])]
    if mins and "min" in sections:
        items.append(("Smallest feasible budgets", [min_table(mins)]))
    if sweep:
        items.append(("Budget sweep", [sweep_table(sweep, energy_label(device))]))
    if real:
        items.append(("Real runs", [real_table(real, s.steps)]))
    if solves:
        items.append(("Solve time", [solve_table(solves, s.solve_cap_s)]))
    claims = claim_lines(mins if "min" in sections else [], sweep, real, solves)
    items.append(("Claims", [claims_table(claims)]))
    items.append(("Wall time", [f"total {log.elapsed_s():.0f} s"]))
    print(render("Results", [], items, False), flush=True)
    if args.out:
        Path(args.out).write_text(render("edgetrain bench: joint recomputation + paging (issue 3)", meta,
                                         items, True))
        log(f"wrote {args.out}")
    cache.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
