"""Gradient filtering bench: backward FLOPs, time and saved-activation bytes, exact vs filtered, plus a
real transfer-learning accuracy check (MNIST digits 0-4 -> 5-9).

Run: ``python bench/bench_gradfilter.py [--quick]`` (plain-text tables on stdout).

Part 1, for MobileNetV2 and ResNet-18 at r = 2 and 4 over the last 2 and 4 convs (earlier layers
frozen, as in the paper; the exact baseline trains the same layers with plain PyTorch convs):

* per filtered conv, run alone on its real input: backward FLOPs (estimate), measured backward
  seconds (median, exact and filtered interleaved, in alternating order), saved-activation bytes
  (measured with ``torch.autograd.graph.saved_tensors_hooks``, unique storages, parameters excluded);
* end to end (one training step of the whole model): the same three numbers. The end-to-end bytes
  include the BatchNorm/ReLU tensors that filtering does not change.

Part 3 (auto mode): with all but the last 8 convs frozen, ``plan_grad_filter`` picks layers and radius
for a backward speed-up target, from measured per-layer times (default) and from FLOPs, in NCHW and
channels-last layout; "verified" is the speed-up the planner itself measured for its choice (measured
timing only: it re-plans when short), "measured" the bench's own interleaved measurement of one step.

Part 2: pretrain a small MobileNetV2 on digits 0-4, fine-tune the last 4 convs (+ head) on 5-9 exactly
and with r = 2 from the same weights and batches, and compare test accuracy (target: within 1.5 points).
"""

from __future__ import annotations

import argparse
import copy
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from edgetrain.approx import GradFilter, apply_grad_filter, plan_grad_filter, remove_grad_filter  # noqa: E402
from edgetrain.errors import BudgetError  # noqa: E402
from edgetrain.approx.gradfilter.auto import median_backward  # noqa: E402  (the planner's timer)
from edgetrain.approx.gradfilter.trace import trace_model  # noqa: E402  (whole-step FLOPs)
from edgetrain.units import format_bytes  # noqa: E402


def saved_bytes(fn, params) -> tuple[int, object]:
    """Bytes of the unique storages autograd saves while ``fn`` runs (parameters excluded)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in skip:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def freeze(model: nn.Module, names: tuple[str, ...]) -> nn.Module:
    for name, p in model.named_parameters():
        if name in names:
            p.requires_grad_(False)
    return model


def variants(model: nn.Module, x: torch.Tensor, n: int, radii: tuple[int, ...]):
    """(exact model, {r: filtered model}, report) with the same layers trainable in all of them."""
    reports = {}
    filtered = {}
    for r in radii:
        m = copy.deepcopy(model)
        reports[r] = apply_grad_filter(m, GradFilter(radius=r, last_n=n), x)
        filtered[r] = m
    exact = copy.deepcopy(model)
    freeze(exact, reports[radii[0]].frozen)
    return exact, filtered, reports


CLOCK = time.perf_counter


def time_backward(fns, reps: int) -> list[float]:
    """Median backward seconds of each ``fn() -> (output, grad_output)``, interleaved, on ``CLOCK``."""
    return median_backward(fns, reps, CLOCK)


def per_layer(exact: nn.Module, filtered: dict[int, nn.Module], reports, x: torch.Tensor,
              reps: int) -> list[list[str]]:
    """One row per (radius, layer): each conv run alone on the input it sees in the model."""
    inputs: dict[str, torch.Tensor] = {}
    names = reports[next(iter(reports))].layers
    hooks = [exact.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: inputs.setdefault(n, a[0].detach())) for n in names]
    with torch.no_grad():
        exact(x)
    for h in hooks:
        h.remove()
    rows = []
    for r, report in reports.items():
        for cost in report.costs:
            conv = exact.get_submodule(cost.name)
            fconv = filtered[r].get_submodule(cost.name)
            inp = inputs[cost.name].clone().requires_grad_(cost.needs_input_grad)
            b_exact, y = saved_bytes(lambda: conv(inp), list(conv.parameters()))
            b_filt, _ = saved_bytes(lambda: fconv(inp), list(fconv.parameters()))
            gy = torch.randn_like(y)

            def run(module):
                for p in module.parameters():
                    p.grad = None
                inp.grad = None
                return module(inp), gy

            t_exact, t_filt = time_backward([lambda: run(conv), lambda: run(fconv)], reps)
            rows.append([f"r={r}", cost.name, "x".join(map(str, cost.input_shape[1:])),
                         f"{cost.backward_flops_exact / 1e6:.1f}",
                         f"{cost.backward_flops_filtered / 1e6:.1f}", f"{cost.flops_ratio:.2f}x",
                         f"{t_exact * 1e3:.2f}", f"{t_filt * 1e3:.2f}", f"{t_exact / t_filt:.2f}x",
                         format_bytes(b_exact), format_bytes(b_filt), f"{1 - b_filt / b_exact:.0%}"])
    return rows


def end_to_end(exact: nn.Module, filtered: dict[int, nn.Module], reports, x: torch.Tensor,
               y: torch.Tensor, reps: int) -> list[list[str]]:
    """Rows for the whole training step: exact first, then each radius."""
    models = [("exact", None, exact)] + [(f"r={r}", r, m) for r, m in filtered.items()]

    def step(model: nn.Module):
        model.zero_grad(set_to_none=True)
        return F.cross_entropy(model(x), y), None

    measured = {label: saved_bytes(lambda m=m: step(m)[0], list(m.parameters()))[0]
                for label, _, m in models}
    times = time_backward([lambda m=m: step(m) for _, _, m in models], reps)
    flops_exact = trace_model(exact, x, record_saved=True).backward_flops  # every Conv2d and Linear
    rows = []
    for (label, r, _), t in zip(models, times):
        costs = reports[r].costs if r else ()
        flops = flops_exact - sum(c.backward_flops_exact - c.backward_flops_filtered for c in costs)
        rows.append([label, f"{flops / 1e9:.3f}", f"{flops_exact / flops:.2f}x", f"{t * 1e3:.1f}",
                     f"{times[0] / t:.2f}x", format_bytes(measured[label]),
                     f"{1 - measured[label] / measured['exact']:.0%}"])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" if i else f"{{:<{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header), fmt.format(*["-" * w for w in widths])]
                     + [fmt.format(*r) for r in rows])


def part1(quick: bool) -> None:
    from edgetrain.models import mobilenet_v2, resnet18
    size, reps, layer_reps = (128, 3, 9) if quick else (256, 5, 15)
    setups = [("MobileNetV2", lambda: mobilenet_v2(num_classes=10), 4 if quick else 16),
              ("ResNet-18", lambda: resnet18(num_classes=10), 4 if quick else 8)]
    layer_header = ["radius", "layer", "in CxHxW", "MFLOP ex", "MFLOP f", "ratio", "ms ex", "ms f",
                    "speedup", "saved ex", "saved f", "less"]
    e2e_header = ["variant", "conv+linear bwd GFLOP", "ratio", "bwd ms", "speedup", "saved", "less"]
    for name, build, batch in setups:
        torch.manual_seed(0)
        model = build()
        x = torch.randn(batch, 3, size, size)
        y = torch.randint(0, 10, (batch,))
        for n in (2, 4):
            exact, filtered, reports = variants(model, x, n, (2, 4))
            print(f"\n== {name}, input {batch}x3x{size}x{size}, last {n} convs trained "
                  f"(earlier frozen), exact vs filtered ==")
            print("per filtered conv (run alone on its real input):")
            print(table(layer_header, per_layer(exact, filtered, reports, x, layer_reps)))
            for r, rep in reports.items():
                ex = sum(c.saved_bytes_exact for c in rep.costs)
                fi = sum(c.saved_bytes_filtered for c in rep.costs)
                fe = sum(c.backward_flops_exact for c in rep.costs)
                ff = sum(c.backward_flops_filtered for c in rep.costs)
                print(f"  all filtered convs r={r}: backward FLOPs {fe / ff:.2f}x fewer, saved conv "
                      f"inputs {format_bytes(ex)} -> {format_bytes(fi)} ({1 - fi / ex:.0%} less)")
            print("end to end (one training step; bytes include BatchNorm/ReLU tensors):")
            print(table(e2e_header, end_to_end(exact, filtered, reports, x, y, reps)))


def part3(quick: bool) -> None:
    """Auto mode: predicted (measured timing, FLOPs) vs measured backward speed-up of its choice."""
    from edgetrain.models import mobilenet_v2, resnet18
    size, reps = (128, 3) if quick else (256, 7)
    setups = [("MobileNetV2", lambda: mobilenet_v2(num_classes=10), 4 if quick else 16),
              ("ResNet-18", lambda: resnet18(num_classes=10), 4 if quick else 8)]
    header = ["layout", "target", "timing", "chosen (left exact)", "r", "predicted", "verified", "measured"]
    for name, build, batch in setups:
        print(f"\n== auto mode, {name}, input {batch}x3x{size}x{size}, all but the last 8 convs frozen, "
              f"backward speed-up of one step ==")
        rows = []
        for layout in (torch.contiguous_format, CL):
            label = "channels_last" if layout is CL else "NCHW"
            torch.manual_seed(0)
            model = build().to(memory_format=layout)
            x = torch.randn(batch, 3, size, size).contiguous(memory_format=layout)
            y = torch.randint(0, 10, (batch,))
            frozen = apply_grad_filter(copy.deepcopy(model), GradFilter(radius=1, last_n=8), x).frozen
            freeze(model, frozen)
            timings = None
            for target in (1.5, 2.0):
                for timing in ("measured", "flops"):
                    try:
                        plan = plan_grad_filter(model, x, target_speedup=target, timing=timing,
                                                timings=timings)
                    except BudgetError as exc:
                        best = re.search(r"best reachable backward speed-up is (\S+)", str(exc))
                        rows.append([label, f"{target}x", timing, f"refused: best {best.group(1) if best else '?'}",
                                     "", "", "", ""])
                        continue
                    timings = plan.timings or timings
                    filtered = copy.deepcopy(model)
                    apply_grad_filter(filtered, plan.config)

                    def step(m: nn.Module):
                        m.zero_grad(set_to_none=True)
                        return F.cross_entropy(m(x), y), None

                    t_exact, t_filt = time_backward([lambda: step(model), lambda: step(filtered)], reps)
                    chosen = f"{len(plan.layers)} convs" + (f" ({', '.join(plan.left_exact)})"
                                                             if plan.left_exact else "")
                    rows.append([label, f"{target}x", timing, chosen,
                                 str(plan.config.radius), f"{plan.predicted_speedup:.2f}x",
                                 "-" if plan.measured_speedup is None else f"{plan.measured_speedup:.2f}x",
                                 f"{t_exact / t_filt:.2f}x"])
        print(table(header, rows))


CL = torch.channels_last  # oneDNN runs MobileNetV2 ~1.6x faster on CPU in this layout (both variants)


def accuracy(model: nn.Module, data, size: int) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for xb, yb in data.batches("test", 250, size, 3, shuffle=False, drop_last=False):
            correct += int((model(xb.contiguous(memory_format=CL)).argmax(1) == yb).sum())
            total += len(yb)
    model.train()
    return 100.0 * correct / total


def train(model: nn.Module, data, epochs: int, size: int, lr: float, seed: int) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    steps = epochs * data.num_batches("train", 32)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    model.train()
    for epoch in range(epochs):
        for xb, yb in data.batches("train", 32, size, 3, shuffle=True, seed=seed * 100 + epoch):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xb.contiguous(memory_format=CL)), yb).backward()
            opt.step()
            sched.step()


def part2(quick: bool) -> None:
    from edgetrain.data import load_mnist
    from edgetrain.models import mobilenet_v2
    # 96x96 inputs: the last four convs see 3x3 maps, 2x2 after filtering (ceil mode, partial patches)
    size, width = 96, 0.5
    pre_epochs, fine_epochs = (1, 2) if quick else (3, 4)
    seeds = (0,) if quick else (0, 1, 2)
    pretrain, finetune = load_mnist().transfer_split()
    print(f"\n== accuracy: MobileNetV2 x{width} at {size}x{size}, pretrained {pre_epochs} epoch(s) on digits "
          f"0-4, then the last 4 convs + head fine-tuned on 5-9 for {fine_epochs} epochs "
          f"({finetune.num_samples('train')} train / {finetune.num_samples('test')} test images) ==")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    base = mobilenet_v2(num_classes=pretrain.num_classes, width_mult=width, dropout=0.0).to(memory_format=CL)
    train(base, pretrain, pre_epochs, size, 0.05, seed=0)
    print(f"pretrained: {accuracy(base, pretrain, size):.1f}% on digits 0-4 "
          f"({time.perf_counter() - t0:.0f} s)")
    rows, diffs = [], []
    for seed in seeds:
        t0 = time.perf_counter()
        results = {}
        for label, radius in (("exact", None), ("r=2", 2)):
            torch.manual_seed(seed)  # same new head and batch order for both
            model = copy.deepcopy(base)
            model.classifier[-1] = nn.Linear(base.last_channel, finetune.num_classes)
            report = apply_grad_filter(model, GradFilter(radius=radius or 2, last_n=4))
            if radius is None:  # exact baseline: same trainable layers, plain convolutions
                remove_grad_filter(model)
                freeze(model, report.frozen)
            train(model, finetune, fine_epochs, size, 0.02, seed)
            results[label] = accuracy(model, finetune, size)
        diffs.append(results["r=2"] - results["exact"])
        rows.append([str(seed), f"{results['exact']:.1f}", f"{results['r=2']:.1f}", f"{diffs[-1]:+.1f}",
                     f"{time.perf_counter() - t0:.0f}"])
    print(table(["seed", "exact acc 5-9 %", "r=2 acc 5-9 %", "diff", "s"], rows))
    mean = statistics.mean(diffs)
    verdict = "within" if abs(mean) <= 1.5 else "NOT within"
    print(f"mean difference r=2 - exact: {mean:+.2f} points ({verdict} the 1.5-point target)")


def main() -> None:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small inputs, few repeats (< 2 min)")
    parser.add_argument("--skip-accuracy", action="store_true", help="run part 1 only")
    parser.add_argument("--skip-speed", action="store_true", help="skip part 1")
    parser.add_argument("--skip-auto", action="store_true", help="skip part 3 (auto mode)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: process CPU time (steadier on a shared machine)")
    parser.add_argument("--allocator", choices=("pool", "tuned"), default="pool",
                        help="pool: edgetrain's tensor pool, as prepare() installs it (both variants reuse "
                             "memory); tuned: glibc with a 64 KiB mmap threshold (every new tensor faults)")
    args = parser.parse_args()
    if args.allocator == "pool":
        from edgetrain.runtime import pool

        pool.install()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; allocator {args.allocator}; times are "
          f"{args.clock}-clock medians of interleaved runs (order alternating)")
    if not args.skip_speed:
        part1(args.quick)
    if not args.skip_auto:
        part3(args.quick)
    if not args.skip_accuracy:
        part2(args.quick)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
