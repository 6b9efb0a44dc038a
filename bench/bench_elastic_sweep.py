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
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import bench_elastic as B  # noqa: E402
from edgetrain.approx.elastic.selector import ElasticConfig  # noqa: E402
from elastic_task import FT_EPOCHS, cnn_task, make_opt, make_opt_all  # noqa: E402


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
    task, line = cnn_task(False, args.backbone_cache)
    print(line)
    cfg = dict(interval_steps=task.steps_per_epoch, probe_batch_size=32, timing_repeats=3, timing_cut_repeats=3,
               timing_max_cuts=24)
    decay = FT_EPOCHS * task.steps_per_epoch
    print(f"bench_elastic_sweep: torch {torch.__version__}, {torch.get_num_threads()} threads; speed-ups "
          f"{speeds}, seeds 1-{args.seeds}, {FT_EPOCHS} epochs")
    acc: dict[str, list[float]] = {}
    for seed in range(1, args.seeds + 1):
        batches = task.batches_for_seed(seed)             # bench_elastic's data order per seed
        t0 = time.perf_counter()
        full = B.train("full", task.fresh(seed), make_opt, batches, task.evaluate, FT_EPOCHS, decay_steps=decay)
        acc.setdefault("full", []).append(full.epochs[-1][1])
        line = f"seed {seed}: full {100 * full.epochs[-1][1]:.1f}%"
        for s in speeds:
            el = B.train(f"elastic {s}x", task.fresh(seed), make_opt_all, batches, task.evaluate, FT_EPOCHS,
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
