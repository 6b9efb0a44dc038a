"""Bench (issue 2): plain PyTorch vs ``checkpoint_sequential`` vs torch.compile vs edgetrain under memory budgets.

Run: ``python bench/bench_budget.py [--quick] [--skip-compile] [--models mobilenet_v2,resnet18,transformer]
[--out FILE.md]``

Every number is measured by :func:`edgetrain.measure.run_isolated`: one fresh Python process per job, peak =
VmHWM minus the RSS right after ``import torch, edgetrain`` (what a budget bounds), step time = median of the
steps after the first. Plain PyTorch and ``checkpoint_sequential`` run with glibc's default allocator
(``EDGETRAIN_ALLOCATOR=system``), as users run them; "plain+mmap" is plain with the allocator edgetrain tunes.
edgetrain jobs run without the on-disk profile cache, so every one profiles, and its peak includes profiling.

Per model, at the full batch B:
1. plain PyTorch's unconstrained peak P and step time T;
2. for budgets 20-100% of P, per method the fastest configuration whose *measured* peak fits:
   plain = the largest micro-batch of B, B/2, ... 1 (gradient accumulation) that fits; checkpoint_sequential =
   the fastest segment count of {2, 4, sqrt(n), n/2} (n = stages edgetrain captures), with accumulation only
   when nothing fits at B; torch.compile (issue 17, PyTorch's own planner; ``--skip-compile`` leaves it out) =
   ``torch.compile(model)`` with ``torch._functorch.config.activation_memory_budget`` at the largest ratio
   measured to fit (:func:`bench_compile`: ratios 1 and 0, then interpolated on measured peaks, at the full
   batch; peak over the steps after the compiling one); edgetrain = ``prepare(..., memory_budget=budget)``
   (BudgetError is an entry);
3. the issue's claims: edgetrain's throughput above checkpoint_sequential's at every budget (both re-measured
   in turn ``--versus-repeats`` times where both fit; medians compared), and at 50% of P a step at most 1.35x T
   inside the budget (re-measured ``--repeats`` times, interleaved with plain).
Then the largest batch without micro-batching that plain and edgetrain (``micro_batch_size=batch``) each train
inside a fixed budget (plain's peak at batch 32) for MobileNetV2 at 64x64: doubling, then bisection.

Search economy: micro-batches are tried from large to small and stop once one fits, or once two measured peaks
show the rest cannot (:func:`hopeless`); checkpoint_sequential first tries its leanest segment count at each
smaller micro-batch and the others only where that one fits. ``--json`` keeps every job; ``--replay`` rebuilds
the tables from such a log (``--measure-missing`` runs only the jobs it lacks).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _budget_report import (  # noqa: E402,F401  (the tables are re-exported: tests and --replay read them here)
    CLAIM_FRACTION, COMPILE, EDGE_COMPILED, EDGE_LAYOUT, EDGE_MBN, EDGE_OPTIONS, Claim, Entry, MaxBatchReport,
    ModelReport, budget_table, build_report, claims_table, compile_table, edgetrain_entry, fits, maxbatch_table,
    plans_table, reference_table, versus_line, versus_lines,
)
from _budget_ckpt import CheckpointPeer  # noqa: E402
from _budget_search import (  # noqa: E402,F401  (re-exported: tests read them here)
    compile_best, compile_next_ratio, fastest_fitting, hopeless, job_key, largest_fitting, max_batch_search,
    micro_batch_candidates, segment_candidates,
)
from _common import (  # noqa: E402
    FULL_MODELS, MNV2_KW, NO_CACHE, RN18_KW, SYSTEM_ALLOC, TF_KW, ModelSpec, Progress, machine_info, mib, render,
    secs,
)

from edgetrain.measure import Job, JobResult, run_isolated  # noqa: E402

MIB = 2**20


QUICK_MODELS = {"mobilenet_v2": ModelSpec("mobilenet_v2", MNV2_KW, (3, 32, 32), 16),
                "resnet18": ModelSpec("resnet18", RN18_KW, (3, 16, 16), 8),
                "transformer": ModelSpec("transformer", TF_KW, (28, 28), 16)}


@dataclass(frozen=True)
class Settings:
    """How much to measure (``--quick`` picks the small values)."""

    budgets: tuple[float, ...] = (0.2, 0.35, 0.5, 0.75, 1.0)
    steps: int = 6  # a shared host's step times swing +-15% within a job: the median of 5 steadies a ratio
    threads: int = 0
    repeats: int = 1
    versus_repeats: int = 4
    quick_segments: bool = False
    job_timeout_s: float = 900.0
    maxbatch: ModelSpec = field(default_factory=lambda: replace(FULL_MODELS["mobilenet_v2"], batch_size=32))
    maxbatch_steps: int = 2
    maxbatch_resolution: float = 1 / 64
    maxbatch_limit: int = 2048
    compile: bool = True
    compile_tries: int = 2


QUICK = Settings(budgets=(0.5, 1.0), steps=2, repeats=0, versus_repeats=0, quick_segments=True,
                 maxbatch=replace(FULL_MODELS["mobilenet_v2"], batch_size=8), maxbatch_resolution=0.5,
                 maxbatch_limit=64, compile_tries=1)


class Runner:
    """Runs jobs one at a time in fresh processes, prints a progress line per job, never raises.

    With ``replay`` (the job log of an earlier run), results come from the log instead: the same selection
    logic then rebuilds the same tables without measuring anything.
    """

    def __init__(self, settings: Settings, progress: Progress, replay: list[dict[str, Any]] | None = None,
                 measure_missing: bool = False) -> None:
        self.settings = settings
        self.progress = progress
        self.log: list[dict[str, Any]] = []
        self.measured = 0
        self._cache: dict[str, JobResult] = {}
        self._replay = {job_key(e["job"]): e for e in replay or []}
        self._measure = replay is None or measure_missing

    def __call__(self, job: Job, label: str) -> JobResult:
        key = job_key(job)
        if key in self._cache:
            return self._cache[key]
        t0 = time.perf_counter()
        logged = self._replay.get(key)
        if logged is not None:
            r, wall = JobResult(**logged["result"]), float(logged.get("wall_s", 0.0))
        elif not self._measure:
            r, wall = JobResult(error="not in the replayed log", error_type="NotMeasured"), 0.0
        else:
            try:
                r = run_isolated(job, timeout_s=self.settings.job_timeout_s)
            except Exception as e:  # noqa: BLE001 - a crashed job is a table entry, never the end of the run
                r = JobResult(error=str(e)[-500:], error_type=type(e).__name__)
            wall = time.perf_counter() - t0
            self.measured += 1
        if r.ok:
            what = f"peak {mib(r.peak_bytes)} MiB, step {secs(r.step_time_s)} s"
        elif r.error_type == "BudgetError":
            what = f"BudgetError, min {mib(r.min_feasible_bytes)} MiB (peak {mib(r.peak_bytes)} MiB)"
        else:
            what = f"FAILED {r.error_type}: {(r.error or '').strip().splitlines()[-1:] or ''}"
        self.progress(f"{job.model} | {label} | {what} ({wall:.0f} s{', from the log' if logged else ''})")
        self._cache[key] = r
        self.log.append({"label": label, "job": asdict(job), "result": asdict(r), "wall_s": wall})
        return r


def count_stages(spec: ModelSpec) -> int:
    """Number of stages edgetrain's capture cuts the model into (what checkpoint_sequential runs over)."""
    import torch

    from edgetrain.capture import capture
    from edgetrain.models import get_model

    torch.manual_seed(0)
    return len(capture(get_model(spec.name, **spec.kwargs), torch.randn(2, *spec.input_shape), carry_cuts=False).stages)


def _job(spec: ModelSpec, s: Settings, **kw: Any) -> Job:
    return Job(model=spec.name, input_shape=spec.input_shape, batch_size=kw.pop("batch_size", spec.batch_size),
               model_kwargs=spec.kwargs, steps=kw.pop("steps", s.steps), threads=s.threads, **kw)


def bench_model(spec: ModelSpec, s: Settings, run: Runner) -> ModelReport:
    """Measure one model at every budget (see the module docstring)."""
    B = spec.batch_size
    n = count_stages(spec)
    segs = segment_candidates(n, s.quick_segments)
    run.progress(f"{spec.name}: input {spec.input_shape}, batch {B}, {n} stages, segments tried {segs}")
    plain = run(_job(spec, s, mode="plain", env=SYSTEM_ALLOC), f"plain b={B}")
    rep = ModelReport(spec, n, segs, plain)
    if not plain.ok:
        rep.error = f"plain PyTorch failed at batch {B}: {plain.error}"
        return rep
    rep.plain_mmap = run(_job(spec, s, mode="plain", env={"EDGETRAIN_ALLOCATOR": "tuned"}),  # threshold, no pool
                         f"plain+mmap b={B}")
    rep.budgets = [(f, int(f * plain.peak_bytes)) for f in s.budgets]

    plain_by_mb = {B: plain}  # each micro-batch measured once, reused at every budget
    for _, budget in rep.budgets:
        for m in micro_batch_candidates(B)[1:]:
            if largest_fitting(plain_by_mb, budget) is not None or \
                    hopeless([plain_by_mb[k].peak_bytes for k in sorted(plain_by_mb, reverse=True)
                              if plain_by_mb[k].ok], budget):
                break
            if m not in plain_by_mb:
                plain_by_mb[m] = run(_job(spec, s, mode="plain", micro_batch_size=m, env=SYSTEM_ALLOC),
                                     f"plain mb={m}")

    def ck_measure(m: int, seg: int, seed: int, label: str) -> JobResult:
        return run(_job(spec, s, mode="checkpoint_sequential", segments=seg, env=SYSTEM_ALLOC,
                        micro_batch_size=None if m == B else m, seed=seed), label)

    peer = CheckpointPeer(B, segs, ck_measure)
    ck_best: dict[float, tuple[int, int]] = {}
    for frac, budget in rep.budgets:
        # plain: the largest micro-batch that fits
        m = largest_fitting(plain_by_mb, budget)
        e = Entry("plain", budget, B)
        if m is None:
            ran = min((k for k, r in plain_by_mb.items() if r.ok), default=B)
            e.note = f"nothing fits (mb={ran}: {mib(plain_by_mb[ran].peak_bytes)} MiB)"
        else:
            e.result, e.config = plain_by_mb[m], f"mb={m}" + (f" x{math.ceil(B / m)} accum" if m < B else "")
        rep.entries[(frac, "plain")] = e

        e, best = peer.entry(budget)
        if best is not None:
            ck_best[frac] = best
        rep.entries[(frac, "checkpoint_sequential")] = e

        # edgetrain: one prepare() at the budget; for a BatchNorm model also one allowed to micro-batch it,
        # which is what plain's and checkpoint_sequential's gradient accumulation do to BatchNorm
        r = run(_job(spec, s, mode="edgetrain", budget=budget, env=NO_CACHE), f"edgetrain budget {frac:.0%}")
        rep.entries[(frac, "edgetrain")] = edgetrain_entry(r, budget, B, n)
        if spec.batchnorm:
            r = run(_job(spec, s, mode="edgetrain", budget=budget, env=NO_CACHE, exact_batchnorm=False),
                    f"{EDGE_MBN} budget {frac:.0%}")
            rep.entries[(frac, EDGE_MBN)] = edgetrain_entry(r, budget, B, n, EDGE_MBN)
        if len(spec.input_shape) == 3:  # images: the layout can change the kernels (a convolutional model)
            r = run(_job(spec, s, mode="edgetrain", budget=budget, env=NO_CACHE, layout="auto"),
                    f"{EDGE_LAYOUT} budget {frac:.0%}")
            rep.entries[(frac, EDGE_LAYOUT)] = edgetrain_entry(r, budget, B, n, EDGE_LAYOUT)
        if s.compile:  # compiled where the plan keeps everything and a compiled trial fits; eager (and why) elsewhere
            r = run(_job(spec, s, mode="edgetrain", budget=budget, env=NO_CACHE, compile=True),
                    f"{EDGE_COMPILED} budget {frac:.0%}")
            rep.entries[(frac, EDGE_COMPILED)] = edgetrain_entry(r, budget, B, n, EDGE_COMPILED)

    if s.compile:
        ratios = bench_compile(spec, s, run, rep)
        for i in range(s.versus_repeats):  # torch.compile and compile=True in turn where both fit, as above
            for frac, budget in rep.budgets:
                ce, ee = rep.entries[(frac, COMPILE)], rep.entries.get((frac, EDGE_COMPILED))
                if not ce.fits or ee is None or not ee.fits:
                    continue
                ratio = ratios[frac]
                ce.repeats.append(run(_job(spec, s, mode="compile", activation_memory_budget=ratio,
                                           env=SYSTEM_ALLOC, seed=101 + i),
                                      f"torch.compile activation_memory_budget={ratio:g} (versus repeat {i + 1})"))
                ee.repeats.append(run(_job(spec, s, mode="edgetrain", budget=budget, env=NO_CACHE, compile=True,
                                           seed=101 + i), f"{EDGE_COMPILED} budget {frac:.0%} (versus repeat {i + 1})"))

    edge_methods = ("edgetrain",) + ((EDGE_MBN,) if spec.batchnorm else ()) + (
        (EDGE_LAYOUT,) if len(spec.input_shape) == 3 else ())
    for i in range(s.versus_repeats):  # each comparison again, in turn, so that load drift hits both alike
        for frac, budget in rep.budgets:
            ck_e = rep.entries[(frac, "checkpoint_sequential")]
            ets = [m for m in edge_methods if rep.entries[(frac, m)].fits]
            if not ck_e.fits or not ets:
                continue
            ck_e.repeats.append(peer.repeat(ck_best[frac], i))
            for meth in ets:
                rep.entries[(frac, meth)].repeats.append(run(
                    _job(spec, s, mode="edgetrain", budget=budget, env=NO_CACHE, seed=101 + i, **EDGE_OPTIONS[meth]),
                    f"{meth} budget {frac:.0%} (versus repeat {i + 1})"))

    for frac, _ in rep.budgets:  # a peer over the budget in a repeat gives way (CheckpointPeer.hold)
        if frac in ck_best:
            peer.hold(rep.entries[(frac, "checkpoint_sequential")], ck_best[frac], s.versus_repeats)

    if CLAIM_FRACTION in s.budgets:
        budget = dict(rep.budgets)[CLAIM_FRACTION]
        claim = Claim(budget, [plain.step_time_s], [rep.entries[(CLAIM_FRACTION, "edgetrain")].result])
        for i in range(s.repeats):  # interleaved, so that load drift on a shared machine hits both alike
            p = run(_job(spec, s, mode="plain", env=SYSTEM_ALLOC, seed=1 + i), f"plain b={B} (repeat {i + 1})")
            if p.ok:
                claim.plain_times_s.append(p.step_time_s)
            claim.edgetrain.append(run(_job(spec, s, mode="edgetrain", budget=budget, env=NO_CACHE, seed=1 + i),
                                       f"edgetrain budget 50% (repeat {i + 1})"))
        rep.claim = claim
        if spec.batchnorm:
            mbn = Claim(budget, claim.plain_times_s, [rep.entries[(CLAIM_FRACTION, EDGE_MBN)].result])
            for i in range(s.repeats):
                mbn.edgetrain.append(run(_job(spec, s, mode="edgetrain", budget=budget, env=NO_CACHE, seed=1 + i,
                                              exact_batchnorm=False), f"{EDGE_MBN} budget 50% (repeat {i + 1})"))
            rep.claim_mbn = mbn
    return rep


def bench_compile(spec: ModelSpec, s: Settings, run: Runner, rep: ModelReport) -> dict[float, float]:
    """torch.compile with ``activation_memory_budget`` at each budget: the largest measured ratio that fits.

    Ratios 1 (its default) and 0 (recompute all it can) first, then up to ``compile_tries`` more per budget
    from :func:`compile_next_ratio`; every ratio is measured once and reused at every budget. Returns the ratio
    taken at each budget fraction where one fits.
    """
    B, runs = spec.batch_size, rep.compile_runs
    taken: dict[float, float] = {}

    def measure(r: float) -> JobResult:
        if r not in runs:
            runs[r] = run(_job(spec, s, mode="compile", activation_memory_budget=r, env=SYSTEM_ALLOC),
                          f"torch.compile activation_memory_budget={r:g}")
        return runs[r]

    measure(1.0)
    measure(0.0)
    for frac, budget in rep.budgets:
        for _ in range(s.compile_tries):
            r = compile_next_ratio(runs, budget)
            if r is None:
                break
            measure(r)
        best = compile_best(runs, budget)
        e = Entry(COMPILE, budget, B)
        over = ", ".join(f"{r:g}: {mib(x.peak_bytes)}" for r, x in sorted(runs.items(), reverse=True)
                         if x.ok and x.peak_bytes > budget and (best is None or r > best))
        if best is None:
            failed = next((x for x in runs.values() if not x.ok), None)
            e.note = (f"nothing fits (over budget at ratio {over} MiB)" if over else
                      f"failed: {failed.error_type if failed else '?'}")
        else:
            e.result = runs[best]
            e.config = f"ratio={best:g}" + (f" (over at {over} MiB)" if over else "")
            taken[frac] = best
        rep.entries[(frac, COMPILE)] = e
    return taken


def bench_maxbatch(s: Settings, run: Runner, reports: Sequence[ModelReport]) -> MaxBatchReport:
    """Largest batch trained without micro-batching inside plain's peak at the reference batch."""
    spec = s.maxbatch
    ref = next((r.plain for r in reports if r.spec == spec and r.plain.ok), None)
    if ref is None:
        ref = run(_job(spec, s, mode="plain", env=SYSTEM_ALLOC), f"plain b={spec.batch_size} (max-batch budget)")
    rep = MaxBatchReport(spec, ref.peak_bytes)
    if not ref.ok:
        return rep
    rep.plain_runs[spec.batch_size] = ref  # fits by construction: the budget is its peak

    def plain_fit(b: int) -> bool:
        if b not in rep.plain_runs:
            rep.plain_runs[b] = run(_job(spec, s, mode="plain", batch_size=b, steps=s.maxbatch_steps,
                                         env=SYSTEM_ALLOC), f"max-batch plain b={b}")
        return fits(rep.plain_runs[b], rep.budget_bytes)

    def et_fit(b: int) -> bool:
        if b not in rep.edgetrain_runs:
            rep.edgetrain_runs[b] = run(_job(spec, s, mode="edgetrain", batch_size=b, steps=s.maxbatch_steps,
                                             budget=rep.budget_bytes, micro_batch_size=b, env=NO_CACHE),
                                        f"max-batch edgetrain b={b} mb={b}")
        return fits(rep.edgetrain_runs[b], rep.budget_bytes)

    rep.plain = max_batch_search(plain_fit, spec.batch_size, s.maxbatch_resolution, s.maxbatch_limit)
    rep.edgetrain = max_batch_search(et_fit, max(1, rep.plain[0]), s.maxbatch_resolution, s.maxbatch_limit)
    return rep


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke-sized run (small inputs and batches, budgets 50%% and 100%%)")
    p.add_argument("--models", default=",".join(FULL_MODELS), help="comma-separated subset of "
                   f"{','.join(FULL_MODELS)}")
    p.add_argument("--batch-mult", type=int, default=1, help="multiply every model's batch (budget section)")
    p.add_argument("--budgets", default=None, help="comma-separated fractions of P, e.g. 0.2,0.5,1")
    p.add_argument("--sections", default="budgets,maxbatch,solve", help="budgets, maxbatch and/or solve "
                   "(DP solve time on 100+-stage chains with the selective space)")
    p.add_argument("--solve-chains", default="", help="with the solve section: comma-separated CostChain JSON "
                   "files (e.g. from edgetrain profile), tiled to 100+ stages beside the synthetic chains")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per job (first is warm-up)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved re-measurements for the 50%% claim")
    p.add_argument("--versus-repeats", type=int, default=None,
                   help="re-measurements of checkpoint_sequential and edgetrain (and of torch.compile and "
                   "compile=True), in turn, at each budget where both fit")
    p.add_argument("--threads", type=int, default=0, help="torch threads per job (0: torch's default)")
    p.add_argument("--skip-compile", action="store_true", help="leave out torch.compile with "
                   "activation_memory_budget (each ratio compiles in a fresh process: ~1-3 min a job on a CPU)")
    p.add_argument("--compile-tries", type=int, default=None,
                   help="torch.compile ratios measured per budget beyond 1 and 0 (default 2; 1 with --quick)")
    p.add_argument("--out", default=None, help="write the report as markdown here")
    p.add_argument("--json", default=None, help="write every job and its raw result here")
    p.add_argument("--note", default="", help="a line added to the report (e.g. 'machine shared')")
    p.add_argument("--replay", default=None, help="rebuild the tables from a --json log of an earlier run "
                   "(same flags as that run); jobs the log lacks are not run unless --measure-missing")
    p.add_argument("--measure-missing", action="store_true", help="with --replay: run the jobs the log lacks")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    s, models = (QUICK, QUICK_MODELS) if args.quick else (Settings(), FULL_MODELS)
    if args.budgets:
        s = replace(s, budgets=tuple(sorted(float(x) for x in args.budgets.split(","))))
    if args.steps is not None:
        s = replace(s, steps=args.steps)
    if args.repeats is not None:
        s = replace(s, repeats=args.repeats)
    if args.versus_repeats is not None:
        s = replace(s, versus_repeats=args.versus_repeats)
    s = replace(s, threads=args.threads, compile=not args.skip_compile)
    if args.compile_tries is not None:
        s = replace(s, compile_tries=args.compile_tries)
    if args.batch_mult != 1:
        models = {k: replace(v, batch_size=v.batch_size * args.batch_mult) for k, v in models.items()}
    names = [x.strip() for x in args.models.split(",") if x.strip()]
    unknown = [x for x in names if x not in models]
    if unknown:
        print(f"unknown model(s) {unknown}; choose from {list(models)}", file=sys.stderr)
        return 2
    sections = set(args.sections.split(","))
    progress = Progress()
    info = machine_info()
    meta = [("command", " ".join(["python", "bench/bench_budget.py", *(sys.argv[1:] if argv is None else argv)])),
            ("date", time.strftime("%Y-%m-%d %H:%M %Z")),
            ("machine", f"{info['nproc']} CPUs, {info['cpu']}, {info.get('memory', '?')} RAM, {info['os']}"),
            ("torch", info["torch"]), ("load average at start", info["loadavg (1/5/15 min)"]),
            ("settings", (f"budgets {', '.join(f'{b:.0%}' for b in s.budgets)} of P; {s.steps} steps per job "
                          f"(median of all but the first); {s.repeats} interleaved repeat(s) for the 50% claim"))]
    replay = None
    if args.replay:
        logged = json.loads(Path(args.replay).read_text())
        replay = logged["jobs"] if isinstance(logged, dict) else logged
        if isinstance(logged, dict) and logged.get("meta"):
            meta = [tuple(m) for m in logged["meta"] if m[0] not in ("load average at end", "wall time")]
        meta.append(("replayed", f"tables rebuilt from {args.replay} at {time.strftime('%Y-%m-%d %H:%M %Z')}"))
        if not any(e["job"].get("mode") == "compile" for e in replay):  # a log from before torch.compile ran
            s = replace(s, compile=False)
    if args.note:
        meta.append(("note", args.note))
    print(render("edgetrain bench: training under memory budgets (issue 2)", meta, [], False), flush=True)
    run = Runner(s, progress, replay, args.measure_missing)
    reports: list[ModelReport] = []
    if "budgets" in sections:
        for name in names:
            reports.append(bench_model(models[name], s, run))
            r = reports[-1]
            print("\n" + (r.error or "\n\n".join([budget_table(r).to_text(), *versus_lines(r),
                                                   plans_table(r).to_text()]
                                                  + ([compile_table(r).to_text()] if r.compile_runs else [])))
                  + "\n", flush=True)
    maxb = None
    if "maxbatch" in sections and s.maxbatch.name in names:
        maxb = bench_maxbatch(s, run, reports)
    solve_lines: list[str] = []
    if "solve" in sections:
        from _solve_report import solve_rows, solve_table_lines, synthetic_chain, tiled_chain

        from edgetrain.graph import CostChain

        chains = [synthetic_chain(100), synthetic_chain(200, seed=1)]
        chains += [tiled_chain(CostChain.from_json(Path(f).read_text()))
                   for f in args.solve_chains.split(",") if f.strip()]
        solve_lines = solve_table_lines(solve_rows(chains))
        print("\n" + "\n".join(solve_lines), flush=True)
    if replay is None:
        meta += [("load average at end", machine_info()["loadavg (1/5/15 min)"]),
                 ("wall time", f"{progress.elapsed_s() / 60:.1f} min, {len(run.log)} jobs")]
    else:
        meta += [(k, v) for k, v in (logged.get("meta", []) if isinstance(logged, dict) else [])
                 if k in ("load average at end", "wall time")]
        if run.measured:
            load = machine_info()["loadavg (1/5/15 min)"]
            meta.append(("measured now", f"{run.measured} job(s) the log lacked, at load average {load} "
                                         f"({progress.elapsed_s() / 60:.1f} min)"))
    if args.json:  # first, so that the raw measurements survive any error below
        Path(args.json).write_text(json.dumps({"meta": meta, "jobs": run.log}, indent=1))
        print(f"wrote {args.json}")
    print("\n" + build_report(reports, maxb, meta, markdown=False))
    if args.out:
        Path(args.out).write_text(build_report(reports, maxb, meta, markdown=True)
                                  + ("\n\n" + "\n".join(solve_lines) + "\n" if solve_lines else ""))
        print(f"wrote {args.out}")
    print(f"total wall time {progress.elapsed_s() / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
