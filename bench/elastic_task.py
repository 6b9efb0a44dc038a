"""The CNN transfer task of the elastic benches: MobileNetV2-0.5 pretrained on MNIST digits 0-4, fine-tuned on 5-9.

Shared by ``bench_elastic.py`` (the full bench) and ``bench_elastic_sweep.py`` (accuracy against the
requested speed-up), so that both run exactly the same task.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

PRETRAIN_EPOCHS = 40                                                        # CNN backbone pretraining
FT_EPOCHS = 8   # every CNN method alike; full fine-tuning converges by then (RESULTS_ELASTIC.md, findings)
AUGMENT = dict(max_rotation_deg=12.0, max_scale=0.1, max_shift=3 / 32)     # up to 12 degrees, 10%, 3 px


def recalibrate_batchnorm(model: nn.Module, batches: Iterable[Any]) -> None:
    """Re-estimate BatchNorm running statistics with the final weights (one no-grad pass): after a
    short pretraining at a high learning rate the running averages lag the weights so far that eval
    mode scores chance. Done once, before fine-tuning, so every method starts from the same model."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None                          # cumulative average over the pass
    model.train()
    with torch.no_grad():
        for x, _ in batches:
            model(x)
    for m, mom in zip(bns, saved):
        m.momentum = mom


def pretrain(model: nn.Module, pre: Any, epochs: int, size: int, bs: int, lr: float) -> tuple[nn.Module, float]:
    """Train ``model`` from scratch on ``pre`` (one-cycle Adam, every batch randomly rotated, scaled and
    shifted by :func:`edgetrain.data.random_affine`), BatchNorm recalibrated on plain batches. Returns the
    model in eval mode and its accuracy on ``pre``'s test split."""
    from edgetrain.data import random_affine

    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, pct_start=0.2,
                                                total_steps=epochs * pre.num_batches("train", bs))
    gen = torch.Generator().manual_seed(0)
    for e in range(epochs):
        for x, y in pre.batches("train", bs, image_size=size, seed=100 + e):
            opt.zero_grad()
            nn.functional.cross_entropy(model(random_affine(x, gen, **AUGMENT)), y).backward()
            opt.step()
            sched.step()
    recalibrate_batchnorm(model, pre.batches("train", bs, image_size=size, seed=99))
    model.eval()
    xp, yp = pre.tensors("test", image_size=size)
    with torch.no_grad():
        return model, (model(xp).argmax(1) == yp).float().mean().item()


def pretrain_backbone(pre: Any, epochs: int, size: int, bs: int) -> tuple[nn.Module, float]:
    """MobileNetV2-0.5 trained from scratch on ``pre`` by :func:`pretrain`."""
    from edgetrain.models import mobilenet_v2

    torch.manual_seed(0)
    base = mobilenet_v2(num_classes=pre.num_classes, in_channels=1, width_mult=0.5)
    return pretrain(base, pre, epochs, size, bs, lr=3e-3)


@dataclass
class CnnTask:
    """The CNN transfer task: the pretrained backbone, digits 5-9 to fine-tune on, evaluation, new heads."""

    ft: Any                     # digits 5-9 (edgetrain.data dataset), normalised like the pretraining data
    base: nn.Module             # the pretrained backbone
    xt: torch.Tensor            # test images and labels
    yt: torch.Tensor
    train_n: int | None         # training images per epoch (None: all)
    size: int = 32
    bs: int = 64

    @property
    def steps_per_epoch(self) -> int:
        return (self.train_n or self.ft.num_samples()) // self.bs

    def batches(self, epoch: int) -> Iterable[Any]:
        """One epoch of training batches, shuffled by ``epoch`` (bench seeds add ``1000 * seed``)."""
        return itertools.islice(self.ft.batches("train", self.bs, image_size=self.size, seed=epoch),
                                None if self.train_n is None else self.train_n // self.bs)

    def batches_for_seed(self, seed: int) -> Callable[[int], Iterable[Any]]:
        """The epochs of seed ``seed``'s run: seed 1 is the bench's first run (orders 0, 1, ...), seed s > 1
        draws orders 1000 s, 1000 s + 1, ..."""
        offset = 0 if seed == 1 else 1000 * seed
        return lambda epoch: self.batches(epoch + offset)

    def evaluate(self, model: nn.Module) -> float:
        with torch.no_grad():
            acc = (model.eval()(self.xt).argmax(1) == self.yt).float().mean().item()
        model.train()
        return acc

    def fresh(self, seed: int = 1) -> nn.Module:
        """The pretrained backbone with a new 5-way head drawn from ``seed``, in train mode."""
        torch.manual_seed(seed)
        m = copy.deepcopy(self.base)
        m.classifier[1] = nn.Linear(self.base.classifier[1].in_features, 5)
        return m.train()


def make_opt(m: nn.Module) -> torch.optim.Optimizer:   # the trainable tensors (full, baselines)
    return torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3)


def make_opt_all(m: nn.Module) -> torch.optim.Optimizer:   # every tensor (elastic selects them)
    return torch.optim.Adam(m.parameters(), lr=1e-3)


def cnn_task(quick: bool, backbone_cache: str | None = None) -> tuple[CnnTask, str]:
    """The task (pretraining the backbone, or loading it from ``backbone_cache``) and a line describing it."""
    from edgetrain.data import load_mnist

    size, bs = 32, 64
    # Pretrain on 90% of the real 0-4 digits (10% held out to check it); fine-tune and test on 5-9.
    pre = load_mnist(seed=0, test_fraction=0.1).subset((0, 1, 2, 3, 4))
    ft = dataclasses.replace(load_mnist(seed=0).subset((5, 6, 7, 8, 9)), mean=pre.mean, std=pre.std)
    pre_epochs = 2 if quick else PRETRAIN_EPOCHS
    t0 = time.perf_counter()
    cache = f"{backbone_cache}.{'quick' if quick else 'full'}.pt" if backbone_cache else ""
    loaded = os.path.exists(cache)                   # saved by this same (deterministic) pretraining
    base, pre_acc = torch.load(cache, weights_only=False) if loaded else pretrain_backbone(pre, pre_epochs, size, bs)
    if cache and not loaded:
        torch.save((base, pre_acc), cache)
    xt, yt = ft.tensors("test", image_size=size, channels=1)
    task = CnnTask(ft, base, xt, yt, 640 if quick else None, size, bs)
    how = f"loaded from {cache}" if loaded else f"{time.perf_counter() - t0:.0f}s"
    return task, (f"CNN: MobileNetV2-0.5 pretrained on digits 0-4 ({pre.num_samples()} images, {pre_epochs} "
                  f"epochs one-cycle Adam, random rotations/scalings/shifts, BN recalibration, {how}): test acc "
                  f"{100 * pre_acc:.1f}% on {pre.num_samples('test')} held-out 0-4 images; fine-tune on digits "
                  f"5-9 ({task.train_n or ft.num_samples()} train / {len(yt)} test images)")
