"""Bench: federated MNIST digits on Flower's Ray simulation engine, edgetrain clients vs HeteroFL width slicing.

Run: ``python bench/bench_fl.py [--rounds 6] [--local-epochs 3] [--clients 8] [--alpha 0.5] [--out FILE]``

Eight clients in four device tiers (``edgetrain.fl.simulation.DEFAULT_TIERS``: rpi4 24 MiB, phone-2024
28 MiB, jetson-nano 34 MiB, jetson-tx2 96 MiB; 4x apart) share the 4,000 training digits (IID, and
Dirichlet(alpha) label skew). Every edgetrain client trains the full CNN (``edgetrain.fl.task.small_cnn``)
exactly, inside its budget; the HeteroFL baseline gives each client the widest width-sliced sub-model whose
plain-PyTorch peak, measured in a fresh process, fits its budget. Both aggregate with
``edgetrain.fl.MaskedFedAvg`` (HeteroFL's element-wise average over the clients holding each element) and are
evaluated centrally on the 1,000 held-out digits after every round. Centralised plain-PyTorch training with
the same passes over the data (rounds x local epochs) is the reference.

1. Fresh-process peaks at batch 64: plain PyTorch per width, and edgetrain (full model) at each tier's budget.
2. Centralised training, same passes.
3. Four federations: edgetrain / HeteroFL x IID / non-IID.

Prints per-round global accuracy, per-client peak against budget (the largest over the rounds, measured in
each client) and wall times. Budgets bound peak resident memory above what the client process holds when a
message arrives (torch, edgetrain and Flower loaded); see ``edgetrain.fl.settings``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 1 << 20

_EDGETRAIN_PEAK = """
import torch, edgetrain
from edgetrain import memory
from edgetrain.fl.task import small_cnn
torch.set_num_threads(1); torch.manual_seed(0)
memory.record_baseline()
m = small_cnn(); opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
x = torch.randn({batch}, 1, 28, 28); y = torch.randint(0, 10, ({batch},))
with memory.measure_peak() as p:
    try:
        step = edgetrain.prepare(m, opt, torch.nn.functional.cross_entropy, example=(x, y), memory_budget="{budget}")
        for _ in range(3):
            step(x, y)
        print("MICRO", step.plan.micro_batch_size)
    except edgetrain.BudgetError:
        print("MICRO", 0)
print("PEAK", p.above_baseline_bytes)
"""


def edgetrain_fresh_peak(budget: str, batch: int) -> tuple[int, int]:
    """(peak bytes, micro-batch size) of prepare + 3 steps of the full CNN at ``budget`` in a fresh process;
    micro-batch 0 when no plan fits."""
    out = subprocess.run([sys.executable, "-c", _EDGETRAIN_PEAK.format(batch=batch, budget=budget)],
                         capture_output=True, text=True, timeout=600)
    res = dict(line.split() for line in out.stdout.splitlines() if line.startswith(("MICRO ", "PEAK ")))
    if len(res) < 2:
        raise RuntimeError(out.stderr[-2000:])
    return int(res["PEAK"]), int(res["MICRO"])


def centralised(passes: int, batch: int, lr: float, seed: int) -> tuple[list[float], float]:
    """Plain PyTorch on all training digits for ``passes`` epochs; test accuracy after each, and wall time."""
    import torch

    from edgetrain.fl.task import client_batches, evaluate_accuracy, load_task, small_cnn

    torch.manual_seed(seed)
    data = load_task(1, "iid", 0.5, seed)
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    accs = []
    t0 = time.perf_counter()
    for epoch in range(passes):
        for x, y in client_batches(data, 0, batch, epoch, seed):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        accs.append(evaluate_accuracy(model, data.test_x, data.test_y)[0])
    return accs, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--local-epochs", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write every number as JSON here")
    args = p.parse_args(argv)
    for k, v in {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                 "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(k, v)
    from edgetrain.fl.baseline_heterofl import WIDTHS, measure_plain_peak
    from edgetrain.fl.simulation import DEFAULT_TIERS, SimulationConfig, run

    t_all = time.perf_counter()
    out: dict = {"args": vars(args), "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print("1. fresh-process peaks at batch", args.batch_size, flush=True)
    plain = {w: measure_plain_peak(w, args.batch_size) for w in WIDTHS}
    for w, b in plain.items():
        print(f"   plain PyTorch, width {w:.2f}: {b / MIB:.1f} MiB", flush=True)
    widths, fresh = [], {}
    for profile, budget in DEFAULT_TIERS:
        limit = int(budget[:-3]) * MIB
        fit = [w for w in sorted(WIDTHS, reverse=True) if plain[w] <= limit]
        widths.append(fit[0] if fit else None)
        fresh[budget] = edgetrain_fresh_peak(budget, args.batch_size)
        print(f"   tier {profile} {budget}: HeteroFL width {widths[-1]}, edgetrain full model "
              f"{fresh[budget][0] / MIB:.1f} MiB (micro-batch {fresh[budget][1]})", flush=True)
    out["plain_peak_bytes"] = {str(w): b for w, b in plain.items()}
    out["heterofl_widths"] = widths
    out["edgetrain_fresh"] = fresh

    passes = args.rounds * args.local_epochs
    print(f"2. centralised, {passes} passes", flush=True)
    central, central_s = centralised(passes, args.batch_size, args.lr, args.seed)
    print(f"   accuracy {central[-1]:.4f} ({central_s:.0f} s)", flush=True)
    out["central"] = {"accuracy": central, "wall_s": central_s}

    base = SimulationConfig(clients=args.clients, rounds=args.rounds, alpha=args.alpha, seed=args.seed,
                            local_epochs=args.local_epochs, batch_size=args.batch_size, lr=args.lr)
    runs = {}
    for mode in ("edgetrain", "heterofl"):
        for part in ("iid", "dirichlet"):
            cfg = replace(base, mode=mode, partition=part, heterofl_widths=tuple(widths))
            print(f"3. {mode} {part}", flush=True)
            rep = run(cfg)
            runs[f"{mode}-{part}"] = rep
            print(f"   accuracy {rep.accuracy.get(args.rounds, float('nan')):.4f} ({rep.wall_s:.0f} s)", flush=True)
    out["runs"] = {k: json.loads(r.to_json()) for k, r in runs.items()}

    print()
    names = list(runs)
    print("| round | " + " | ".join(names) + " | centralised (same passes) |")
    print("|---" * (len(names) + 2) + "|")
    for r in range(args.rounds + 1):
        c = f"{central[r * args.local_epochs - 1]:.4f}" if r else "-"
        print(f"| {r} | " + " | ".join(f"{runs[n].accuracy.get(r, float('nan')):.4f}" for n in names) + f" | {c} |")
    print("| wall s | " + " | ".join(f"{runs[n].wall_s:.0f}" for n in names) + f" | {central_s:.0f} |")
    print()
    print("| client | tier budget | " + " | ".join(f"{n} peak (max over rounds)" for n in names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for cid in range(args.clients):
        profile, budget = DEFAULT_TIERS[cid % len(DEFAULT_TIERS)]
        cells = []
        for n in names:
            rows = [c for r in runs[n].rounds for c in r["clients"] if c["partition-id"] == cid]
            fails = sum(1 for r in runs[n].rounds for f in r["failures"])
            if not rows:
                cells.append("failed")
                continue
            peak = max(c["peak-bytes"] for c in rows)
            ok = all(c["within-budget"] for c in rows)
            tag = f" w{rows[0]['width']:.2f}" if "width" in rows[0] else f" mb{int(rows[0]['micro-batch-size'])}"
            cells.append(f"{peak / MIB:.1f}{tag}{'' if ok else ' OVER'}")
        print(f"| {cid} | {profile} {budget} | " + " | ".join(cells) + " |")
    fails = {n: sum(len(r["failures"]) for r in runs[n].rounds) for n in names}
    print()
    print("failed client-rounds: " + ", ".join(f"{n} {v}" for n, v in fails.items()))
    iid = runs["edgetrain-iid"].accuracy.get(args.rounds, float("nan"))
    print(f"edgetrain IID vs centralised: {100 * (iid - central[-1]):+.2f} points; "
          f"edgetrain vs HeteroFL: IID {100 * (iid - runs['heterofl-iid'].accuracy[args.rounds]):+.2f}, non-IID "
          f"{100 * (runs['edgetrain-dirichlet'].accuracy[args.rounds] - runs['heterofl-dirichlet'].accuracy[args.rounds]):+.2f} points")
    print(f"total wall time {time.perf_counter() - t_all:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
