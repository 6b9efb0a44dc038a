"""Shared by the tests of what a forward does beyond its values and of what a step assumes: one plain
PyTorch SGD step, a prepared copy, bit-for-bit state comparison, a residual stack."""

from __future__ import annotations

import copy
import warnings
from typing import Callable

import torch
from torch import nn

import edgetrain


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int = 5) -> nn.Module:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(seed)
    nn.CrossEntropyLoss()(model(x), y).backward()
    opt.step()
    return model


def prepared(model: nn.Module, x: torch.Tensor, y: torch.Tensor, **planning: object) -> tuple[nn.Module, object]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), example=(x, y),
                                 planning=edgetrain.PlanConfig(**planning))
    return model, step


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    for (name, u), v in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(u, v), name
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


def retraced_side_by_side(model: nn.Module, change: Callable[[nn.Module, int], None],
                          batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
    """Three steps of ``model`` through a traced, fully recomputed plan beside plain PyTorch on a copy, with
    ``change(net, i)`` applied to both before step ``i``; they must end in the same state. ``batches``: the
    steps' batches (default: 8 samples of 16 features, 3 classes)."""
    torch.manual_seed(0)
    batches = batches or [(torch.randn(8, 16), torch.randint(0, 3, (8,))) for _ in range(3)]
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    m, step = prepared(model, *batches[0], solver="recompute_all")
    assert step.chain.method == "fx"
    for i, (x, y) in enumerate(batches):
        for net in (plain, m):
            change(net, i)
        opt.zero_grad()
        nn.CrossEntropyLoss()(plain(x), y).backward()
        opt.step()
        step(x, y)
    assert_same_state(plain, m)


def assert_trains_whole(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                        solver: str | None, tolerance: float) -> None:
    """A model that runs on no part of its batch verifies whole (every stage recomputed with ``recompute_all``)
    and refuses micro-batches, naming why."""
    import pytest
    import torch.nn.functional as F

    batch = y.shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = edgetrain.verify(model, opt, F.cross_entropy, (x, y), tolerance=tolerance,
                                  planning=edgetrain.PlanConfig(solver=solver))
        assert report.passed and report.micro_batch_size == report.batch_size == batch, str(report)
        if solver == "recompute_all":
            assert report.recomputed == report.stages > 1
        with pytest.raises(edgetrain.InputError, match="fails on part of the batch"):
            edgetrain.prepare(model, opt, F.cross_entropy, (x, y),
                              planning=edgetrain.PlanConfig(micro_batch_size=batch // 2))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.l2(torch.relu(self.l1(x)))


class Stack(nn.Module):
    """``depth`` blocks of 32 features (``block()`` makes one) between an input and an output layer."""

    def __init__(self, block: Callable[[], nn.Module] = Residual, depth: int = 3) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(16, 32), nn.Linear(32, 3)
        self.blocks = nn.ModuleList(block() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)
