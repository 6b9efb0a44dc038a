"""Bench: what drawing the whole batch's dropout masks costs a split step, and what it buys.

Run: ``python bench/bench_draws.py [--models bert,transformer] [--budget 0.6] [--rounds 3] [--steps 8]
[--threads 1] [--out FILE.md] [--json FILE.json]``

Per model, fresh processes in interleaved rounds (plain, whole, per-micro-batch, plain, ...), each training three
steps from the same weights and seeds, then timing ``--steps`` more on one batch:

* **plain**: plain PyTorch, one full-batch step (the reference);
* **whole**: edgetrain at ``--budget`` times plain's peak (the plan splits the batch), dropout masks drawn for
  the whole batch at the first micro-batch (the default, :mod:`edgetrain.capture.draws`);
* **per-micro-batch**: the same plan with ``EDGETRAIN_WHOLE_BATCH_DRAWS=0``: each micro-batch draws its own, as
  gradient accumulation does.

A row gives the median step time (and as a ratio to per-micro-batch's: the masks' cost), the largest peak (VmHWM
over the process's baseline after ``import edgetrain``) against the budget, and after three steps the largest
parameter difference from plain PyTorch's full-batch step: rounding for whole-batch masks, the masks'
difference otherwise. Models: a Hugging Face BERT (4 layers, 256 wide, hidden dropout 0.1, attention dropout 0:
that one runs inside a module the graph calls whole, which the check refuses), and edgetrain's own transformer
(dropout 0.1 on embeddings, attention probabilities and residual branches, all traced).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("plain", "whole", "per-micro-batch")


def _build(name: str) -> tuple[Any, Any, Any]:
    import torch

    torch.manual_seed(0)
    if name == "bert":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import BertConfig, BertForSequenceClassification

        from edgetrain.spec.models import _LogitsOnly

        cfg = BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         intermediate_size=1024, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0,
                         max_position_embeddings=128, attn_implementation="eager")
        return _LogitsOnly(BertForSequenceClassification(cfg).train()), torch.randint(0, 1000, (32, 128)), torch.randint(0, 2, (32,))
    from edgetrain.models import get_model

    model = get_model("transformer", num_classes=4, vocab_size=1000, max_len=128, dropout=0.1)
    return model.train(), torch.randint(0, 1000, (32, 128)), torch.randint(0, 4, (32,))


def job(name: str, mode: str, budget: int | None, steps: int, threads: int, out: str) -> None:
    """One process: three steps from the same start, then ``steps`` timed on one batch; a JSON line to ``out``."""
    import time
    import warnings

    import torch
    import torch.nn.functional as F

    import edgetrain
    from edgetrain.profile import memory

    caught = warnings.catch_warnings(record=True).__enter__()
    warnings.simplefilter("always")
    torch.set_num_threads(threads)
    model, x, y = _build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if mode == "plain":
        def step(xb: Any, yb: Any) -> float:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            return float(loss)
        notes: tuple[str, ...] = ()
        micro, why = len(x), ""
    else:
        step = edgetrain.prepare(model, opt, F.cross_entropy, (x, y), memory_budget=budget)
        notes, micro = step.plan.notes, step.plan.micro_batch_size
        why = next((str(w.message) for w in caught if "random numbers" in str(w.message)), "")
    gen = torch.Generator().manual_seed(1)
    for i in range(3):
        xb, yb = torch.randint(0, 1000, x.shape, generator=gen), torch.randint(0, int(y.max()) + 1, y.shape,
                                                                                generator=gen)
        torch.manual_seed(100 + i)
        step(xb, yb)
    # saved now, not copied: a copy would stay resident through the timed steps and count in the peak
    torch.save({k: v.detach() for k, v in model.named_parameters()}, out + ".pt")
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t)
    peak = memory.process_peak_rss_bytes() - memory.baseline_rss_bytes()
    Path(out).write_text(json.dumps({"times": times[2:], "peak": peak, "micro": micro, "notes": list(notes),
                                     "why": why}))


def _run(name: str, mode: str, budget: int | None, steps: int, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r.json")
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "EDGETRAIN_NO_CACHE": "1"}
        if mode == "per-micro-batch":
            env["EDGETRAIN_WHOLE_BATCH_DRAWS"] = "0"
        subprocess.run([sys.executable, __file__, "--job", name, mode, str(budget or 0), str(steps), str(threads), out],
                       check=True, env=env, cwd=ROOT)
        import torch

        rec = json.loads(Path(out).read_text())
        rec["params"] = torch.load(out + ".pt")
        return rec


def measure(name: str, budget_share: float, rounds: int, steps: int, threads: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    budget = None
    for r in range(rounds):
        for mode in MODES:
            if mode != "plain" and budget is None:
                budget = int(min(p["peak"] for p in runs["plain"]) * budget_share)
            runs[mode].append(_run(name, mode, budget, steps, threads))
            print(f"{name} round {r + 1}/{rounds} {mode}: {statistics.median(runs[mode][-1]['times']):.3f} s",
                  file=sys.stderr, flush=True)
    ref = runs["plain"][0]["params"]
    rows = {}
    for mode, recs in runs.items():
        diff = max(float((recs[0]["params"][k] - v).abs().max()) for k, v in ref.items())
        rows[mode] = {"step_s": statistics.median(t for r in recs for t in r["times"]),
                      "peak": max(r["peak"] for r in recs), "micro": recs[0]["micro"], "param_diff": diff,
                      "whole_masks": any("whole batch" in n for n in recs[0]["notes"]), "why": recs[0]["why"]}
    return {"model": name, "budget": budget, "rows": rows}


def render(results: list[dict[str, Any]], command: str) -> str:
    lines = [f"`{command}`", "", "| model | way | micro-batch | masks | step s | time / per-mb | peak MiB | "
             "budget MiB | max param diff from plain |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for res in results:
        base = res["rows"]["per-micro-batch"]["step_s"]
        for mode, row in res["rows"].items():
            budget = "-" if mode == "plain" else f"{res['budget'] / 2**20:.1f}"
            masks = "-" if mode == "plain" else ("whole batch" if row["whole_masks"] else "per micro-batch")
            lines.append(f"| {res['model']} | {mode} | {row['micro']} | {masks} | {row['step_s']:.3f} | "
                         f"{row['step_s'] / base:.2f}x | {row['peak'] / 2**20:.1f} | {budget} | "
                         f"{row['param_diff']:.1e} |")
    whys = [f"- {res['model']}, {mode}: {row['why']}" for res in results for mode, row in res["rows"].items()
            if row["why"]]
    return "\n".join(lines + ([""] + whys if whys else [])) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        name, mode, budget, steps, threads, out = sys.argv[2:8]
        job(name, mode, int(budget) or None, int(steps), int(threads), out)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert,transformer")
    ap.add_argument("--budget", type=float, default=0.6, help="budget as a share of plain PyTorch's peak")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = [measure(m, args.budget, args.rounds, args.steps, args.threads) for m in args.models.split(",")]
    text = render(results, "python bench/bench_draws.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps([{**r, "rows": r["rows"]} for r in results], indent=1))


if __name__ == "__main__":
    main()
