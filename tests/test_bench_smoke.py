"""Smoke tests of bench/bench_budget.py: selection rules, the batch search and the tables, on fake results.

No job runs here (no subprocess); the results are JobResult objects built by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import _common  # noqa: E402
import bench_budget as bb  # noqa: E402

from edgetrain.measure import JobResult  # noqa: E402

MIB = 2**20


def ok(peak_mib: float, step_s: float, plan: dict | None = None) -> JobResult:
    return JobResult(peak_bytes=int(peak_mib * MIB), step_time_s=step_s, plan=plan)


def budget_error(min_mib: float) -> JobResult:
    return JobResult(error="no plan fits", error_type="BudgetError", min_feasible_bytes=int(min_mib * MIB),
                     peak_bytes=5 * MIB)


def plan(mb: int, batch: int, policies: list[str], peak_mib: float, step_s: float) -> dict:
    return {"micro_batch_size": mb, "batch_size": batch, "policies": policies, "peak_bytes": int(peak_mib * MIB),
            "step_time_s": step_s}


def test_candidates() -> None:
    assert bb.micro_batch_candidates(32) == [32, 16, 8, 4, 2, 1]
    assert bb.micro_batch_candidates(6) == [6, 3, 2, 1]
    assert bb.micro_batch_candidates(1) == [1]
    assert bb.segment_candidates(25) == [2, 4, 5, 12]
    assert bb.segment_candidates(16, quick=True) == [2, 4]
    assert bb.segment_candidates(1) == [1]


def test_selection_uses_measured_peaks() -> None:
    by_mb = {32: ok(300, 2.0), 16: ok(180, 2.2), 8: ok(120, 2.6), 4: JobResult(error="boom", error_type="X")}
    assert bb.largest_fitting(by_mb, 300 * MIB) == 32
    assert bb.largest_fitting(by_mb, 299 * MIB) == 16
    assert bb.largest_fitting(by_mb, 119 * MIB) is None  # the failed job never counts as fitting
    configs = {(32, 2): ok(250, 2.5), (32, 5): ok(150, 2.9), (16, 2): ok(140, 2.7)}
    assert bb.fastest_fitting(configs, 260 * MIB) == (32, 2)
    assert bb.fastest_fitting(configs, 200 * MIB) == (16, 2)
    assert bb.fastest_fitting(configs, 100 * MIB) is None


@pytest.mark.parametrize("true_max", [0, 1, 5, 31, 32, 33, 100, 255])
def test_max_batch_search_finds_the_boundary(true_max: int) -> None:
    tried: list[int] = []

    def fit(b: int) -> bool:
        tried.append(b)
        return b <= true_max

    lo, hi = bb.max_batch_search(fit, start=32, resolution=0.0, limit=1024)
    assert lo == true_max and hi == true_max + 1
    assert len(tried) <= 2 * 11


def test_max_batch_search_resolution_and_limit() -> None:
    lo, hi = bb.max_batch_search(lambda b: b <= 200, start=32, resolution=0.25, limit=1024)
    assert lo <= 200 < hi and hi - lo <= max(1, int(lo * 0.25))
    assert bb.max_batch_search(lambda b: True, start=32, resolution=0.1, limit=100) == (64, None)


def fake_report() -> bb.ModelReport:
    spec = bb.ModelSpec("mobilenet_v2", {"num_classes": 10}, (3, 64, 64), 32)
    P = 400 * MIB
    rep = bb.ModelReport(spec, n_stages=25, segments=[2, 4, 5, 12], plain=ok(400, 2.0), plain_mmap=ok(320, 2.1))
    rep.budgets = [(0.2, int(0.2 * P)), (0.5, int(0.5 * P)), (1.0, P)]
    pol = ["recompute"] * 10 + ["keep"] * 15
    rows = {  # budget: (plain, ckpt, edgetrain)
        0.2: (None, None, bb.edgetrain_entry(budget_error(95), int(0.2 * P), 32, 25)),
        0.5: (("mb=8 x4 accum", ok(190, 3.2)), ("seg=5", ok(170, 2.8)),
              bb.edgetrain_entry(ok(180, 2.4, plan(32, 32, pol, 185, 2.3)), int(0.5 * P), 32, 25)),
        1.0: (("mb=32", ok(400, 2.0)), ("seg=2", ok(300, 2.0)),
              bb.edgetrain_entry(ok(390, 2.05, plan(32, 32, ["keep"] * 25, 380, 2.0)), P, 32, 25)),
    }
    for (frac, budget) in rep.budgets:
        p, c, e = rows[frac]
        for method, cell in (("plain", p), ("checkpoint_sequential", c)):
            entry = bb.Entry(method, budget, 32)
            if cell is None:
                entry.note = "nothing fits"
            else:
                entry.config, entry.result = cell
            rep.entries[(frac, method)] = entry
        rep.entries[(frac, "edgetrain")] = e
    rep.claim = bb.Claim(int(0.5 * P), [2.0, 2.2], [rep.entries[(0.5, "edgetrain")].result, ok(180, 2.6)])
    return rep


def test_budget_table_ratios() -> None:
    rep = fake_report()
    text = bb.budget_table(rep).to_text()
    assert "P = 400.0 MiB, T = 2.00 s" in text
    row = next(line for line in text.splitlines() if line.startswith("50%") and "edgetrain" in line)
    # 32 samples / 2.4 s = 13.3/s; vs plain 32/3.2 = 10/s -> 1.33x; vs ckpt 32/2.8 -> 1.17x; time 2.4/2.0 = 1.20x
    for cell in ("13.3", "1.33x", "1.17x", "1.20x", "yes"):
        assert cell in row.split(), (cell, row)
    assert "infeasible, min 95.0 MiB" in text
    md = bb.budget_table(rep).to_markdown()
    table_lines = [x for x in md.splitlines() if x.startswith("|")]
    assert len(table_lines) == 2 + 3 * 3 and all(x.count("|") == 11 for x in table_lines)


def test_versus_and_claim() -> None:
    rep = fake_report()
    line = bb.versus_line(rep)
    assert "50%: 1.17x" in line and "100%: 0.98x" in line and "20%: neither fits" in line
    assert line.endswith("edgetrain higher at every budget: NO (1 of 2 budgets where either fits)")
    c = rep.claim
    assert c.slowdown == pytest.approx(2.5 / 2.1) and c.passed
    text = bb.claims_table([rep]).to_text()
    assert "PASS" in text and "2/2" in text
    c.edgetrain.append(ok(210, 2.5))  # one run over the budget fails the claim
    assert not c.passed
    assert "FAIL" in bb.claims_table([rep]).to_text()


def test_versus_compares_medians_over_the_repeats() -> None:
    rep = fake_report()
    et, ck = rep.entries[(1.0, "edgetrain")], rep.entries[(1.0, "checkpoint_sequential")]
    assert "100%: 0.98x" in bb.versus_line(rep)
    # the table's edgetrain run was the slow one: two repeats put its median under checkpoint_sequential's
    et.repeats += [ok(et.result.peak_bytes / MIB, et.result.step_time_s * 0.8),
                   ok(et.result.peak_bytes / MIB, et.result.step_time_s * 0.9)]
    ck.repeats += [ok(ck.result.peak_bytes / MIB, ck.result.step_time_s * 1.1)]
    assert et.step_time_s == pytest.approx(et.result.step_time_s * 0.9) and et.runs == 3
    assert ck.step_time_s == pytest.approx(ck.result.step_time_s * 1.05) and ck.runs == 2
    x = (et.batch_size / et.step_time_s) / (ck.batch_size / ck.step_time_s)
    assert f"100%: {x:.2f}x" in bb.versus_line(rep) and x > 1
    row = next(line for line in bb.budget_table(rep).to_text().splitlines()
               if line.startswith("100%") and " edgetrain " in line)
    assert "(3)" in row.split()
    # a repeat over the budget marks the row as not fitting, and the versus line says so
    et.repeats.append(ok(10_000, 1.0))
    assert "NO" in next(line for line in bb.budget_table(rep).to_text().splitlines()
                        if line.startswith("100%") and " edgetrain " in line).split()
    assert "(edgetrain over budget in 1 of 4 runs)" in bb.versus_line(rep)


def test_batchnorm_variant_rows_lines_and_claim() -> None:
    rep = fake_report()
    P = 400 * MIB
    for frac, budget in rep.budgets:
        r = ok(0.4 * P / MIB * frac + 20, 2.2) if frac >= 0.5 else budget_error(95)
        rep.entries[(frac, bb.EDGE_MBN)] = bb.Entry(bb.EDGE_MBN, budget, 32, "mb=8, 0/25 recomp", r)
    rep.claim_mbn = bb.Claim(int(0.5 * P), [2.0, 2.2], [rep.entries[(0.5, bb.EDGE_MBN)].result])
    assert rep.methods() == ["plain", "checkpoint_sequential", "edgetrain", bb.EDGE_MBN]
    text = bb.budget_table(rep).to_text()
    assert sum(bb.EDGE_MBN in line for line in text.splitlines()) == 3 + 1  # three rows and the note
    lines = bb.versus_lines(rep)
    assert len(lines) == 2 and lines[1].startswith(f"mobilenet_v2: {bb.EDGE_MBN} vs checkpoint_sequential")
    assert "50%: 1.27x" in lines[1]  # 2.8 / 2.2
    claims = bb.claims_table([rep]).to_text()
    assert "mobilenet_v2, BN per mb" in claims and claims.count("PASS") == 2


def test_plans_and_full_report() -> None:
    rep = fake_report()
    plans = bb.plans_table(rep).to_text()
    assert "10/25" in plans and "185.0" in plans and "0.97x" in plans
    spec = bb.ModelSpec("mobilenet_v2", {}, (3, 64, 64), 32)
    mb = bb.MaxBatchReport(spec, 400 * MIB, plain=(33, 34), edgetrain=(96, 104),
                           plain_runs={33: ok(399, 1.0), 34: ok(405, 1.0)},
                           edgetrain_runs={96: ok(390, 3.0), 104: budget_error(420)})
    t, line = bb.maxbatch_table(mb)
    assert "2.91x" in t.to_text() and "BudgetError (min 420.0 MiB)" in t.to_text()
    assert line.startswith("edgetrain trains 2.91x")
    for markdown in (False, True):
        out = bb.build_report([rep], mb, [("machine", "test")], markdown=markdown)
        assert "Max batch at a fixed budget" in out and "Claims" in out and "Reference" in out
        assert "mmap peak/P" in out and "0.80x" in out  # 320 / 400 MiB


def test_table_alignment_and_errors() -> None:
    t = _common.Table("t", ["name", "value"])
    t.add("a", "1.0")
    t.add("longer", "10.25")
    lines = t.to_text().splitlines()
    assert lines[3].endswith("  1.0") and len(lines[3]) == len(lines[4])
    with pytest.raises(ValueError):
        t.add("x", "y", "z")
    assert _common.mib(3 * MIB) == "3.0" and _common.ratio(None) == "-" and _common.secs(0) == "-"


def test_failed_plain_is_reported_not_raised() -> None:
    spec = bb.ModelSpec("resnet18", {}, (3, 32, 32), 32)
    rep = bb.ModelReport(spec, 23, [2], plain=JobResult(error="crash", error_type="RuntimeError"),
                         error="plain PyTorch failed at batch 32: crash")
    out = bb.build_report([rep], None, [], markdown=False)
    assert "plain PyTorch failed" in out and "failed" in bb.reference_table([rep]).to_text()


def test_hopeless_extrapolates_the_micro_batch_floor() -> None:
    # peaks 300, 250 MiB at m, m/2: the activations of m/2 are ~50 MiB, so nothing goes below ~200 MiB
    # (the rule allows twice that saving for noise: floor 150 MiB)
    assert not bb.hopeless([300 * MIB], 10 * MIB)
    assert not bb.hopeless([300 * MIB, 290 * MIB], 10 * MIB)  # two points never decide
    assert bb.hopeless([300 * MIB, 260 * MIB, 250 * MIB], 169 * MIB)
    assert not bb.hopeless([300 * MIB, 260 * MIB, 250 * MIB], 171 * MIB)
    assert bb.hopeless([300 * MIB, 290 * MIB, 285 * MIB], 264 * MIB)
    assert not bb.hopeless([300 * MIB, 290 * MIB, 285 * MIB], 266 * MIB)
    # one halving that saved little (glibc retention) does not hide the larger saving before it
    assert not bb.hopeless([113 * MIB, 56 * MIB, 54 * MIB], 40 * MIB)


def test_main_replays_a_logged_run(tmp_path: Path) -> None:
    """main() end to end on a hand-made job log: the same selection code rebuilds the tables."""
    s = bb.replace(bb.QUICK, budgets=(1.0,))
    spec = bb.QUICK_MODELS["transformer"]
    pl = {"policies": ["keep"] * 15 + ["recompute"], "micro_batch_size": 16, "batch_size": 16,
          "peak_bytes": 40 * MIB, "step_time_s": 0.5}
    jobs = [(bb._job(spec, s, mode="plain", env=bb.SYSTEM_ALLOC), ok(44, 0.5)),
            (bb._job(spec, s, mode="plain"), ok(38, 0.5)),
            (bb._job(spec, s, mode="checkpoint_sequential", segments=2, env=bb.SYSTEM_ALLOC), ok(40, 0.6)),
            (bb._job(spec, s, mode="checkpoint_sequential", segments=4, env=bb.SYSTEM_ALLOC), ok(36, 0.7)),
            (bb._job(spec, s, mode="edgetrain", budget=44 * MIB, env=bb.NO_CACHE), ok(41, 0.55, pl))]
    log = {"meta": [["date", "then"], ["wall time", "1.0 min, 5 jobs"]],
           "jobs": [{"label": "x", "job": bb.asdict(j), "result": bb.asdict(r), "wall_s": 1.0} for j, r in jobs]}
    src, out, again = tmp_path / "log.json", tmp_path / "out.md", tmp_path / "again.json"
    src.write_text(bb.json.dumps(log))
    argv = ["--quick", "--models", "transformer", "--budgets", "1", "--sections", "budgets", "--replay", str(src),
            "--out", str(out), "--json", str(again)]
    assert bb.main(argv) == 0
    md = out.read_text()
    assert "**date**: then" in md and "**wall time**: 1.0 min, 5 jobs" in md
    row = next(x for x in md.splitlines() if x.startswith("| 100%") and "| edgetrain |" in x)
    assert "mb=16, 1/16 recomp" in row and "| 41.0 | yes | 0.55 |" in row
    assert "seg=2" in md and "100%: 1.09x" in md  # (16/0.55) / (16/0.6): the faster fitting segment count
    assert len(bb.json.loads(again.read_text())["jobs"]) == 5  # nothing was run that the log lacked


def test_budget_error_entry_flags_a_prepare_over_budget() -> None:
    inside = bb.edgetrain_entry(budget_error(95), 90 * MIB, 32, 25)  # the failed prepare peaked at 5 MiB
    assert inside.note == "infeasible, min 95.0 MiB" and not inside.fits
    over = bb.edgetrain_entry(budget_error(95), 4 * MIB, 32, 25)
    assert "prepare peaked at 5.0 MiB, over the budget" in over.note


def test_plain_descends_for_every_budget_not_just_the_lowest() -> None:
    """A budget hopeless for plain (20%) must not stop the search that a larger one (75%) needs."""
    s = bb.replace(bb.QUICK, budgets=(0.2, 0.75))
    spec = bb.QUICK_MODELS["transformer"]  # batch 16
    peaks = {16: 100, 8: 80, 4: 70, 2: 65, 1: 62}
    log = [{"label": f"plain mb={m}", "job": bb.asdict(bb._job(spec, s, mode="plain", env=bb.SYSTEM_ALLOC,
                                                               micro_batch_size=None if m == 16 else m)),
            "result": bb.asdict(ok(p, 1.0))} for m, p in peaks.items()]
    run = bb.Runner(s, _common.Progress(quiet=True), replay=log)
    rep = bb.bench_model(spec, s, run)
    assert rep.entries[(0.75, "plain")].config == "mb=4 x4 accum"
    assert rep.entries[(0.2, "plain")].result is None and "nothing fits" in rep.entries[(0.2, "plain")].note
    asked = {e["job"]["micro_batch_size"] for e in run.log if e["job"]["mode"] == "plain"}
    assert asked == {None, 8, 4}  # 100 -> 80 MiB: nothing below ~40 MiB, so 2 and 1 are never run for 20 MiB
    assert rep.entries[(0.75, "edgetrain")].note.startswith("failed")  # not in the log, and nothing was run


def test_compile_ratio_search_keeps_the_largest_fitting_ratio() -> None:
    runs = {1.0: ok(500, 1.6), 0.0: ok(300, 2.5)}
    assert bb.compile_best(runs, 600 * MIB) == 1.0 and bb.compile_next_ratio(runs, 600 * MIB) is None
    assert bb.compile_best(runs, 299 * MIB) is None
    assert bb.compile_next_ratio(runs, 299 * MIB) == 0.5          # neither end fits: the midpoint, once
    r = bb.compile_next_ratio(runs, 400 * MIB)
    assert r == pytest.approx(0.5)                                  # where the line 0 -> 1 meets the budget
    runs[0.5] = ok(420, 2.0)                                        # over: interpolate between 0 and 0.5
    r = bb.compile_next_ratio(runs, 400 * MIB)
    assert 0.0 < r < 0.5 and r == pytest.approx(0.5 * 100 / 120, abs=1e-3)
    runs[r] = ok(390, 2.2)
    assert bb.compile_best(runs, 400 * MIB) == r
    runs[0.9] = ok(380, 1.7)                                        # not monotone: a larger ratio fits too
    assert bb.compile_best(runs, 400 * MIB) == 0.9
    runs[0.95] = JobResult(error="boom", error_type="X")
    assert bb.compile_best(runs, 450 * MIB) == 0.9                  # a failed run never fits


def test_compile_entries_in_tables_and_versus_lines() -> None:
    rep = fake_report()
    rep.compile_runs = {1.0: ok(450, 1.5), 0.0: ok(300, 2.4)}
    for frac, budget in rep.budgets:
        best = bb.compile_best(rep.compile_runs, budget)
        rep.entries[(frac, bb.COMPILE)] = bb.Entry(bb.COMPILE, budget, 32, f"ratio={best}",
                                                   None if best is None else rep.compile_runs[best])
    assert rep.methods() == ["plain", "checkpoint_sequential", bb.COMPILE, "edgetrain"]
    text = bb.budget_table(rep).to_text()
    assert bb.COMPILE in text
    lines = bb.versus_lines(rep)
    assert len(lines) == 2 and lines[1].startswith(f"mobilenet_v2: edgetrain vs {bb.COMPILE} throughput")
    table = bb.compile_table(rep).to_text()
    assert "450.0" in table and "300.0" in table
    assert bb.COMPILE in bb.build_report([rep], None, [("command", "x")], markdown=True)


def test_bench_fused_rounds_and_table(monkeypatch) -> None:
    """bench_fused.py on fake jobs: plain first in each round, the budget twice plain's first peak, every way
    forced by its PlanConfig keys, the best peak and the median step per row, ratios to plain's row, a failed
    way shown as failed."""
    import bench_fused as bf

    import edgetrain.measure as measure

    seen = []
    peaks = {None: 400, False: 300, True: 250}

    def fake(job, timeout_s=None):
        seen.append(job)
        if job.mode == "plain":
            return ok(400 + len(seen), 1.0)
        if job.fused_update is True and job.page_optimizer_state is False:
            return JobResult(error="boom", error_type="RuntimeError")
        meta = {"optimizer_update_fused": True} if job.fused_update else {}
        if job.page_optimizer_state:
            meta["optimizer_state_paged_bytes"] = 1
        return ok(peaks[job.page_optimizer_state] - (10 if job.fused_update else 0), 0.5 + 0.1 * len(seen) % 2,
                  {"policies": ["keep"] * 4, "metadata": meta})

    monkeypatch.setattr(measure, "run_isolated", fake)
    records = bf.measure(["resnet18"], ["sgd"], 2, 3, 1, _common.Progress(quiet=True))
    assert [j.mode for j in seen[:5]] == ["plain"] + ["edgetrain"] * 4 and len(seen) == 10
    assert all(j.budget == 2 * int(401 * MIB) for j in seen if j.mode == "edgetrain")
    assert [(j.fused_update, j.page_optimizer_state) for j in seen[1:5]] == [(w[1], w[2]) for w in bf.WAYS[1:]]
    t = bf.table(records)
    rows = {r[2]: r for r in t.rows}
    assert rows["plain PyTorch"][3] == "401.0"  # the lower peak of the two rounds
    fp = rows["update fused, state paged per parameter"]
    assert fp[3] == "240.0" and fp[4] == "0.60x" and fp[7] == "4/4 kept, fused, state paged"
    assert rows["update fused into the backward"][3] == "failed" and "boom" in rows["update fused into the backward"][7]
    assert "update fused into the backward" in t.to_markdown()


def test_job_key_tells_a_compiled_edgetrain_job_from_an_eager_one() -> None:
    from edgetrain.measure import Job

    eager = Job(model="resnet18", input_shape=(3, 32, 32), batch_size=8, budget=100)
    compiled = Job(model="resnet18", input_shape=(3, 32, 32), batch_size=8, budget=100, compile=True)
    assert bb.job_key(eager) != bb.job_key(compiled)
    logged = {k: v for k, v in bb.asdict(eager).items() if k != "compile"}  # a log from before the field
    assert bb.job_key(logged) == bb.job_key(eager)


def test_job_key_tells_a_layout_auto_job_from_the_default_one() -> None:
    """The run reuses a job's result by key: without the layout in it, the layout row would repeat the default's."""
    from edgetrain.measure import Job

    given = Job(model="resnet18", input_shape=(3, 32, 32), batch_size=8, budget=100)
    auto = Job(model="resnet18", input_shape=(3, 32, 32), batch_size=8, budget=100, layout="auto")
    assert bb.job_key(given) != bb.job_key(auto)
    logged = {k: v for k, v in bb.asdict(given).items() if k != "layout"}  # a log from before the field
    assert bb.job_key(logged) == bb.job_key(given)
    plan = {"micro_batch_size": 8, "policies": ["keep"] * 4, "metadata": {"layout": "channels_last"}}
    e = bb.edgetrain_entry(JobResult(peak_bytes=1, step_time_s=0.1, plan=plan), 2**30, 8, 4, bb.EDGE_LAYOUT)
    assert e.config == "mb=8, 0/4 recomp, channels-last"


def test_compiled_edgetrain_entry_says_what_compile_did() -> None:
    plan = {"micro_batch_size": 8, "policies": ["keep"] * 4,
            "metadata": {"compiled": True, "eager_peak_bytes": 100 * 2**20}}
    e = bb.edgetrain_entry(JobResult(peak_bytes=1, step_time_s=0.1, plan=plan), 2**30, 8, 4, bb.EDGE_COMPILED)
    assert e.config.endswith("compiled (eager plan 100.0 MiB)")
    plan["metadata"] = {"compiled": False, "not_compiled": "the plan for this budget recomputes or pages 2 of 4"}
    e = bb.edgetrain_entry(JobResult(peak_bytes=1, step_time_s=0.1, plan=plan), 2**30, 8, 4, bb.EDGE_COMPILED)
    assert e.config.endswith("eager: plan recomputes")


def test_compiled_versus_torch_compile_is_interleaved(tmp_path: Path) -> None:
    """With versus repeats, torch.compile (at the ratio it fits with) and compile=True are measured again in turn at
    each budget where both fit, and the versus line compares the medians over the table's run and the repeats."""
    s = bb.replace(bb.QUICK, budgets=(1.0,))
    spec = bb.QUICK_MODELS["transformer"]
    pl = {"policies": ["keep"] * 16, "micro_batch_size": 16, "batch_size": 16, "peak_bytes": 40 * MIB,
          "step_time_s": 0.5}
    et = dict(mode="edgetrain", budget=44 * MIB, env=bb.NO_CACHE)
    jobs = [(bb._job(spec, s, mode="plain", env=bb.SYSTEM_ALLOC), ok(44, 0.5)),
            (bb._job(spec, s, mode="plain"), ok(38, 0.5)),
            (bb._job(spec, s, mode="checkpoint_sequential", segments=2, env=bb.SYSTEM_ALLOC), ok(40, 0.6)),
            (bb._job(spec, s, mode="checkpoint_sequential", segments=4, env=bb.SYSTEM_ALLOC), ok(36, 0.7)),
            (bb._job(spec, s, mode="checkpoint_sequential", segments=2, env=bb.SYSTEM_ALLOC, seed=101), ok(40, 0.6)),
            (bb._job(spec, s, **et), ok(41, 0.55, pl)),
            (bb._job(spec, s, **et, seed=101), ok(41, 0.55, pl)),
            (bb._job(spec, s, **et, compile=True), ok(42, 0.30, pl)),
            (bb._job(spec, s, **et, compile=True, seed=101), ok(42, 0.50, pl)),
            (bb._job(spec, s, mode="compile", activation_memory_budget=1.0, env=bb.SYSTEM_ALLOC), ok(43, 0.45)),
            (bb._job(spec, s, mode="compile", activation_memory_budget=0.0, env=bb.SYSTEM_ALLOC), ok(45, 0.6)),
            (bb._job(spec, s, mode="compile", activation_memory_budget=1.0, env=bb.SYSTEM_ALLOC, seed=101),
             ok(43, 0.35))]
    log = {"meta": [], "jobs": [{"label": "x", "job": bb.asdict(j), "result": bb.asdict(r)} for j, r in jobs]}
    src, out = tmp_path / "log.json", tmp_path / "out.md"
    src.write_text(bb.json.dumps(log))
    assert bb.main(["--quick", "--models", "transformer", "--budgets", "1", "--sections", "budgets", "--replay",
                    str(src), "--versus-repeats", "1", "--out", str(out)]) == 0
    md = out.read_text()
    row = next(x for x in md.splitlines() if x.startswith("| 100%") and "| torch.compile |" in x)
    assert "ratio=1" in row and "| 0.40 (2) |" in row  # median of 0.45 and its repeat's 0.35
    row = next(x for x in md.splitlines() if x.startswith("| 100%") and "| edgetrain (compile=True) |" in x)
    assert "| 0.40 (2) |" in row  # median of 0.30 and 0.50
    assert "edgetrain (compile=True) vs torch.compile throughput -- 100%: 1.00x" in md
    assert "NotMeasured" not in md and "NO |" not in md  # every repeat was in the log


def test_a_checkpoint_sequential_config_over_the_budget_in_a_repeat_gives_way(tmp_path: Path) -> None:
    """The peer is held to what edgetrain is held to: its table run fitted, a repeat went over the budget, so the
    next fastest configuration that fits becomes the row, measured as many times, and a note says why."""
    s = bb.replace(bb.QUICK, budgets=(1.0,))
    spec = bb.QUICK_MODELS["transformer"]
    pl = {"policies": ["keep"] * 16, "micro_batch_size": 16, "batch_size": 16, "peak_bytes": 40 * MIB,
          "step_time_s": 0.5}
    et = dict(mode="edgetrain", budget=44 * MIB, env=bb.NO_CACHE)
    ck = dict(mode="checkpoint_sequential", env=bb.SYSTEM_ALLOC)
    jobs = [(bb._job(spec, s, mode="plain", env=bb.SYSTEM_ALLOC), ok(44, 0.5)),
            (bb._job(spec, s, mode="plain"), ok(38, 0.5)),
            (bb._job(spec, s, **ck, segments=2), ok(43, 0.6)),
            (bb._job(spec, s, **ck, segments=4), ok(36, 0.7)),
            (bb._job(spec, s, **ck, segments=2, seed=101), ok(45, 0.6)),  # over the 44 MiB budget
            (bb._job(spec, s, **ck, segments=4, seed=101), ok(36, 0.9)),
            (bb._job(spec, s, **et), ok(41, 0.55, pl)),
            (bb._job(spec, s, **et, seed=101), ok(41, 0.55, pl))]
    log = {"meta": [], "jobs": [{"label": "x", "job": bb.asdict(j), "result": bb.asdict(r)} for j, r in jobs]}
    src, out = tmp_path / "log.json", tmp_path / "out.md"
    src.write_text(bb.json.dumps(log))
    assert bb.main(["--quick", "--models", "transformer", "--budgets", "1", "--sections", "budgets", "--replay",
                    str(src), "--versus-repeats", "1", "--skip-compile", "--out", str(out)]) == 0
    md = out.read_text()
    row = next(x for x in md.splitlines() if x.startswith("| 100%") and "| checkpoint_sequential |" in x)
    assert "| seg=4 |" in row and "| 0.80 (2) |" in row and "| yes |" in row  # median of 0.7 and 0.9
    assert "seg=2 over the budget in 1 of 2 runs" in md and "next fastest, seg=4" in md
    assert "edgetrain vs checkpoint_sequential throughput -- 100%: 1.45x" in md  # 0.80 / 0.55
    assert "NotMeasured" not in md


def test_bench_draws_rounds_budget_and_table(monkeypatch) -> None:
    """bench_draws.py on fake jobs: plain first in each round, the budget the share of plain's lowest peak
    measured so far, parameter differences against plain's first round, step-time ratios to per-micro-batch's,
    and why a row drew per micro-batch."""
    import torch

    import bench_draws as bd

    seen = []

    def fake(name, mode, budget, steps, threads):
        seen.append((mode, budget))
        shift = {"plain": 0.0, "whole": 1e-4, "per-micro-batch": 1e-2}[mode]
        return {"times": [0.5 if mode == "whole" else 0.4] * 3, "peak": (400 if mode == "plain" else 200) * MIB,
                "micro": 32 if mode == "plain" else 16, "params": {"w": torch.ones(3) + shift},
                "notes": ["... drawn for the whole batch at its first micro-batch ..."] if mode == "whole" else [],
                "why": "because" if mode == "per-micro-batch" else ""}

    monkeypatch.setattr(bd, "_run", fake)
    res = bd.measure("bert", 0.5, 2, 4, 1)
    assert [m for m, _ in seen] == list(bd.MODES) * 2
    assert all(b == int(400 * MIB * 0.5) for m, b in seen if m != "plain")
    rows = res["rows"]
    assert rows["whole"]["whole_masks"] and not rows["per-micro-batch"]["whole_masks"]
    assert rows["whole"]["param_diff"] == pytest.approx(1e-4, rel=0.01) and rows["plain"]["param_diff"] == 0.0
    text = bd.render([res], "x")
    assert "| bert | whole | 16 | whole batch | 0.500 | 1.25x |" in text and "bert, per-micro-batch: because" in text
