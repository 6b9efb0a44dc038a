"""``edgetrain report`` and ``edgetrain bench --model SPEC``: a model spec (or a train config) planned and measured."""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import torch

__all__ = ["report_command", "bench_spec"]


def _example_from_config(path: str) -> tuple[Any, Any, Any, str | None, str]:
    """Model, example batch, loss, budget and name from a train config (its first training batch)."""
    from torch.utils.data import DataLoader

    from ..spec import build_model, load_data
    from .train_config import load_train_config

    cfg = load_train_config(path)
    torch.manual_seed(cfg.seed)
    data = load_data(cfg.data, kwargs=cfg.data_kwargs, image_size=cfg.image_size, channels=cfg.channels,
                     target_column=cfg.target_column, task=cfg.task, seed=cfg.seed)
    x, y = next(iter(DataLoader(data.train, batch_size=cfg.batch_size)))
    model = build_model(cfg.model, cfg.model_kwargs, num_classes=data.num_classes, in_channels=data.in_channels,
                        image_size=cfg.image_size)
    loss = torch.nn.CrossEntropyLoss() if data.task == "classification" else torch.nn.MSELoss()
    return model, (x, y), loss, cfg.memory_budget, cfg.model


def report_command(args: argparse.Namespace) -> int:
    """Prepare the model (from a config or a spec), write the report, print its path."""
    from ..profile import memory
    from .train import spec_model_and_batch
    from ..api import prepare
    from .main import _kwargs, _shape

    if args.config:
        model, batch, loss, budget, name = _example_from_config(args.config)
        budget = args.budget or budget
    else:
        model, x, y = spec_model_and_batch(args.model, _kwargs(args.model_kwargs), _shape(args.input_shape),
                                           args.batch_size)
        batch, loss, budget, name = (x, y), torch.nn.CrossEntropyLoss(), args.budget, args.model
    memory.record_baseline()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = prepare(model, opt, loss, batch, memory_budget=budget, solver=args.solver, paging=args.paging,
                   objective="energy" if args.paging else "time", name=name)
    print(step.plan.summary())
    path = step.report(args.out, batch=batch)
    print(f"report written to {path}")
    step.close()
    return 0


def bench_spec(args: argparse.Namespace) -> int:
    """Each planner (edgetrain's and the baselines) prepared on the model, timed over a few real steps."""
    from .train import spec_model_and_batch
    from ..api import prepare
    from .main import _kwargs, _shape
    from ..errors import BudgetError
    from ..planners import solve
    from ..report._curves import BASELINES
    from ..units import format_bytes, parse_bytes

    base, x, y = spec_model_and_batch(args.model, _kwargs(args.model_kwargs), _shape(args.input_shape),
                                      args.batch_size)
    loss = torch.nn.CrossEntropyLoss()
    budget = None if args.budget is None else parse_bytes(args.budget)
    print(f"{args.model}, batch {args.batch_size}, budget "
          f"{'from the model' if budget is None else format_bytes(budget)}; {args.steps} timed steps each")
    if budget is None:
        probe_model = copy.deepcopy(base)
        probe = prepare(probe_model, torch.optim.SGD(probe_model.parameters(), lr=0.01, momentum=0.9), loss, (x, y))
        fixed, plain = probe.costs.fixed_bytes, solve(probe.costs, 2**62, solver="no_saving").peak_bytes
        budget = int(fixed + 0.6 * (plain - fixed))  # between the smallest plan and plain's peak
        probe.close()
        print(f"budget {format_bytes(budget)}: fixed {format_bytes(fixed)} + 60% of plain's activations")
    print(f"{'planner':>26}  {'micro':>5}  {'recomp':>6}  {'pred peak':>10}  {'pred ms':>8}  {'measured ms':>11}")
    for name, label in BASELINES:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        try:
            step = prepare(model, opt, loss, (x, y), memory_budget=budget, solver=name)
        except BudgetError as e:
            need = "" if e.min_feasible_bytes is None else f": needs {format_bytes(e.min_feasible_bytes)}"
            print(f"{label:>26}  does not fit{need}")
            continue
        step(x, y)  # warm-up
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(x, y)
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        p = step.plan
        print(f"{label:>26}  {p.micro_batch_size:>5}  {p.policies.count('recompute'):>6}  "
              f"{format_bytes(p.peak_bytes):>10}  {p.step_time_s * 1e3:>8.1f}  {ms:>11.1f}")
        step.close()
    return 0
