"""Elastic selection: accuracy against the requested speed-up, over seeds (the CNN task of bench_elastic).

Run: ``python bench/bench_elastic_sweep.py [--speedups 1.5,1.75,2.0] [--seeds 5] [--threads 1]
[--backbone-cache PREFIX]``

Same protocol as ``bench_elastic.py``'s CNN part (the same pretrained MobileNetV2-0.5 backbone, digits 5-9,
``FT_EPOCHS`` epochs of Adam with cosine decay, seed ``s`` drawing the new head and the data order): per
seed, full fine-tuning and elastic selection at each requested speed-up, final test accuracy and each
run's speed-up from its median step against full fine-tuning's (minutes apart, so machine drift enters).
Prints the gap to full fine-tuning per speed-up: the accuracy cost curve of the approximation.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import bench_elastic as B  # noqa: E402
from edgetrain.adapt.elastic import ElasticConfig  # noqa: E402
from edgetrain.data import load_mnist  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speedups", default="1.5,1.75,2.0", help="comma-separated requested speed-ups")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--backbone-cache", metavar="PREFIX", help="as bench_elastic.py (PREFIX.full.pt)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    speeds = [float(s) for s in args.speedups.split(",")]
    size, bs = 32, 64                                   # as bench_elastic.cnn_bench
    pre = load_mnist(seed=0, test_fraction=0.1).subset((0, 1, 2, 3, 4))
    ft = dataclasses.replace(load_mnist(seed=0).subset((5, 6, 7, 8, 9)), mean=pre.mean, std=pre.std)
    cache = f"{args.backbone_cache}.full.pt" if args.backbone_cache else ""
    if cache and os.path.exists(cache):
        base, _ = torch.load(cache, weights_only=False)
    else:
        base, _ = B.pretrain_backbone(pre, B.PRETRAIN_EPOCHS, size, bs)
        if cache:
            torch.save((base, _), cache)
    xt, yt = ft.tensors("test", image_size=size, channels=1)

    def evaluate(model: nn.Module) -> float:
        with torch.no_grad():
            acc = (model.eval()(xt).argmax(1) == yt).float().mean().item()
        model.train()
        return acc

    def fresh(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        m = copy.deepcopy(base)
        m.classifier[1] = nn.Linear(base.classifier[1].in_features, 5)
        return m.train()

    def make_opt(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3)

    def make_opt_all(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(m.parameters(), lr=1e-3)

    steps = ft.num_samples() // bs
    cfg = dict(interval_steps=steps, probe_batch_size=32, timing_repeats=3, timing_cut_repeats=3,
               timing_max_cuts=24)
    decay = B.FT_EPOCHS * steps
    print(f"bench_elastic_sweep: torch {torch.__version__}, {torch.get_num_threads()} threads; speed-ups "
          f"{speeds}, seeds 1-{args.seeds}, {B.FT_EPOCHS} epochs")
    acc: dict[str, list[float]] = {}
    for seed in range(1, args.seeds + 1):
        offset = 0 if seed == 1 else 1000 * seed         # bench_elastic's data order per seed

        def batches(epoch: int, offset: int = offset):
            return ft.batches("train", bs, image_size=size, seed=epoch + offset)

        t0 = time.perf_counter()
        full = B.train("full", fresh(seed), make_opt, batches, evaluate, B.FT_EPOCHS, decay_steps=decay)
        acc.setdefault("full", []).append(full.epochs[-1][1])
        line = f"seed {seed}: full {100 * full.epochs[-1][1]:.1f}%"
        for s in speeds:
            el = B.train(f"elastic {s}x", fresh(seed), make_opt_all, batches, evaluate, B.FT_EPOCHS,
                         decay_steps=decay, elastic=ElasticConfig(speedup=s, **cfg))
            acc.setdefault(f"{s}", []).append(el.epochs[-1][1])
            measured = statistics.median(full.step_s) / statistics.median(el.step_s)
            line += (f"  {s}x {100 * el.epochs[-1][1]:.1f}% ({measured:.2f}x, deepest "
                     f"{el.selector.deepest_selected})")
        print(f"{line}  [{time.perf_counter() - t0:.0f} s]", flush=True)
    print(f"full mean {100 * statistics.mean(acc['full']):.2f}%")
    for s in speeds:
        gaps = [100 * (e - f) for e, f in zip(acc[f"{s}"], acc["full"])]
        sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
        print(f"elastic {s}x mean {100 * statistics.mean(acc[f'{s}']):.2f}%  gap {statistics.mean(gaps):+.2f} "
              f"points (sd {sd:.2f})  per seed {' '.join(f'{g:+.1f}' for g in gaps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
