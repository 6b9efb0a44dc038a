"""``edgetrain report`` and ``edgetrain bench --model SPEC``: a model spec (or a train config) planned and measured."""

from __future__ import annotations

import argparse
import copy
import time

import torch

from ..config import options

__all__ = ["report_command", "bench_spec"]


def report_command(args: argparse.Namespace) -> int:
    """Prepare the model (from a config or a spec), write the report, print its path."""
    from ..api import prepare
    from ..profile import memory
    from .args import parse_kwargs, parse_shape
    from .train import config_example, spec_model_and_batch

    paged = options(paging=True, objective="energy")["paging"] if args.paging else None
    if args.config:  # the plan `edgetrain train` would run
        model, batch, loss, budget, opt, kw = config_example(args.config, solver=args.solver)
        budget = args.budget or budget
        kw["paging"] = paged or kw["paging"]
    else:
        memory.record_baseline(release=True)
        model, x, y = spec_model_and_batch(args.model, parse_kwargs(args.model_kwargs), parse_shape(args.input_shape),
                                           args.batch_size)
        batch, loss, budget, name = (x, y), torch.nn.CrossEntropyLoss(), args.budget, args.model
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        kw = {**options(solver=args.solver or "dp"), "paging": paged, "name": name}
    step = prepare(model, opt, loss, batch, memory_budget=budget, **kw)
    print(step.plan.summary())
    path = step.report(args.out, batch=batch)
    print(f"report written to {path}")
    step.close()
    return 0


def bench_spec(args: argparse.Namespace) -> int:
    """Each planner (edgetrain's and the baselines) prepared on the model, timed over a few real steps."""
    from ..api import prepare
    from ..errors import BudgetError
    from ..planners import solve
    from ..report._curves import BASELINES
    from ..units import format_bytes, parse_bytes
    from .args import parse_kwargs, parse_shape
    from .train import spec_model_and_batch

    base, x, y = spec_model_and_batch(args.model, parse_kwargs(args.model_kwargs), parse_shape(args.input_shape),
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
            step = prepare(model, opt, loss, (x, y), memory_budget=budget, **options(solver=name))
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
