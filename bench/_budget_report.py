"""The results of bench/bench_budget.py and the tables it prints (one module: what was measured, how it reads).

Kept apart from the measuring code so that a ``--replay`` of a JSON log and the smoke tests exercise exactly
the tables the bench prints.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from _common import ModelSpec, Table, mib, rate, ratio, render, secs

from edgetrain.measure import JobResult

#: edgetrain allowed to micro-batch BatchNorm (``prepare(exact_batchnorm=False)``), as accumulation does.
EDGE_MBN = "edgetrain (BN per mb)"
#: PyTorch's own planner: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget``.
COMPILE = "torch.compile"
#: edgetrain with ``PlanConfig(compile=True)``: compiled where its plan keeps everything and a measured trial fits
EDGE_COMPILED = "edgetrain (compile=True)"
#: edgetrain with ``PlanConfig(layout="auto")``: a convolutional model's images channels-last where predicted faster
EDGE_LAYOUT = "edgetrain (layout=auto)"
METHODS = ("plain", "checkpoint_sequential", COMPILE, "edgetrain", EDGE_MBN, EDGE_LAYOUT, EDGE_COMPILED)
#: the prepare() options of each edgetrain row
EDGE_OPTIONS: dict[str, dict[str, object]] = {"edgetrain": {}, EDGE_MBN: {"exact_batchnorm": False},
                                              EDGE_LAYOUT: {"layout": "auto"}, EDGE_COMPILED: {"compile": True}}
CLAIM_FRACTION, CLAIM_MAX_SLOWDOWN = 0.5, 1.35
MELON_HEADLINE = 4.33


def fits(r: JobResult | None, budget_bytes: int) -> bool:
    """Whether a job ran and its measured peak is within the budget."""
    return r is not None and r.ok and r.peak_bytes <= budget_bytes


def throughput(r: JobResult | None, batch_size: int) -> float:
    """Samples per second of a measured job (0 when it failed)."""
    return batch_size / r.step_time_s if r is not None and r.ok and r.step_time_s > 0 else 0.0


# --------------------------------------------------------------------------------------------- results
@dataclass
class Entry:
    """One method at one budget: the configuration chosen and what it measured (``result`` None: nothing fit)."""

    method: str
    budget_bytes: int
    batch_size: int
    config: str = ""
    result: JobResult | None = None
    note: str = ""
    repeats: list[JobResult] = field(default_factory=list)  # the same configuration measured again

    @property
    def fits(self) -> bool:
        return fits(self.result, self.budget_bytes)

    @property
    def step_time_s(self) -> float:
        """Median step time over the table's run and its fitting repeats (0 when nothing fit)."""
        if not self.fits:
            return 0.0
        assert self.result is not None
        times = [self.result.step_time_s] + [r.step_time_s for r in self.repeats if fits(r, self.budget_bytes)]
        return statistics.median(times)

    @property
    def runs(self) -> int:
        return 1 + sum(fits(r, self.budget_bytes) for r in self.repeats) if self.fits else 0

    @property
    def over_budget(self) -> int:
        """Runs (the table's and its repeats) that finished above the budget."""
        return sum(r is not None and r.ok and r.peak_bytes > self.budget_bytes for r in [self.result, *self.repeats])

    @property
    def throughput(self) -> float:
        t = self.step_time_s
        return self.batch_size / t if t > 0 else 0.0


@dataclass
class Claim:
    """The 50% check: pooled medians over the table run and the interleaved repeats."""

    budget_bytes: int
    plain_times_s: list[float]
    edgetrain: list[JobResult]

    @property
    def ok_runs(self) -> list[JobResult]:
        return [r for r in self.edgetrain if r.ok]

    @property
    def slowdown(self) -> float | None:
        if not self.ok_runs or not self.plain_times_s:
            return None
        return statistics.median(r.step_time_s for r in self.ok_runs) / statistics.median(self.plain_times_s)

    @property
    def max_peak_bytes(self) -> int | None:
        return max((r.peak_bytes for r in self.edgetrain if r.ok), default=None)

    @property
    def passed(self) -> bool:
        s, peak = self.slowdown, self.max_peak_bytes
        return (s is not None and peak is not None and len(self.ok_runs) == len(self.edgetrain)
                and s <= CLAIM_MAX_SLOWDOWN and peak <= self.budget_bytes)


@dataclass
class ModelReport:
    spec: ModelSpec
    n_stages: int
    segments: list[int]
    plain: JobResult
    plain_mmap: JobResult | None = None
    budgets: list[tuple[float, int]] = field(default_factory=list)
    entries: dict[tuple[float, str], Entry] = field(default_factory=dict)
    claim: Claim | None = None
    claim_mbn: Claim | None = None  # the same claim for edgetrain allowed to micro-batch BatchNorm
    compile_runs: dict[float, JobResult] = field(default_factory=dict)  # torch.compile by memory-budget ratio
    error: str = ""

    def methods(self) -> list[str]:
        return [m for m in METHODS if any((f, m) in self.entries for f, _ in self.budgets)]


@dataclass
class MaxBatchReport:
    spec: ModelSpec
    budget_bytes: int
    plain: tuple[int, int | None] = (0, None)
    edgetrain: tuple[int, int | None] = (0, None)
    plain_runs: dict[int, JobResult] = field(default_factory=dict)
    edgetrain_runs: dict[int, JobResult] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- tables
def _label(spec: ModelSpec) -> str:
    return f"{spec.name} {'x'.join(map(str, spec.input_shape))} batch {spec.batch_size}"


def reference_table(reports: Sequence[ModelReport]) -> Table:
    t = Table("Unconstrained plain PyTorch per model (P = peak, T = step time, system allocator)",
              ["model", "input", "batch", "stages n", "segments tried", "P MiB", "T s", "samples/s",
               "plain+mmap MiB", "plain+mmap s", "mmap peak/P"], left=(0, 1, 4))
    for r in reports:
        mm = r.plain_mmap if r.plain_mmap is not None and r.plain_mmap.ok else None
        t.add(r.spec.name, "x".join(map(str, r.spec.input_shape)), r.spec.batch_size, r.n_stages,
              ",".join(map(str, r.segments)), mib(r.plain.peak_bytes) if r.plain.ok else "failed",
              secs(r.plain.step_time_s), rate(throughput(r.plain, r.spec.batch_size)),
              mib(mm.peak_bytes) if mm else "-", secs(mm.step_time_s) if mm else "-",
              ratio(mm.peak_bytes / r.plain.peak_bytes) if mm and r.plain.peak_bytes else "-")
    t.notes.append("plain+mmap: plain PyTorch with glibc's mmap threshold fixed at 64 KiB (what edgetrain sets at "
                   "import); mmap peak/P shows the allocator's share of plain's peak.")
    return t


def budget_table(rep: ModelReport) -> Table:
    """Per budget and method: config, measured peak, fit, step time, throughput, ratios."""
    t = Table(f"{_label(rep.spec)}: P = {mib(rep.plain.peak_bytes)} MiB, T = {secs(rep.plain.step_time_s)} s",
              ["budget", "method", "config", "peak MiB", "fits", "step s", "samples/s", "time/T", "thr/plain",
               "thr/ckpt"], left=(0, 1, 2, 4))
    T = rep.plain.step_time_s
    for frac, budget in rep.budgets:
        base = {m: rep.entries[(frac, m)].throughput for m in ("plain", "checkpoint_sequential")}
        for m in rep.methods():
            e = rep.entries[(frac, m)]
            r = e.result
            ok = r is not None and r.ok
            rel = [ratio(e.throughput / d) if ok and d else "-" for d in base.values()]
            peak = max([r.peak_bytes] + [x.peak_bytes for x in e.repeats if x.ok]) if ok else 0
            step = e.step_time_s if e.fits else (r.step_time_s if ok else 0.0)
            t.add(f"{frac:.0%} ({mib(budget)} MiB)", m, e.config or e.note, mib(peak) if ok else "-",
                  ("yes" if e.fits and all(fits(x, budget) for x in e.repeats) else "NO") if ok else "-",
                  (secs(step) + (f" ({e.runs})" if e.runs > 1 else "")) if ok else "-",
                  rate(e.throughput), ratio(step / T) if ok and T else "-", *rel)
    t.notes.append("thr/plain and thr/ckpt: throughput over plain's / checkpoint_sequential's at the same budget "
                   "('-' where that one has nothing that fits).")
    for frac, _ in rep.budgets:
        e = rep.entries[(frac, "checkpoint_sequential")]
        if e.note and e.fits:  # a configuration over the budget in a repeat gave way (bench_model)
            t.notes.append(f"checkpoint_sequential at {frac:.0%}: {e.note}; a configuration must fit in every run, "
                           f"as edgetrain's plans must, so the row is the next fastest, {e.config}, measured as "
                           "many times after the interleaved repeats.")
    if any(e.repeats for e in rep.entries.values()):
        t.notes.append("step s (k): median of k runs, the table's run and its interleaved repeats (checkpoint_sequential "
                       "and edgetrain, and torch.compile and edgetrain (compile=True), re-measured in turn at each "
                       "budget where both fit); peak MiB: the largest.")
    if EDGE_COMPILED in rep.methods():
        t.notes.append(f"{EDGE_COMPILED}: prepare(planning=PlanConfig(compile=True)): the step runs as torch.compile "
                       "code where the plan keeps everything and compiled trial steps measured in a fork (compiling "
                       "included) fit the budget, at the faster of two compiler settings; elsewhere it runs the "
                       "eager plan, the config saying why. Its peak is the whole process's, the compiling step's "
                       "included (torch.compile's rows leave that step out).")
    if EDGE_LAYOUT in rep.methods():
        t.notes.append(f"{EDGE_LAYOUT}: prepare(planning=PlanConfig(layout='auto')): each batch's images fed "
                       "channels-last (oneDNN's fast CPU layout; no lean BatchNorm there) where the cost model, "
                       "profiled both ways, predicts a step at least 5% faster inside the budget; values equal "
                       "the NCHW step's up to float rounding. Config 'channels-last' where it took that layout.")
    if EDGE_MBN in rep.methods():
        t.notes.append(f"{EDGE_MBN}: prepare(exact_batchnorm=False), free to micro-batch BatchNorm layers as plain's "
                       "and checkpoint_sequential's gradient accumulation do (each micro-batch normalised with its "
                       "own statistics; running statistics still exact); 'edgetrain' keeps the full batch whenever "
                       "it fits, so its gradients equal one full-batch step.")
    if any("update in backward" in e.config for e in rep.entries.values()):
        t.notes.append("update in backward: the plan updates each parameter inside the backward as soon as its "
                       "gradient is complete and frees it (PlanConfig(fused_update=\"auto\"), the default; the "
                       "same update as one optimizer.step()).")
    return t


def _compiled_note(meta: dict[str, Any]) -> str:
    """What compile=True did: compiled (and the eager plan's peak), or why not, shortened."""
    if meta.get("compiled") is True:
        return f", compiled (eager plan {mib(meta.get('eager_peak_bytes', 0))} MiB)"
    if meta.get("compiled") is False:
        why = meta.get("not_compiled", "")
        if "compiled_peak_bytes" in meta:
            return f", eager: compiled trial {mib(meta['compiled_peak_bytes'])} MiB over budget"
        return ", eager: " + ("plan recomputes" if "recomputes" in why else "BN split" if "BatchNorm" in why
                              else why[:60])
    return ""


def edgetrain_entry(r: JobResult, budget: int, batch_size: int, n_stages: int, method: str = "edgetrain") -> Entry:
    """The table entry of one edgetrain job (a BudgetError is an entry, not a failure of the bench)."""
    e = Entry(method, budget, batch_size, result=r)
    if r.ok and r.plan:
        rec = sum(p == "recompute" for p in r.plan.get("policies", ()))
        sel = sum(p.startswith("selective:") for p in r.plan.get("policies", ()))
        e.config = f"mb={r.plan.get('micro_batch_size')}, {rec}/{len(r.plan.get('policies', ())) or n_stages} recomp" \
            + (f", {sel} selective" if sel else "") \
            + (", update in backward" if "optimizer_update_fused" in r.plan.get("metadata", {}) else "") \
            + _compiled_note(r.plan.get("metadata", {})) \
            + (", channels-last" if r.plan.get("metadata", {}).get("layout") == "channels_last" else "")
    elif r.error_type == "BudgetError":
        e.note = f"infeasible, min {mib(r.min_feasible_bytes)} MiB"
        if r.peak_bytes > budget:  # prepare() must stay inside the budget even when it gives up
            e.note += f"; prepare peaked at {mib(r.peak_bytes)} MiB, over the budget"
    elif not r.ok:
        e.note = f"failed: {r.error_type}"
    return e


def versus_line(rep: ModelReport, method: str = "edgetrain", against: str = "checkpoint_sequential") -> str:
    """Whether edgetrain's throughput beats ``against``'s (checkpoint_sequential's) at every budget, and by how much.

    A budget where only edgetrain fits counts for it, one where only ``against`` fits against it, and one
    where neither fits is left out of the count.
    """
    parts, wins, compared = [], 0, 0
    for frac, _ in rep.budgets:
        et, ck = rep.entries[(frac, method)], rep.entries[(frac, against)]
        if et.fits and ck.fits:
            x = et.throughput / ck.throughput if ck.throughput else math.inf
            over = [f"{name} over budget in {e.over_budget} of {1 + len(e.repeats)} runs"
                    for name, e in ((method, et), (against, ck)) if e.over_budget]
            parts.append(f"{frac:.0%}: {x:.2f}x" + (f" ({', '.join(over)})" if over else ""))
        elif et.fits or ck.fits:
            x = math.inf if et.fits else 0.0
            parts.append(f"{frac:.0%}: {method if et.fits else against} only")
        else:
            parts.append(f"{frac:.0%}: neither fits")
            continue
        compared += 1
        wins += x > 1.0
    verdict = "YES" if compared and wins == compared else "NO"
    return (f"{rep.spec.name}: {method} vs {against} throughput -- {'; '.join(parts)} -- "
            f"{method} higher at every budget: {verdict} ({wins} of {compared} budgets where either fits)")


def versus_lines(rep: ModelReport) -> list[str]:
    """edgetrain (each variant) against checkpoint_sequential, then against torch.compile where it ran."""
    mine = [m for m in rep.methods() if m.startswith("edgetrain")]
    lines = [versus_line(rep, m) for m in mine]
    if COMPILE in rep.methods():
        lines += [versus_line(rep, m, COMPILE) for m in mine]
    return lines


def compile_table(rep: ModelReport) -> Table:
    """Every torch.compile run of the model, by activation_memory_budget ratio."""
    t = Table(f"{_label(rep.spec)}: torch.compile by activation_memory_budget (ratio)",
              ["ratio", "peak MiB", "peak/P", "step s", "time/T", "compile step peak MiB", "resident after compile MiB",
               "compile s"], left=(0,))
    P, T = rep.plain.peak_bytes, rep.plain.step_time_s
    for r in sorted(rep.compile_runs, reverse=True):
        x = rep.compile_runs[r]
        if not x.ok:
            t.add(f"{r:.3g}", f"failed: {x.error_type}")
            continue
        first = x.step_times_s[0] if x.step_times_s else 0.0
        t.add(f"{r:.3g}", mib(x.peak_bytes), ratio(x.peak_bytes / P) if P else "-", secs(x.step_time_s),
              ratio(x.step_time_s / T) if T else "-", mib(x.warmup_peak_bytes), mib(x.warmup_rss_bytes), secs(first, 1))
    t.notes.append("peak: VmHWM over the steps after the first (which compiles), minus the RSS after `import torch, "
                   "edgetrain`; it counts what stays resident after compiling (inductor's modules, generated code) as "
                   "any process running torch.compile holds it. compile s: the first step, compilation included. "
                   "Ratios are chosen per budget: 1 and 0 first, then interpolated on the measured peaks "
                   "(largest fitting ratio kept; the peak is not monotone in the ratio, pytorch#197838).")
    return t


def plans_table(rep: ModelReport) -> Table:
    t = Table(f"{_label(rep.spec)}: edgetrain plans", ["budget", "micro-batch", "recomputed", "pred peak MiB",
              "meas peak MiB", "meas/pred", "pred step s", "meas step s", "meas/pred", "prepare s"], left=(0, 1))
    for frac, budget in rep.budgets:
        e = rep.entries[(frac, "edgetrain")]
        r = e.result
        if r is None or not r.plan:
            t.add(f"{frac:.0%} ({mib(budget)} MiB)", e.note or "-")
            continue
        p = r.plan
        rec = sum(x == "recompute" for x in p["policies"])
        sel = sum(x.startswith("selective:") for x in p["policies"])
        t.add(f"{frac:.0%} ({mib(budget)} MiB)", f"{p['micro_batch_size']} of {p['batch_size']}",
              f"{rec}/{len(p['policies'])}" + (f" (+{sel} selective)" if sel else ""), mib(p["peak_bytes"]), mib(r.peak_bytes),
              ratio(r.peak_bytes / p["peak_bytes"]) if p["peak_bytes"] else "-", secs(p["step_time_s"], 3),
              secs(r.step_time_s, 3), ratio(r.step_time_s / p["step_time_s"]) if p["step_time_s"] else "-",
              secs(r.prepare_time_s, 1))
    return t


def claims_table(reports: Sequence[ModelReport]) -> Table:
    t = Table(f"Claim: at {CLAIM_FRACTION:.0%} of P, edgetrain trains the batch with step <= "
              f"{CLAIM_MAX_SLOWDOWN}x T and measured peak within the budget",
              ["model", "budget MiB", "T s (median)", "edgetrain s (median)", "ratio", "max peak MiB", "runs",
               "verdict"], left=(0, 7))
    for r in reports:
        for c, label in ((r.claim, r.spec.name), (r.claim_mbn, f"{r.spec.name}, BN per mb")):
            if c is None:
                continue
            need = "" if r.spec.name in ("mobilenet_v2", "resnet18") else " (not required by the issue)"
            t.add(label, mib(c.budget_bytes), secs(statistics.median(c.plain_times_s)),
                  secs(statistics.median([x.step_time_s for x in c.ok_runs])) if c.ok_runs else "-",
                  ratio(c.slowdown), mib(c.max_peak_bytes), f"{len(c.ok_runs)}/{len(c.edgetrain)}",
                  ("PASS" if c.passed else "FAIL") + need)
    t.notes.append("Medians pool the table's run with the interleaved repeats (plain, edgetrain, plain, ...); "
                   "the peak is the largest of the edgetrain runs. 'BN per mb': edgetrain allowed to micro-batch "
                   "BatchNorm, as plain's accumulation does; the other rows keep one full-batch BatchNorm.")
    return t


def maxbatch_table(m: MaxBatchReport) -> tuple[Table, str]:
    t = Table(f"Largest batch without micro-batching inside {mib(m.budget_bytes)} MiB "
              f"(= plain's peak at batch {m.spec.batch_size}), {m.spec.name} {'x'.join(map(str, m.spec.input_shape))}",
              ["method", "largest batch", "its peak MiB", "smallest failing", "why it failed", "vs plain"],
              left=(0, 4))
    for name, (lo, hi), runs in (("plain", m.plain, m.plain_runs),
                                 ("edgetrain mb=batch", m.edgetrain, m.edgetrain_runs)):
        r_lo, r_hi = runs.get(lo), runs.get(hi) if hi else None
        why = "-" if r_hi is None else (f"peak {mib(r_hi.peak_bytes)} MiB" if r_hi.ok else
                                        f"BudgetError (min {mib(r_hi.min_feasible_bytes)} MiB)"
                                        if r_hi.error_type == "BudgetError" else f"{r_hi.error_type}")
        t.add(name, lo, mib(r_lo.peak_bytes) if r_lo is not None and r_lo.ok else "-",
              hi if hi else f"none up to {lo}", why, ratio(lo / m.plain[0]) if m.plain[0] else "-")
    x = m.edgetrain[0] / m.plain[0] if m.plain[0] else 0.0
    line = (f"edgetrain trains {x:.2f}x plain's largest batch inside the same budget without micro-batching "
            f"(BatchNorm exact); Melon's headline is {MELON_HEADLINE}x.")
    return t, line


# --------------------------------------------------------------------------------------------- main
def build_report(reports: Sequence[ModelReport], maxb: MaxBatchReport | None, meta: list[tuple[str, str]],
                 markdown: bool) -> str:
    sections: list[tuple[str, list[Table | str]]] = [("Reference", [reference_table(reports)])] if reports else []
    for r in reports:
        items: list[Table | str] = [r.error] if r.error else [budget_table(r), *versus_lines(r), plans_table(r)]
        if r.compile_runs and not r.error:
            items.append(compile_table(r))
        sections.append((_label(r.spec), items))
    if any(r.claim for r in reports):
        sections.append(("Claims", [claims_table(reports)] + [x for r in reports if not r.error
                                                              for x in versus_lines(r)]))
    if maxb is not None:
        t, line = maxbatch_table(maxb)
        sections.append(("Max batch at a fixed budget", [t, line]))
    return render("edgetrain bench: training under memory budgets (issue 2)", meta, sections, markdown)
