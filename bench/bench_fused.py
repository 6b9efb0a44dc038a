"""Bench: what each way of holding the optimizer state and the gradients costs a step that keeps everything.

Run: ``python bench/bench_fused.py [--models resnet18,mobilenet_v2,transformer] [--optimizers sgd,adam]
[--threads 1] [--rounds 2] [--out FILE.md] [--json FILE.json]``

Per model and optimizer, one fresh process per job (:func:`edgetrain.measure.run_isolated`, profile cache off):
plain PyTorch's step as users run it (glibc's allocator, as in bench_budget.py), then edgetrain at a budget of
twice plain's peak (nothing needs recomputing there) in four ways, forced by ``PlanConfig``: the update after
the backward with the gradients and the state resident (``fused_update=False, page_optimizer_state=False``),
the state paged out during the passes (``page_optimizer_state=True``), the update fused into the backward
(``fused_update=True``), and fused with each parameter's state paged in and out around its update (both
True). The jobs run in ``--rounds`` interleaved rounds (plain, held, paged, fused, fused+paged, plain, ...); a
row reports the lower of its rounds' peaks (VmHWM of the job's process: what the process held before the model
and the batch counts in every row alike) and the median of its step times, and both as ratios to plain's row.

What this shows: the bytes each way takes off a step's peak when every activation is kept. Where a budget
forces recomputation, the planner weighs those bytes against the step time they buy (bench_budget.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    FULL_MODELS, NO_CACHE, SYSTEM_ALLOC, Progress, Table, machine_info, mib, ratio, render, secs,
)

#: (label, PlanConfig.fused_update, PlanConfig.page_optimizer_state); None: plain PyTorch
WAYS: list[tuple[str, Any, Any]] = [
    ("plain PyTorch", None, None),
    ("update after the backward, state resident", False, False),
    ("update after the backward, state paged", False, True),
    ("update fused into the backward", True, False),
    ("update fused, state paged per parameter", True, True),
]


def _job(spec: Any, optimizer: str, way: tuple[str, Any, Any], budget: int | None, steps: int, threads: int) -> Any:
    from edgetrain.measure import Job

    _, fused, paged = way
    if fused is None:
        return Job(spec.name, spec.input_shape, spec.batch_size, mode="plain", model_kwargs=spec.kwargs,
                   optimizer=optimizer, steps=steps, threads=threads, env=SYSTEM_ALLOC)
    return Job(spec.name, spec.input_shape, spec.batch_size, mode="edgetrain", model_kwargs=spec.kwargs,
               budget=budget, optimizer=optimizer, steps=steps, threads=threads, fused_update=fused,
               page_optimizer_state=paged, env=NO_CACHE)


def measure(models: list[str], optimizers: list[str], rounds: int, steps: int, threads: int,
            progress: Progress) -> list[dict[str, Any]]:
    """One record per (model, optimizer, way): peaks and step times of each round, the plan's shape."""
    from edgetrain.measure import run_isolated

    records = []
    for name in models:
        spec = FULL_MODELS[name]
        for optimizer in optimizers:
            found: dict[str, dict[str, Any]] = {w[0]: {"peaks": [], "times": [], "errors": []} for w in WAYS}
            budget = None
            for r in range(rounds):
                for way in WAYS:
                    if way[1] is not None and budget is None:
                        break  # plain PyTorch failed: no budget to give
                    res = run_isolated(_job(spec, optimizer, way, budget, steps, threads), timeout_s=900)
                    rec = found[way[0]]
                    if not res.ok:
                        rec["errors"].append(f"{res.error_type}: {res.error}")
                        progress(f"{name} {optimizer} {way[0]}: {res.error_type}: {str(res.error)[:200]}")
                        continue
                    rec["peaks"].append(res.peak_bytes)
                    rec["times"].append(res.step_time_s)
                    plan = res.plan or {}
                    meta = plan.get("metadata") or {}
                    rec["keep"] = (plan.get("policies") or []).count("keep")
                    rec["stages"] = len(plan.get("policies") or [])
                    rec["fused"] = bool(meta.get("optimizer_update_fused"))
                    rec["paged"] = "optimizer_state_paged_bytes" in meta
                    if way[1] is None and budget is None:
                        budget = 2 * res.peak_bytes  # room for everything kept, whichever way
                    progress(f"{name} {optimizer} round {r + 1}: {way[0]}: peak {mib(res.peak_bytes)} MiB, "
                             f"step {secs(res.step_time_s, 3)} s")
            for label, *_ in WAYS:
                records.append({"model": name, "optimizer": optimizer, "way": label, "budget": budget,
                                **found[label]})
    return records


def table(records: list[dict[str, Any]]) -> Table:
    t = Table("Peak and step time at a budget of twice plain's peak (everything kept), best peak / median time "
              "of the rounds", ["model", "optimizer", "way", "peak MiB", "peak / plain", "step s", "step / plain",
                                "plan"], left=(0, 1, 2, 7))
    base: dict[tuple[str, str], dict[str, Any]] = {}
    for rec in records:
        key = (rec["model"], rec["optimizer"])
        if not rec["peaks"]:
            t.add(rec["model"], rec["optimizer"], rec["way"], "failed", "", "", "", "; ".join(rec["errors"])[:120])
            continue
        peak, step = min(rec["peaks"]), statistics.median(rec["times"])
        if rec["way"] == WAYS[0][0]:
            base[key] = {"peak": peak, "step": step}
            t.add(rec["model"], rec["optimizer"], rec["way"], mib(peak), ratio(1.0), secs(step, 3), ratio(1.0), "")
            continue
        b = base.get(key)
        shape = f"{rec.get('keep', '?')}/{rec.get('stages', '?')} kept" + \
            (", fused" if rec.get("fused") else "") + (", state paged" if rec.get("paged") else "")
        t.add(rec["model"], rec["optimizer"], rec["way"], mib(peak), ratio(peak / b["peak"]) if b else "",
              secs(step, 3), ratio(step / b["step"]) if b else "", shape)
    t.notes.append("peak: VmHWM of the job's fresh process (interpreter, torch and the batch included, in every "
                   "row alike); 'plan': stages kept of the chain and how the plan holds the state, as prepare() "
                   "reported it")
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,mobilenet_v2,transformer",
                    help=f"comma-separated subset of {','.join(FULL_MODELS)}")
    ap.add_argument("--optimizers", default="sgd,adam", help="comma-separated: sgd (momentum 0.9), adam")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every job")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per job (the first is a warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per job (0: torch's default)")
    ap.add_argument("--out", help="write the report as markdown here")
    ap.add_argument("--json", help="write the raw records here")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in FULL_MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(FULL_MODELS)}")
    optimizers = [o for o in args.optimizers.split(",") if o]
    if any(o not in ("sgd", "adam") for o in optimizers):
        ap.error("--optimizers takes sgd and/or adam")
    if args.rounds < 1 or args.steps < 2:
        ap.error("--rounds must be >= 1 and --steps >= 2 (the first step is a warm-up)")
    progress = Progress()
    records = measure(models, optimizers, args.rounds, args.steps, args.threads, progress)
    meta = [(k, v) for k, v in machine_info().items()] + [
        ("jobs", f"{args.rounds} interleaved rounds, {args.steps} steps each (first untimed), "
                 f"{args.threads or 'default'} thread(s)"),
        ("run time", f"{progress.elapsed_s() / 60:.1f} min")]
    sections = [("Ways of holding the optimizer state and the gradients", [table(records)])]
    print(render("edgetrain: the optimizer update fused into the backward", meta, sections, markdown=False))
    if args.out:
        Path(args.out).write_text(render("edgetrain: the optimizer update fused into the backward", meta, sections,
                                         markdown=True))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0 if all(r["peaks"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
