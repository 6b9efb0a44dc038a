"""Memory layout on CPU: a plain PyTorch training step in NCHW against channels-last, side by side.

Run: ``python bench/bench_layout.py [--threads 1] [--steps 15]``

Per model: the median step time (forward, backward, SGD update) of each layout, steps interleaved
(NCHW, channels-last, NCHW, ...) so that machine drift hits both alike, and the ratio. edgetrain's plans
are exact in either layout (``tests/test_exactness.py::test_channels_last_model_matches_plain``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from edgetrain.models import mobilenet_v2, resnet18  # noqa: E402

SETUPS = [  # name, model, input shape
    ("MobileNetV2 (width 0.5), 64x1x32x32", lambda: mobilenet_v2(num_classes=10, in_channels=1, width_mult=0.5),
     (64, 1, 32, 32)),
    ("MobileNetV2, 16x3x128x128", lambda: mobilenet_v2(num_classes=10), (16, 3, 128, 128)),
    ("ResNet-18, 16x3x64x64", lambda: resnet18(num_classes=10), (16, 3, 64, 64)),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per layout (after 3 warm-ups)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"bench_layout: torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps")
    print(f"{'model, batch':<40} {'NCHW ms':>9} {'channels-last ms':>17} {'speed-up':>9}")
    for name, build, shape in SETUPS:
        runs = []
        for layout in (torch.contiguous_format, torch.channels_last):
            torch.manual_seed(0)
            model = build().to(memory_format=layout).train()
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            x = torch.randn(shape).contiguous(memory_format=layout)
            y = torch.randint(0, 10, (shape[0],))
            runs.append((model, opt, x, y))
        times: list[list[float]] = [[], []]
        for i in range(args.steps + 3):
            for k, (model, opt, x, y) in enumerate(runs):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                if i >= 3:
                    times[k].append(time.perf_counter() - t0)
        nchw, cl = (1e3 * statistics.median(t) for t in times)
        print(f"{name:<40} {nchw:>9.1f} {cl:>17.1f} {nchw / cl:>8.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
