"""Planning without the device: cost a model (or a cost-graph file) for a named device profile and plan it.

``edgetrain.plan_for_device(...)`` profiles the model here, rescales the costs to the target device (its compute
rate; FLOPs where the host is not the reference) with :func:`edgetrain.devices.scale_chain`, and solves
the POET-style problem (keep / recompute / page per stage, energy or time objective, optional time
budget). It returns the joint plan with the recompute-only and paging-only plans beside it, so the
benefit of combining them is visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .config import options
from .errors import BudgetError
from .graph import CostChain
from .plan import Plan
from .units import format_bytes, parse_bytes

__all__ = ["plan_for_device", "plan_chain", "profile_costs", "DevicePlans"]


@dataclass(frozen=True)
class DevicePlans:
    """The joint plan and its single-mechanism comparisons for one device and budget."""

    device: str
    budget_bytes: int
    joint: Plan | None
    recompute_only: Plan | None
    paging_only: Plan | None
    errors: dict[str, str]

    def summary(self) -> str:
        rows = [f"device {self.device}, budget {format_bytes(self.budget_bytes)}"]
        for label, p in (("joint", self.joint), ("recompute-only", self.recompute_only),
                         ("paging-only", self.paging_only)):
            if p is None:
                rows.append(f"  {label:>15}: infeasible ({self.errors.get(label, '')[:120]})")
                continue
            rows.append(f"  {label:>15}: peak {format_bytes(p.peak_bytes):>10}  step {p.step_time_s * 1e3:9.1f} ms  "
                        f"energy {p.energy_j or 0:8.3f} J  micro-batch {p.micro_batch_size:>4}  "
                        f"{p.policies.count('recompute')} recompute / {p.policies.count('page')} page  "
                        f"({p.solver}" + ("" if p.optimality_gap is None else f", gap {p.optimality_gap:.2%}") + ")")
        return "\n".join(rows)


def profile_costs(model: nn.Module, example: Any, optimizer: torch.optim.Optimizer | None = None,
                  loss_fn: Callable[..., torch.Tensor] | None = None, *, solver: str = "dp") -> CostChain:
    """Profile ``model`` on this machine (as :func:`edgetrain.prepare` does) and return its cost chain.

    ``solver`` is the planner the chain is for: the paging planners (``poet``, ``poet-milp``) need a
    chain without cuts inside residual blocks (``carry_cuts=False``), which ``prepare`` captures for
    them; the keep/recompute planners (``dp`` and the baselines) plan the finer chain.
    """
    from .api import prepare

    opt = optimizer or torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    step = prepare(model, opt, loss_fn or nn.CrossEntropyLoss(), example, **options(solver=solver))
    try:
        return step.costs
    finally:
        step.close()


def plan_chain(costs: CostChain, memory_budget: int | str, *, device: Any = "rpi4", objective: str = "energy",
               time_budget: float | None = None, measured_on: Any = "host", solver: str = "poet") -> DevicePlans:
    """Plan a cost chain for a device profile; see the module doc.

    Args:
        costs: the chain (from :func:`profile_costs`, ``edgetrain profile`` or a JSON file).
        memory_budget: bytes or a size string, the whole training memory on the device.
        device: target profile name or :class:`~edgetrain.devices.DeviceProfile`.
        objective: ``"energy"`` or ``"time"``.
        time_budget: at most this multiple of the fastest step's time.
        measured_on: the profile the chain's times were measured on (``"host"``: this machine, measured),
            ``"flops"`` (or None) to rescale from FLOPs, or ``"device"`` when the chain already holds
            the target device's costs (nothing is rescaled).
        solver: the paging planner, ``"poet"`` (exact DP) or ``"poet-milp"``.

    Raises:
        ValueError: ``solver`` is not a paging planner.
    """
    from .devices import DeviceProfile, load_profile, scale_chain
    from .planners import PLANNERS

    if solver not in ("poet", "poet-milp"):
        raise ValueError(f"plan_chain plans with a paging planner ('poet' or 'poet-milp'), got {solver!r}")
    solve = PLANNERS[solver]
    target = device if isinstance(device, DeviceProfile) else load_profile(device)
    if measured_on == "device":
        scaled = costs
    else:
        source = None if measured_on in (None, "flops") else (
            measured_on if isinstance(measured_on, DeviceProfile) else load_profile(measured_on))
        scaled = scale_chain(costs, source, target)
    budget = parse_bytes(memory_budget)
    out: dict[str, Plan | None] = {}
    errors: dict[str, str] = {}
    for label, paging, recompute in (("joint", True, True), ("recompute-only", False, True),
                                     ("paging-only", True, False)):
        try:
            out[label] = solve(scaled, budget, device=target, objective=objective, time_budget=time_budget,
                               paging=paging, recompute=recompute)
        except BudgetError as e:
            out[label] = None
            errors[label] = str(e)
    return DevicePlans(target.name, budget, out["joint"], out["recompute-only"], out["paging-only"], errors)


def plan_for_device(model: nn.Module, example: Any, memory_budget: int | str, *, device: Any = "rpi4",
         objective: str = "energy", time_budget: float | None = None,
         optimizer: torch.optim.Optimizer | None = None) -> DevicePlans:
    """Profile ``model`` here and plan its training step for ``device`` (no training happens)."""
    return plan_chain(profile_costs(model, example, optimizer, solver="poet"), memory_budget, device=device,
                      objective=objective, time_budget=time_budget)
