"""``edgetrain demo`` (and the flag form of ``edgetrain train``): train an in-project model on bundled digits.

The main job ``make demo`` runs: a model trained within a memory budget on real data, evaluated, with plain
PyTorch's own peak measured beside it for comparison.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

from ..config import options

__all__ = ["cmd_train"]

log = logging.getLogger("edgetrain.cli")


def _progress(iterable: Any, total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the [cli] extra; without it, no bar
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="step", dynamic_ncols=True, leave=True)


def _evaluate(model: Any, digits: Any, image_size: int, channels: int, layout: str, batch_size: int = 100) -> float:
    """Test accuracy, in batches no larger than the step's micro-batch (``batch_size``): a forward at a shape
    training never runs builds kernels and activations outside the budget."""
    import torch

    was_training = model.training
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in digits.batches("test", batch_size=batch_size, image_size=image_size, channels=channels,
                                   shuffle=False, drop_last=False, layout=layout):
            correct += int((model(x).argmax(dim=1) == y).sum())
            total += int(y.numel())
    model.train(was_training)
    return correct / max(total, 1)


def _precise_bn(model: Any, batches: Any, n: int) -> int:
    """Set BatchNorm running statistics to their average over ``n`` training batches ("precise BN").

    The exponential average a training step keeps lags a network trained from scratch (after one epoch of
    the demo, plain PyTorch evaluates at 10% with it and at 82% with batch statistics); averaging forward
    passes without gradients costs no training and no gradient memory. Returns the batches used.
    """
    import torch

    from .._state import batchnorm_modules

    bns = [m for _, m in batchnorm_modules(model)]
    if not bns or n <= 0:
        return 0
    momenta = [b.momentum for b in bns]
    was_training = model.training
    for b in bns:
        b.reset_running_stats()
        b.momentum = None  # cumulative average over the calls that follow
    model.train()
    used = 0
    with torch.no_grad():
        for x, _ in batches:
            model(x)
            used += 1
            if used >= n:
                break
    for b, momentum in zip(bns, momenta):
        b.momentum = momentum
    model.train(was_training)
    return used


def _model_for(name: str, image_size: int, width: float) -> tuple[Any, int, str]:
    from ..models import get_model

    if name == "mobilenet_v2":
        return get_model(name, num_classes=10, in_channels=1, width_mult=width, dropout=0.0), 1, "image"
    if name == "resnet18":
        return get_model(name, num_classes=10, in_channels=1, small_input=True), 1, "image"
    if name == "transformer":
        return get_model(name, num_classes=10, input_dim=image_size), 1, "sequence"
    raise SystemExit(f"unknown model {name!r}")


def _plain_peak(model: str, image_size: int, batch: int, width: float) -> int:
    """Peak of plain PyTorch on this job, measured in a fresh process (system allocator, as users run it)."""
    from ..measure import Job, run_isolated

    shape = (image_size, image_size) if model == "transformer" else (1, image_size, image_size)
    kwargs: dict[str, Any] = {"num_classes": 10}
    if model == "mobilenet_v2":
        kwargs.update(in_channels=1, width_mult=width, dropout=0.0)
    elif model == "resnet18":
        kwargs.update(in_channels=1, small_input=True)
    else:
        kwargs.update(input_dim=image_size)
    res = run_isolated(Job(model, shape, batch, mode="plain", model_kwargs=kwargs, steps=2,
                           env={"EDGETRAIN_ALLOCATOR": "system"}))
    if not res.ok:
        raise SystemExit(f"measuring plain PyTorch failed: {res.error}")
    return res.peak_bytes


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    import edgetrain
    from edgetrain.data import load_mnist
    from edgetrain.profile import memory

    out = print
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = None if args.budget is None else edgetrain.parse_bytes(args.budget)
    if budget is None and args.budget_fraction:
        out(f"measuring plain PyTorch's peak for {args.model}, batch {args.batch_size} "
            f"({args.image_size}x{args.image_size}) in a fresh process ...")
        plain = _plain_peak(args.model, args.image_size, args.batch_size, args.width)
        budget = int(plain * args.budget_fraction)
        out(f"plain PyTorch peak: {edgetrain.format_bytes(plain)}; edgetrain budget "
            f"{args.budget_fraction:.0%} of it: {edgetrain.format_bytes(budget)}")
    digits = load_mnist(seed=args.seed)
    # The dataset (and the packages that load it) are not training memory: start the budget's zero point
    # here, as plain PyTorch's measurement (random data, no loader) does, and the peak with it (loading
    # peaks far above what it keeps, and leaves its garbage in the heap, handed back first).
    memory.record_baseline(release=True)
    memory.reset_peak()
    torch.manual_seed(args.seed)
    model, channels, layout = _model_for(args.model, args.image_size, args.width)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    batches = lambda epoch: digits.batches("train", batch_size=args.batch_size, image_size=args.image_size,  # noqa: E731
                                           channels=channels, seed=args.seed + epoch, layout=layout)
    example = next(iter(batches(0)))
    t0 = time.perf_counter()
    step = edgetrain.prepare(model, opt, loss_fn, example, memory_budget=budget, **options(solver=args.solver))
    out(f"prepared in {time.perf_counter() - t0:.1f} s\n" + step.plan.summary())
    first_epoch = 0
    if args.checkpoint and Path(args.checkpoint).exists():
        from ..checkpoint import load_checkpoint

        ck = load_checkpoint(args.checkpoint, model, opt)
        first_epoch = int(ck.extra.get("epoch", -1)) + 1
        out(f"resumed from {args.checkpoint} after epoch {first_epoch} (step {ck.step})")
    n_steps = digits.num_batches("train", args.batch_size) if hasattr(digits, "num_batches") else None
    losses: list[float] = []
    t_train = time.perf_counter()
    for epoch in range(first_epoch, args.epochs):
        bar = _progress(batches(epoch), n_steps or 0, f"epoch {epoch + 1}/{args.epochs}", not args.no_progress)
        run_loss = []
        for x, y in bar:
            loss = step(x, y)
            run_loss.append(loss)
            losses.append(loss)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{sum(run_loss[-20:]) / len(run_loss[-20:]):.3f}")
        used = _precise_bn(model, batches(10_000 + epoch), args.precise_bn)
        acc = _evaluate(model, digits, args.image_size, channels, layout, min(100, step.plan.micro_batch_size))
        note = f" (BatchNorm statistics averaged over {used} training batches first)" if used else ""
        out(f"epoch {epoch + 1}: mean loss {sum(run_loss) / max(len(run_loss), 1):.4f}, test accuracy {acc:.2%}"
            + note)
        if args.checkpoint:
            from ..checkpoint import save_checkpoint

            save_checkpoint(args.checkpoint, model, opt, step=step.steps_done, extra={"epoch": epoch})
    elapsed = time.perf_counter() - t_train
    peak = memory.peak_rss_bytes() - memory.baseline_rss_bytes()
    if getattr(args, "report", None):
        out(f"plan report: {step.report(args.report, batch=example)}")
    if not losses:
        out("nothing left to train (the checkpoint is past the last epoch)")
        return 0
    first, last = losses[:10], losses[-10:]
    out(f"loss {sum(first) / len(first):.3f} (first 10 steps) -> {sum(last) / len(last):.3f} (last 10); "
        f"{len(losses) * args.batch_size / elapsed:.1f} samples/s")
    if budget is None:
        out(f"measured peak {edgetrain.format_bytes(peak)} (no budget)")
        return 0
    verdict = "within" if peak <= budget else "ABOVE"
    out(f"measured peak {edgetrain.format_bytes(peak)} vs budget {edgetrain.format_bytes(budget)}: {verdict} "
        "budget (peak RSS above the RSS once the digits were loaded and the heap they left free handed back)")
    if args.save:
        path = Path(args.save)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, path)
        out(f"saved model weights to {path}")
    return 0 if peak <= budget else 1
