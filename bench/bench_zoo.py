"""Models users bring (edgetrain.models.zoo): capture, exactness, memory against plain PyTorch, the named minimum.

Per model, in one run, each figure from fresh processes:
  stages      stages captured and how (fx graph, module-tree blocks)
  exact       largest relative parameter/buffer difference against plain PyTorch (edgetrain.verify), full
              batch with every stage recomputed, and micro-batches of 4 against plain accumulation
  same/plain  peak memory with plain PyTorch's schedule (full batch, nothing recomputed, no budget) over
              plain PyTorch's own peak: medians of --repeats fresh processes each, run interleaved (one
              process's peak moves by +-0.25 MiB from run to run: shared-library pages faulted around, heap
              placement), with the spread of plain's readings beside them
  minimum     the smallest budget a BudgetError names, whether a fresh process trains at it, whether 10%
              below it is refused, and the floor it is compared with: parameters + gradients + optimizer state
              + batch + the largest single stage's working set at micro-batch 1
  prepare     seconds prepare took to refuse a budget (the named minimum) and to plan at it

    python bench/bench_zoo.py [--models bert,gpt2] [--batch 8] [--threads 1] [--repeats 5]
    python bench/bench_zoo.py --models more     # 26 further Hugging Face architectures (models/zoo_more.py)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

STEPS = 3


def _peak_above_baseline() -> int:
    import edgetrain
    return edgetrain.profile.memory.process_peak_rss_bytes() - edgetrain.profile.memory.baseline_rss_bytes()


def _setup(name: str, batch: int) -> tuple[Any, Any, Any, Any, Any]:
    import logging
    import warnings

    import torch

    import edgetrain  # noqa: F401  (the baseline is recorded at import)
    from edgetrain.models.zoo import ZOO
    from edgetrain.models.zoo_more import MORE

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    case = {**ZOO, **MORE}[name]
    model = case.build()
    x, y = case.example(batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    edgetrain.profile.memory.record_baseline()  # the model, batch and optimizer are in the budget, not the zero point
    return case, model, x, y, opt


def _bytes(ts: Any) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def worker(name: str, mode: str, batch: int, budget: int | None) -> dict[str, Any]:
    """One measurement in this (fresh) process."""
    import torch

    import edgetrain
    from edgetrain.capture import bind_inputs

    case, model, x, y, opt = _setup(name, batch)
    out: dict[str, Any] = {}
    if mode == "plain":
        env = bind_inputs(model, x)
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            case.loss_fn(model(**env), y).backward()
            opt.step()
        out["peak"] = _peak_above_baseline()
        return out
    if mode == "exact":
        for key, kw in (("recompute", {"solver": "recompute_all"}), ("micro4", {"micro_batch_size": 4})):
            try:
                r = edgetrain.verify(model, opt, case.loss_fn, (x, y), **kw)
                out[key] = max(r.parameters.relative, r.buffers.relative)
                out["stages"] = r.stages
            except edgetrain.InputError as e:
                out[key] = f"refused: {str(e)[:60]}"
        return out
    t0 = time.perf_counter()
    try:
        step = edgetrain.prepare(model, opt, case.loss_fn, example=(x, y), memory_budget=budget,
                                 solver="dp" if budget is not None else "no_saving")
    except edgetrain.BudgetError as e:
        return {"refused": True, "min": e.min_feasible_bytes, "prepare_s": time.perf_counter() - t0}
    out["prepare_s"] = time.perf_counter() - t0
    for _ in range(STEPS):
        step(x, y)
    out["peak"] = _peak_above_baseline()
    # read after the peak: without a budget a plan that recomputes nothing captures no chain in this
    # process until it is asked for
    out["method"] = step.chain.method
    out["stages"] = len(step.chain)
    out["refused"] = False
    if mode == "same":
        costs = step.costs
        params = [p for p in model.parameters() if p.requires_grad]
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        stage = max(s.saved_bytes.at(1) + s.out_bytes.at(1) + s.workspace_bytes.at(1) +
                    (costs.stages[i - 1].out_bytes.at(1) if i else 0) for i, s in enumerate(costs.stages))
        batch_bytes = _bytes(t for t in (list(x.values()) if isinstance(x, dict) else [x]) + [y])
        out["floor"] = int(2 * _bytes(params) + _bytes(state) + batch_bytes + stage + costs.input_bytes.at(1))
    return out


def _run(name: str, mode: str, batch: int, budget: int | None, threads: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", name, mode, str(batch), str(budget or 0)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "EDGETRAIN_NO_CACHE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:100]}
    return json.loads(lines[-1])


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose peak is the median of those that measured one (the lower middle one of an even count);
    the first run's answer when none did (its error is then what the table shows)."""
    ok = sorted((r for r in runs if r.get("peak")), key=lambda r: r["peak"])
    return ok[(len(ok) - 1) // 2] if ok else runs[0]


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="", help="comma-separated zoo names (default: the zoo's); 'more': the "
                    "further Hugging Face architectures of edgetrain.models.zoo_more")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="fresh processes per peak of plain and same (median)")
    ap.add_argument("--worker", nargs=4, metavar=("NAME", "MODE", "BATCH", "BUDGET"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        import torch
        name, mode, batch, budget = args.worker
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        print(json.dumps(worker(name, mode, int(batch), int(budget) or None)))
        return 0
    from edgetrain.models.zoo import zoo_names
    from edgetrain.models.zoo_more import MORE
    names = [m for n in args.models.split(",") if n for m in (list(MORE) if n == "more" else [n])] or zoo_names()
    print(f"bench_zoo: batch {args.batch}, {args.threads} thread(s), {STEPS} steps, AdamW; peaks in MiB above "
          f"the import baseline (model, batch and optimizer included); plain and same: medians of {args.repeats} "
          "fresh processes each, interleaved; spread: plain's largest minus smallest reading")
    header = ("model", "method", "stages", "exact rec", "exact mb4", "plain", "spread", "same", "same/plain", "minimum",
              "floor", "min/floor", "at min", "at 0.9 min", "refuse s", "plan s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in names:
        plains, sames = [], []
        for _ in range(max(1, args.repeats)):  # interleaved, so that a busy spell of the machine hits both
            plains.append(_run(name, "plain", args.batch, None, args.threads))
            sames.append(_run(name, "same", args.batch, None, args.threads))
        plain, same = _median_run(plains), _median_run(sames)
        plain_peaks = [r["peak"] for r in plains if r.get("peak")]
        exact = _run(name, "exact", args.batch, None, args.threads)
        probe = _run(name, "budget", args.batch, 1 << 20, args.threads)
        least = probe.get("min")
        at_min = _run(name, "budget", args.batch, least, args.threads) if least else {}
        below = _run(name, "budget", args.batch, int(least * 0.9), args.threads) if least else {}

        def fmt(v: Any) -> str:
            return f"{v:.1e}" if isinstance(v, float) else str(v if v is not None else "-")

        ratio = same.get("peak", 0) / plain["peak"] if plain.get("peak") and same.get("peak") else None
        floor = same.get("floor")
        row = (name, same.get("method", same.get("error", "?")), same.get("stages", "-"), fmt(exact.get("recompute")),
               fmt(exact.get("micro4")), _mib(plain.get("peak")),
               _mib(max(plain_peaks) - min(plain_peaks)) if plain_peaks else "-", _mib(same.get("peak")),
               f"{ratio:.3f}" if ratio else "-", _mib(least), _mib(floor),
               f"{least / floor:.2f}" if least and floor else "-",
               ("ok " + _mib(at_min.get("peak"))) if at_min.get("refused") is False else
               ("refused" if at_min.get("refused") else at_min.get("error", "-")),
               "refused" if below.get("refused") else ("trained " + _mib(below.get("peak")) if below else "-"),
               f"{probe.get('prepare_s', 0):.1f}", f"{at_min.get('prepare_s', 0):.1f}")
        print("| " + " | ".join(str(c) for c in row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
